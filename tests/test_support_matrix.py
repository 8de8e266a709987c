"""The support sweep: every row of tests/support_table.py, every method its plan lists.

Each listed method must give finite maps, one per image, that are not constant (the heads
that libraries zero-initialise are re-initialised first), or raise a VitexplainError; any
other exception fails. Every method the plan refuses must say why. docs/support.md must be
what ``python tools/support_matrix.py`` writes from these results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import support_table as support

ROOT = Path(__file__).resolve().parents[1]
ROWS = support.rows()
#: Methods whose definition ends in a ReLU / clamp: on a random model every position may carry
#: negative evidence, so an all-zero map is a correct result (a constant non-zero map is not).
CLAMPED = {"attn_gradcam", "legrad", "gradcam", "gradcam++", "layercam"}


@pytest.fixture(scope="module")
def results():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is as fast, and fair to other jobs
    out = {}
    try:
        for row in ROWS:
            try:
                out[row.name] = support.run(row)
            except BaseException as err:  # reported by that row's test
                out[row.name] = err
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("name", [r.name for r in ROWS])
def test_every_listed_method_runs_or_refuses_clearly(results, name):
    sweep = results[name]
    if isinstance(sweep, BaseException):
        raise sweep
    outcomes = sweep.outcomes
    listed = [o for o in outcomes if o.status != "n/a"]
    assert listed and any(o.status == "ok" for o in listed), f"{name}: nothing runs"
    for o in outcomes:
        if o.status == "n/a":
            assert o.detail, f"{name}: {o.method} is not listed and no reason is given"
        if o.status == "ok" and not o.std > 0:
            assert o.method in CLAMPED and o.detail.startswith("zero"), f"{name}: {o.method} gave a constant map"


@pytest.mark.parametrize("name", [r.name for r in ROWS])
def test_the_default_method_works_for_every_family(results, name):
    sweep = results[name]
    if isinstance(sweep, BaseException):
        raise sweep
    if sweep.row.refused:
        assert sweep.default.status == "refused", f"{name}: a refused family explained something"
        return
    assert sweep.default.status == "ok", f"{name}: explain() without a method: {sweep.default.detail}"
    assert sweep.default.method in sweep.family.defaults + tuple(o.method for o in sweep.outcomes if o.status == "ok")


def test_support_doc_is_generated_from_the_sweep(results):
    failed = [n for n, r in results.items() if isinstance(r, BaseException)]
    if failed:
        pytest.fail(f"the sweep failed for {failed}")
    pairs = [results[row.name] for row in ROWS]
    hint = "out of date: run python tools/support_matrix.py"
    assert (ROOT / "docs" / "support.md").read_text() == support.support_doc(pairs) + "\n", hint
