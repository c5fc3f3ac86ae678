"""The main job's CPU thread policy (minference.app.threads) and the torch backend's head workers
(issue 30)."""

from __future__ import annotations

import pytest
import torch

import minference.torch_backend as tb
from minference.app import threads as T


@pytest.fixture
def machine(monkeypatch):
    """A fake machine: ``set(cores, load)``; no thread variable in the environment."""
    for name in T.THREAD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(T, "_STARTING_THREADS", torch.get_num_threads())

    def set_machine(cores: int, load: float) -> None:
        monkeypatch.setattr(T, "usable_cores", lambda: cores)
        monkeypatch.setattr(T, "_load", lambda: load)

    return set_machine


@pytest.mark.parametrize("cores,load", [(2, 0.0), (2, 0.51), (2, 4.2), (8, 2.6), (1, 0.0)])
def test_policy_is_every_usable_core_whatever_the_load(machine, cores, load):
    machine(cores, load)
    assert T.choose_threads() == T.ThreadChoice(cores, "policy", load, cores)


def test_the_users_count_wins(machine, monkeypatch):
    machine(2, 4.0)
    assert T.choose_threads(2) == T.ThreadChoice(2, "--threads", 4.0, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert T.choose_threads().reason == "OMP_NUM_THREADS"
    assert T.choose_threads().threads == torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(T, "_STARTING_THREADS", torch.get_num_threads() + 1)  # as after torch.set_num_threads
    assert T.choose_threads().reason == "torch.set_num_threads"
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="threads must be a positive int"):
            T.choose_threads(bad)


def test_head_workers_give_the_single_thread_result():
    """The fused path's heads on worker threads (2 intra-op threads) equal the plain loop's result
    (1 thread) bit for bit: each head runs the same single-threaded pieces either way."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 6, 300, 16, generator=g), torch.randn(1, 2, 300, 16, generator=g), \
        torch.randn(1, 2, 300, 16, generator=g)
    slash = torch.tensor([[[0, 1, 2, 3, 70, 71, 150]] * 6], dtype=torch.int32)
    vertical = torch.tensor([[[0, 5, 99, 200]] * 6], dtype=torch.int32)
    blocks = torch.tensor([[[[0, i] for i in range(5)]] * 6], dtype=torch.int32)
    calls = lambda: (tb.vertical_slash_attention(q, k, v, vertical, slash, fill_gaps=3),  # noqa: E731
                     tb.ashape_attention(q, k, v, 4, 90), tb.block_sparse_attention(q, k, v, blocks, block=64))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = calls()
        torch.set_num_threads(2)
        two = calls()
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
