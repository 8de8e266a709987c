"""Devices and torchrun: which shard this process takes, where it runs, how ranks meet.

When ``WORLD_SIZE > 1`` (torchrun, SLURM wrappers...), rank ``r`` takes items
``r, r + W, r + 2W, ...`` of the sorted list, uses ``cuda:{LOCAL_RANK}`` on GPU, and ranks
meet through ``gloo`` (CPU) or ``nccl`` (CUDA) collectives: after the output lock is taken
(so nobody writes before it) and when every rank is done (rank 0 then merges the manifest
and writes the summary).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ..errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Dist", "resolve_device", "device_and_amp", "autocast"]


@dataclass
class Dist:
    """The distributed setting from the environment (one process: rank 0 of 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @classmethod
    def from_env(cls) -> "Dist":
        def env(name: str, default: int) -> int:
            try:
                return int(os.environ.get(name, default))
            except ValueError:
                raise UsageError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None

        world = env("WORLD_SIZE", 1)
        rank = env("RANK", 0)
        local = env("LOCAL_RANK", rank)
        if world < 1 or not 0 <= rank < world:
            raise UsageError(f"bad distributed environment: RANK={rank}, WORLD_SIZE={world}")
        return cls(rank=rank, world=world, local_rank=local)

    def init(self, device: "torch.device") -> None:
        if self.world <= 1:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            try:
                if device.type == "cuda":
                    try:  # binds NCCL to this rank's GPU (torch >= 2.3)
                        dist.init_process_group(backend, device_id=device)
                    except TypeError:
                        dist.init_process_group(backend)
                else:
                    dist.init_process_group(backend)
            except (ValueError, RuntimeError) as e:  # no MASTER_ADDR / MASTER_PORT, the rendezvous unreachable
                detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise UsageError(
                    f"cannot join the distributed run (RANK={self.rank}, WORLD_SIZE={self.world} in the environment): "
                    f"{detail}. Launch it with torchrun (which sets MASTER_ADDR and MASTER_PORT), or unset "
                    "WORLD_SIZE to run as one process") from None
            self.initialized_here = True

    def gather(self, obj: Any) -> list[Any]:
        if self.world <= 1:
            return [obj]
        import torch.distributed as dist

        result: list[Any] = [None] * self.world
        dist.all_gather_object(result, obj)
        return result

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.initialized_here:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.initialized_here = False


def resolve_device(spec: str, dist: Dist) -> "torch.device":
    import torch

    spec = (spec or "auto").lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available here; use --device cpu")
        if spec == "cuda":
            index = dist.local_rank if dist.world > 1 else torch.cuda.current_device()
            spec = f"cuda:{index}"
        device = torch.device(spec)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) here")
        torch.cuda.set_device(device)
        return device
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"--device {spec!r}: not a device; use cpu, cuda or cuda:N") from None
    try:  # a device type this torch was not built for (mps on Linux, xla without torch_xla, ...)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--device {spec}: not usable here ({detail}); use --device cpu") from None
    return device


def device_and_amp(spec: str, amp: Optional[str], dist: Dist) -> tuple["torch.device", Any]:
    """The device to run on and the autocast dtype (None without ``--amp``)."""
    import torch

    device = resolve_device(spec, dist)
    autocast_dtype = None
    if amp:
        if amp not in ("bf16", "fp16"):
            raise UsageError(f"--amp {amp!r}: choose bf16 or fp16")
        if device.type != "cuda":
            raise UsageError(f"--amp {amp} needs a CUDA device (--device cuda); on {device.type} run without --amp")
        autocast_dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return device, autocast_dtype


def autocast(autocast_dtype: Any) -> Any:
    """CUDA autocast with ``autocast_dtype``, or a no-op context when it is None."""
    import contextlib

    import torch

    return (torch.autocast(device_type="cuda", dtype=autocast_dtype) if autocast_dtype is not None
            else contextlib.nullcontext())
