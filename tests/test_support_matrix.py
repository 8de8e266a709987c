"""The support sweep: every family of vitexplain/support.py, every method its adapter lists.

Each listed method must give finite maps of the right shape that are not constant (the heads
that libraries zero-initialise are re-initialised first), or raise a VitexplainError; any
other exception fails. The README's matrix and docs/support.md must be what
``python tools/support_matrix.py`` writes from these results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vitexplain import support

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = support.families()
#: Methods whose definition ends in a ReLU / clamp: on a random model every position may carry
#: negative evidence, so an all-zero map is a correct result (a constant non-zero map is not).
CLAMPED = {"attn_gradcam", "legrad", "gradcam", "gradcam++", "layercam"}


@pytest.fixture(scope="module")
def results():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is as fast, and fair to other jobs
    out = {}
    try:
        for family in FAMILIES:
            try:
                out[family.name] = support.run(family)
            except BaseException as err:  # reported by that family's test
                out[family.name] = err
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_every_listed_method_runs_or_refuses_clearly(results, name):
    outcomes = results[name]
    if isinstance(outcomes, BaseException):
        raise outcomes
    listed = [o for o in outcomes if o.status != "n/a"]
    assert listed and any(o.status == "ok" for o in listed), f"{name}: nothing runs"
    for o in outcomes:
        if o.status == "n/a":
            assert o.detail, f"{name}: {o.method} is not listed and no reason is given"
        if o.status == "ok" and not o.std > 0:
            assert o.method in CLAMPED and o.detail.startswith("zero"), f"{name}: {o.method} gave a constant map"


def test_readme_matrix_and_support_doc_are_generated_from_the_sweep(results):
    failed = [n for n, r in results.items() if isinstance(r, BaseException)]
    if failed:
        pytest.fail(f"the sweep failed for {failed}")
    pairs = [(family, results[family.name]) for family in FAMILIES]
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- support-matrix:start -->\n", 1)[1].split("\n<!-- support-matrix:end -->", 1)[0]
    hint = "out of date: run python tools/support_matrix.py"
    assert block == support.readme_table(pairs), hint
    assert (ROOT / "docs" / "support.md").read_text() == support.support_doc(pairs) + "\n", hint
