"""vx.threads: the thread count leaves a core free, and a user's choice is kept."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import vitexplain as vx
from vitexplain import threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def fake_machine(monkeypatch, cpus: int, load: float) -> None:
    monkeypatch.setattr(threads, "cpus", lambda: cpus)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    for var in threads.ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("cpus, load, expected", [
    (2, 0.0, 1),    # one core left to a second job
    (1, 0.0, 1),
    (16, 0.0, 15),
    (16, 6.2, 10),  # six cores busy with other jobs
    (4, 9.0, 1),    # overloaded: never below 1
])
def test_pick_leaves_a_core_and_the_busy_ones(monkeypatch, cpus, load, expected):
    fake_machine(monkeypatch, cpus, load)
    assert threads.pick() == expected
    assert threads.pick(cap=2) == min(expected, 2)


@pytest.mark.parametrize("cpus, load, expected", [(2, 0.1, 2), (2, 0.8, 1), (2, 5.0, 1), (16, 6.2, 10)])
def test_the_batch_commands_take_every_idle_core(monkeypatch, cpus, load, expected):
    fake_machine(monkeypatch, cpus, load)
    assert threads.pick(reserve=0) == expected == threads.default_for_cli()


def test_limit_lowers_the_start_up_default(monkeypatch, restore_threads):
    fake_machine(monkeypatch, 8, 0.0)
    torch.set_num_threads(8)  # torch's start-up default on 8 CPUs
    assert vx.threads.limit() == 7 == torch.get_num_threads()


def test_limit_keeps_a_count_the_user_set(monkeypatch, restore_threads):
    fake_machine(monkeypatch, 8, 0.0)
    torch.set_num_threads(3)  # not a start-up default: the user's
    assert threads.chosen_by_user()
    assert vx.threads.limit() == 3 == torch.get_num_threads()


def test_limit_keeps_the_environment_choice(monkeypatch, restore_threads):
    fake_machine(monkeypatch, 8, 0.0)
    torch.set_num_threads(8)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert vx.threads.limit() == 8 == torch.get_num_threads()


def test_limit_never_raises_the_count(monkeypatch, restore_threads):
    fake_machine(monkeypatch, 8, 0.0)
    torch.set_num_threads(4)  # the physical-core default on 8 hardware threads
    assert vx.threads.limit() == 4


# --threads of the batch commands: set for the run, restored after it; the command line's default
def test_export_runs_with_its_threads_and_restores_them(tmp_path, monkeypatch, restore_threads):
    from batch_helpers import images, save_tiny

    import vitexplain.batch.export as export_module
    from vitexplain.batch.export import ExportOptions, export

    seen = []
    real_drive = export_module.drive

    def drive(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_drive(*args, **kwargs)

    monkeypatch.setattr(export_module, "drive", drive)
    src = images(tmp_path / "in", ["a.png"])
    torch.set_num_threads(2)
    opts = ExportOptions(inputs=[str(src)], out=str(tmp_path / "out"), model=save_tiny(tmp_path / "ckpt"),
                         methods=["rollout"], quiet=True, threads=1)
    assert export(opts).exit_code == 0
    assert seen == [1] and torch.get_num_threads() == 2
    opts.threads = None  # the API's default: torch as it is
    opts.overwrite = True
    assert export(opts).exit_code == 0
    assert seen == [1, 2] and torch.get_num_threads() == 2


def test_threads_zero_is_a_usage_error(tmp_path):
    from vitexplain.batch.export import ExportOptions, export

    with pytest.raises(vx.UsageError, match="--threads"):
        export(ExportOptions(inputs=[str(tmp_path)], out=str(tmp_path / "out"), threads=0))


@pytest.mark.parametrize("command", ["export", "caption", "explore"])
def test_the_command_line_default_is_pick_unless_the_environment_chose(monkeypatch, command):
    from vitexplain.batch.caption import CaptionOptions
    from vitexplain.batch.explore import ExploreOptions
    from vitexplain.batch.export import ExportOptions
    from vitexplain.batch.options import from_args
    from vitexplain.cli import build_parser

    cls = {"export": ExportOptions, "caption": CaptionOptions, "explore": ExploreOptions}[command]
    out = "p.html" if command == "explore" else "o"
    fake_machine(monkeypatch, 8, 2.0)
    args = build_parser().parse_args([command, "in", "--out", out])
    assert from_args(cls, args).threads == 6  # the idle cores
    args = build_parser().parse_args([command, "in", "--out", out, "--threads", "3"])
    assert from_args(cls, args).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun sets it for each process
    args = build_parser().parse_args([command, "in", "--out", out])
    assert from_args(cls, args).threads is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_export_draws_and_writes_below_the_models_priority(tmp_path, monkeypatch):
    """The writer threads run WRITER_NICE steps below the model's thread; the process is left as it was."""
    import threading

    from batch_helpers import images, save_tiny

    import vitexplain.batch.export as export_module
    from vitexplain.batch.export import ExportOptions, export
    from vitexplain.batch.shard import WRITER_NICE

    seen = []
    real = export_module._write_overlays

    def write(*args, **kwargs):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(*args, **kwargs)

    monkeypatch.setattr(export_module, "_write_overlays", write)
    src = images(tmp_path / "in", ["a.png", "b.png"])
    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    opts = ExportOptions(inputs=[str(src)], out=str(tmp_path / "out"), model=save_tiny(tmp_path / "ckpt"),
                         methods=["rollout"], quiet=True, write_threads=2)
    assert export(opts).exit_code == 0
    assert seen and set(seen) == {min(19, main_before + WRITER_NICE)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
