"""The backend seam (minference.backend): both backends implement the protocol the dispatcher
calls, and a Triton call checks its arguments' form once, at the dispatcher's edge."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from minference import backend as B
from minference.dispatch import sparse_prefill
from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash
from minference.testing.strategies import AttnShape, qkv

#: The protocol's members with their parameter names (the builders' keywords come as **kwargs).
MEMBERS = {name: list(inspect.signature(fn).parameters)
           for name, fn in inspect.getmembers(B.Backend, inspect.isfunction) if not name.startswith("_")}


def test_the_protocol_names_every_step() -> None:
    assert set(MEMBERS) == {"check_plan", "check_launch", "value_guard", "ashape", "vertical_slash_group_index",
                            "vertical_slash", "block_sparse_group_index", "block_sparse", "dense",
                            "vertical_slash_index", "block_sparse_index"}


@pytest.mark.parametrize("name", ["triton", "torch"])
def test_each_backend_implements_the_protocol(name: str) -> None:
    be = B.get_backend(name)
    assert be.name == name and B.get_backend(name) is be
    for member, params in MEMBERS.items():
        got = list(inspect.signature(getattr(type(be), member)).parameters)
        if member.endswith("_index") and member.startswith(("vertical_slash", "block_sparse")) \
                and "group" not in member:
            assert got[:len(got) - 1] == params[:len(got) - 1] and got[-1] == "kwargs", (name, member, got)
        else:
            assert got == params, (name, member, got)


def test_get_backend_refuses_other_names() -> None:
    with pytest.raises(ValueError, match="backend must be 'triton' or 'torch'"):
        B.get_backend("auto")


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "torch"])
def test_a_call_checks_q_once(monkeypatch, backend) -> None:
    """Following q through one sparse_prefill call (every pattern, the query-aware block scores, the
    dense tail): its form is checked by the dispatcher only; the builders, the scorer and the
    launchers (Triton) or attention functions (torch) run with checked=True."""
    calls = []
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("minference") and m is not None]:
        real = getattr(mod, "check_qkv_rows", None)
        if real is not None and getattr(real, "__module__", None) == "minference._checks":
            def counted(*a, _real=real, _mod=mod.__name__, **kw):
                calls.append(_mod)
                return _real(*a, **kw)

            monkeypatch.setattr(mod, "check_qkv_rows", counted)
    plan = [VerticalSlash(vertical=6, slash=10, last_q=16), AShape(sink=2, window=16),
            BlockSparse(top_k=3, block=16, estimate="query"), BlockSparse(top_k=2, block=16), Dense()]
    q, k, v = qkv(AttnShape(B=1, Hq=5, Hkv=1, N=48, D=16), torch.float32, "cpu", seed=0)
    out = sparse_prefill(q, k, v, plan, dense_threshold=0, dense_tail=8, backend=backend,
                         seqlens=torch.tensor([40], dtype=torch.int32))
    assert calls == ["minference.dispatch"]
    assert torch.isfinite(out).all()
