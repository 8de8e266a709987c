"""Shared test settings: deterministic, offline, small."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is as fast and does not fight over shared CI cores (a module's tests
    ask for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



def pytest_sessionfinish(session, exitstatus):
    """Forget dynamo's cleanup hooks once the tests are done (the tests that compile FlexAttention leave some on
    flex_attention's code, which lives until interpreter shutdown): run then, they find dynamo's globals gone and
    print an ignored AttributeError under the test summary (torch's CleanupHook; a no-op where torch has none)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    manager = getattr(getattr(utils, "CleanupManager", None), "instance", None)
    if manager is not None and hasattr(manager, "clear"):
        manager.clear()
