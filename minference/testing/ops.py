"""Recording the aten ops a piece of code dispatches (host-diet and no-sync tests)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RecordOps"]


class RecordOps(TorchDispatchMode):
    """``with RecordOps() as ops: ...`` runs the code as usual and leaves in ``ops.names`` the
    packet name of every aten op it dispatched (``"aminmax"``, ``"where"``, ...), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
