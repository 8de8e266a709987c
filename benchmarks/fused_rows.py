"""Could rollout read its rows through the fused kernel instead of keeping exact probabilities? Measured per call.

Rollout needs, per attention call, only ``u P`` (the carried row times the call's probabilities, heads averaged),
not P itself. torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, which
``F.scaled_dot_product_attention`` runs on CPU) returns each query's log-sum-exp ``l_i`` beside the output, at
no extra cost. With it ``(u P)_j = sum_i u_i exp(s_ij - l_i) = exp(LSE_i(s_ji + log u_i - l_i))``: the
log-sum-exp of a second fused call with queries and keys swapped and the bias ``log u_i - l_i`` (plus the
call's own mask, transposed) on every key ``i`` of it. Nothing N_q x N_k is ever written, the model runs its
own fused kernel, and the row is exact to float32 rounding.

Per model, summed over its SDPA calls, each call on the model's own q, k, v timed alone (the fastest of
interleaved rounds, one torch thread, CPU time):

* ``forward``: the plain model (median of interleaved runs);
* ``exact``: what vitexplain's rollout does on CPU (vitexplain.recording.materialize): the call computed
  eagerly keeping P, then ``u P`` from it; extra = that minus the fused kernel;
* ``swapped``: the fused kernel with its log-sum-exp, then the swapped fused call for ``u P``; extra = that
  minus the fused kernel;
* each extra as a fraction of the forward, and the swapped row's largest error relative to ``u P`` in
  float64 (``u`` a random positive row).

The swapped call costs a whole fused call again (its values must have q's head size, and its exp is per
score), so it only wins where the eager softmax costs more than a second fused call. Prints only; writes
nothing to docs/.

Usage::

    python benchmarks/fused_rows.py [--batch 2] [--rounds 7] [--sam-size 256]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from vitexplain.recording.materialize import attention_with_probs, can_materialize
from _common import interleaved_times, machine, table
from hier import SdpaCalls, _CLI_BATCH, best_times, models

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def swapped_row(q: Tensor, k: Tensor, lse: Tensor, u: Tensor, bias: Optional[Tensor], scale: float) -> Tensor:
    """``u P`` averaged over heads, from the log-sum-exp of a fused call with queries and keys swapped.

    Args:
        q: (B, H, N_q, E); k: (B, H, N_k, E); lse: (B, H, N_q) the call's log-sum-exp; u: (B, N_q) >= 0.
        bias: the call's additive mask broadcastable to (B, H, N_q, N_k), or None.

    Returns:
        (B, N_k).
    """
    b = (u.log()[:, None, :] - lse).unsqueeze(2)  # (B, H, 1, N_q): per swapped key i, log u_i - l_i
    if bias is not None:
        b = b + bias.transpose(-2, -1)
    _, out = _FLASH(k, q, q, 0.0, False, attn_mask=b, scale=scale)  # (values: q, any tensor of q's head size)
    return out.exp().mean(1)


def additive(mask: Optional[Tensor]) -> Optional[Tensor]:
    """A call's mask as an additive float bias (bool: -inf where False)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape).masked_fill_(~mask, -math.inf)


def measure(build, size: tuple[int, int], batch: int, rounds: int) -> Optional[list[object]]:
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(batch, 3, *size)
    spy = SdpaCalls()
    with torch.no_grad(), spy:
        model(x)
    with torch.no_grad():
        forward = statistics.median(interleaved_times({"f": lambda: model(x)}, reps=max(5, rounds),
                                                      clock=time.process_time)["f"])
    exact = swapped = 0.0
    error = 0.0
    used = 0
    for args, kwargs in spy.calls:
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        scale = kwargs.get("scale")
        if (kwargs.get("is_causal") or not can_materialize(q if q.dim() == 4 else q.unsqueeze(1),
                                                           k if k.dim() == 4 else k.unsqueeze(1),
                                                           v if v.dim() == 4 else v.unsqueeze(1), mask,
                                                           float(kwargs.get("dropout_p", 0.0)), False)
                or k.shape[-3] != q.shape[-3]):
            continue
        q4, k4, v4 = (t if t.dim() == 4 else t.unsqueeze(1) for t in (q, k, v))
        bias = additive(mask)
        if bias is not None and bias.dim() == 3 and q.dim() == 3:  # (B, N_q, N_k) of a headless call
            bias = bias.unsqueeze(1)
        elif bias is not None and bias.dim() < 4:
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        eager_mask = mask if mask is None or mask.dtype == torch.bool else bias  # (with the head dim added)
        s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        u = torch.rand(q4.shape[0], q4.shape[2]) + 0.1
        with torch.no_grad():
            _, lse = _FLASH(q4, k4, v4, 0.0, False, attn_mask=bias, scale=s)
            probs = torch.softmax(q4.double() @ k4.double().transpose(-2, -1) * s
                                  + (0 if bias is None else bias.double()), -1)
            want = torch.einsum("bi,bhij->bj", u.double(), probs) / probs.shape[1]
            got = swapped_row(q4, k4, lse, u, bias, s)
        error = max(error, float(((got.double() - want).abs().max() / want.abs().max())))

        def exact_row() -> Tensor:
            _, p = attention_with_probs(q4, k4, v4, attn_mask=eager_mask, scale=scale)
            return torch.matmul(u[:, None, None, :], p).mean(1)

        def swapped_run() -> Tensor:
            _, l = _FLASH(q4, k4, v4, 0.0, False, attn_mask=bias, scale=s)
            return swapped_row(q4, k4, l, u, bias, s)

        best = best_times({"fused": lambda: F.scaled_dot_product_attention(*args, **kwargs),
                           "exact": exact_row, "swapped": swapped_run}, rounds)
        exact += best["exact"] - best["fused"]
        swapped += best["swapped"] - best["fused"]
        used += 1
    if not used:
        return None
    return [used, f"{forward * 1e3:.2f}", f"{exact * 1e3:.2f}", f"{exact / forward:.3f}", f"{swapped * 1e3:.2f}",
            f"{swapped / forward:.3f}", f"{error:.1e}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sam-size", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for label, build, size, batch in models(args.sam_size, args.batch):
        row = measure(build, size, batch, args.rounds)
        rows.append([f"{label}, batch {batch}"] + (row or ["no SDPA call it can compute", "", "", "", "", "", ""]))
        print(rows[-1], flush=True)
    print(f"\n{machine()}, CLI batch {_CLI_BATCH}\n")
    print(table(["model", "SDPA calls", "forward ms", "exact: extra ms", "exact: extra / forward",
                 "swapped fused: extra ms", "swapped fused: extra / forward", "swapped: max rel. error"], rows))


if __name__ == "__main__":
    main()
