"""vx.threads: the thread count leaves a core free, and a user's choice is kept."""

from __future__ import annotations

import os

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
