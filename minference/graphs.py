"""CUDA graphs for repeated prefill shapes: capture :func:`~minference.dispatch.sparse_prefill` once
per (caller key, shapes, arguments) and replay it.

An eager sparse prefill of one layer costs tens of small launches (per-head budgets, index
builders, the vertical-slash conversion, one kernel per pattern group, the dense tail) and their
Python around them; on the real testbed at 16K-32K that host time, not the device, sets the time
to first token. With ``validate=False`` the whole Triton path is free of host synchronisation,
so it can be captured in a CUDA graph and replayed with one launch.

:class:`PrefillGraphs` is a bounded cache of such graphs::

    graphs = PrefillGraphs()
    out = graphs(layer, q, k, v, plan, seqlens=lens, seqstarts=starts, dense_threshold=0)

The first call of a key captures (warm-up on a side stream, then capture, then one replay), later
calls copy the inputs into static buffers and replay. The result is the cache's **static output
buffer**: the next call of the same shape group overwrites it (consume or ``clone()`` it first;
a transformers attention layer consumes it in its ``o_proj`` before the next layer runs).

What is cached, and what is shared:

* A **shape group** is one signature of the tensor arguments: shape, strides, dtype and device
  of ``q``, ``k``, ``v`` and of every tensor keyword (``seqlens``, ``seqstarts``; ``None`` and a
  tensor differ). A group owns the static buffers (``q``, ``k``, ``v``, the tensor keywords, with
  the caller's strides, and one output like ``q``) and one private memory pool
  (:func:`torch.cuda.graph_pool_handle`). Every graph of the group reads and writes those same
  buffers, and its temporaries come from that pool, so 24 layers at one length hold one set of
  buffers and one layer's temporaries, not 24.
* A **graph** is one (caller key, plan, every non-tensor keyword) within a group. The caller key
  is any hashable value that tells calls apart (the integration passes the layer index).
  Keyword values must be hashable; they are part of the key as given (an omitted keyword and its
  default spelled out make two keys, both correct).

The ordering rule. PyTorch lets graphs share a private pool only if they are replayed in the
order they were captured and never concurrently: a capture may reuse memory that an earlier
graph of the pool freed, so a graph replayed out of turn can overwrite what a later graph left
live there. Each group therefore records its capture order and accepts, per call, only the next
graph of that order or the first one (a new round, e.g. the next prompt through layer 0); a new
key is captured only at the end of a round (right after the last graph of the order). Any other
call runs :func:`~minference.dispatch.sparse_prefill` directly (eagerly, outside the pool) and is
counted in ``stats["out_of_order"]``; the group's graphs stay valid. A model's forward calls
its layers in the same order every time, so it always replays. Concurrency: calls are serialised
by a host lock, and when a group is used from another stream than its last call, the new stream
first waits for the old one on the device (no host sync). The sparse path itself must leave
nothing allocated in the pool after its capture (every temporary freed; its device caches are
filled by the warm-up, outside the pool): a capture that retains memory is counted in
``stats["retained_bytes"]`` and warned about.

Bounds: at most ``max_shapes`` groups (least recently used evicted whole, with its graphs,
buffers and pool) and ``max_graphs_per_shape`` graphs in a group (further keys run directly).
:meth:`PrefillGraphs.clear` drops everything (``torch.cuda.empty_cache()`` then returns the
memory to the driver).

No graph, a direct call instead (counted in ``stats["direct"]``): tensors not on one CUDA device
(the CPU, the Triton interpreter), a backend that resolves to ``"torch"`` (it reads row lengths on
the host), an input that requires grad while grad mode is on, and a call made while the current
stream is itself being captured, and ``validate=True``: value checks read tensors on the host at
every call, which is what a graph avoids, so ``validate`` defaults to ``False`` here.

docs/integration.md ("CUDA graphs") gives the memory cost and when this pays; none of it is
measured yet.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from minference._checks import capturing
from minference.dispatch import resolve_backend, sparse_prefill
from minference.index import prepare_plan

__all__ = ["PrefillGraphs", "DEFAULT_MAX_SHAPES", "DEFAULT_MAX_GRAPHS_PER_SHAPE"]

#: Shape groups (distinct tensor signatures, e.g. prompt lengths) a cache keeps by default.
DEFAULT_MAX_SHAPES = 4
#: Graphs (caller keys x arguments) one shape group keeps by default; far above a model's layers.
DEFAULT_MAX_GRAPHS_PER_SHAPE = 256
_STATS = ("captures", "replays", "direct", "out_of_order", "over_limit", "evictions", "retained_bytes")


@dataclass(eq=False)
class _Graph:
    """One captured call: its place in the group's capture order and how to replay it."""

    position: int
    replay: Callable[[], None]
    pinned: Any = None  # device tensors the capture reads from caches it does not own


@dataclass(eq=False)
class _Group:
    """Static buffers, memory pool and capture order shared by the graphs of one signature."""

    device: torch.device
    inputs: dict[str, torch.Tensor]
    out: torch.Tensor
    pool: Any
    graphs: dict[Hashable, _Graph] = field(default_factory=dict)
    order: list[Hashable] = field(default_factory=list)
    cursor: int = 0  # position in ``order`` of the graph that may replay next
    stream: Any = None  # stream of the last call


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _buffer_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor with ``x``'s shape, dtype, device and (where they do not overlap)
    strides, so the captured kernels see the caller's layout."""
    if any(s == 0 and n > 1 for s, n in zip(x.stride(), x.shape)):  # broadcast views cannot be written
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


class _CudaSteps:
    """The device-specific steps of :class:`PrefillGraphs` (tests swap in eager ones to run the
    bookkeeping on the CPU)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}  # one capture stream per device: pool sharing wants one

    def graphable(self, tensors: dict[str, Any], backend: str) -> bool:
        """Whether this call may run through a graph (else it runs directly)."""
        q = tensors["q"]
        if not all(isinstance(x, torch.Tensor) for x in tensors.values()) or q.device.type != "cuda":
            return False
        if any(x.device != q.device for x in tensors.values()):
            return False
        if torch.is_grad_enabled() and any(x.requires_grad for x in tensors.values()):
            return False
        return resolve_backend(backend, q.device) == "triton" and not capturing()

    def pool(self, device: torch.device) -> Any:
        return torch.cuda.graph_pool_handle()

    def order_streams(self, group: _Group) -> None:
        """When this call's stream is not the group's last one, make it wait for that one on the
        device (no host sync) and tell the allocator the buffers are used on it."""
        stream = torch.cuda.current_stream(group.device)
        if group.stream is not None and group.stream != stream:
            stream.wait_stream(group.stream)
            for x in (*group.inputs.values(), group.out):
                x.record_stream(stream)
        group.stream = stream

    def capture(self, step: Callable[[], None], group: _Group, warmup: int) -> tuple[Callable[[], None], int]:
        """PyTorch's recipe: ``warmup`` eager calls on a side stream, then the capture on that same
        stream (one stream for every capture that shares a pool) into ``group``'s pool. Returns the
        replay and the bytes the capture left allocated (0 when every temporary was freed)."""
        device = group.device
        with torch.cuda.device(device):
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            current = torch.cuda.current_stream(device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    step()
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=group.pool, stream=stream):
                before = torch.cuda.memory_allocated(device)  # allocator statistics: host only
                step()
                retained = torch.cuda.memory_allocated(device) - before
        return graph.replay, retained


class PrefillGraphs:
    """A bounded cache of CUDA graphs of :func:`minference.dispatch.sparse_prefill` (see the
    module docstring for what is cached and shared, the ordering rule and the fallbacks).

    Args:
        max_shapes: shape groups kept; the least recently used one is evicted whole.
        max_graphs_per_shape: graphs kept in one group; calls of further keys run directly.
        warmup: eager calls on the capture stream before each capture (compiles the Triton
            kernels and fills the dispatcher's device caches outside the graph pool).

    Call it as ``graphs(key, q, k, v, plan, **sparse_prefill_keywords)``. ``stats`` counts
    captures, replays (every graph launch, the one right after a capture included), direct calls,
    out-of-order and over-limit fallbacks, evictions and retained bytes; ``len(graphs)`` is the
    number of captured graphs, ``shapes`` the number of shape groups.
    """

    def __init__(self, *, max_shapes: int = DEFAULT_MAX_SHAPES,
                 max_graphs_per_shape: int = DEFAULT_MAX_GRAPHS_PER_SHAPE, warmup: int = 1) -> None:
        self._max_shapes = _check_count("max_shapes", max_shapes)
        self._max_graphs = _check_count("max_graphs_per_shape", max_graphs_per_shape)
        self._warmup = _check_count("warmup", warmup)
        self._groups: OrderedDict[tuple, _Group] = OrderedDict()
        self._steps = _CudaSteps()
        self._lock = threading.RLock()
        self._stats = dict.fromkeys(_STATS, 0)
        self._warned = False

    @property
    def max_shapes(self) -> int:
        return self._max_shapes

    @property
    def max_graphs_per_shape(self) -> int:
        return self._max_graphs

    @property
    def stats(self) -> dict[str, int]:
        """A copy of the counters (see the class docstring)."""
        with self._lock:
            return dict(self._stats)

    @property
    def shapes(self) -> int:
        """Shape groups held now."""
        return len(self._groups)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(g.graphs) for g in self._groups.values())

    def __repr__(self) -> str:
        return (f"PrefillGraphs({len(self)} graphs in {self.shapes} shape groups, max_shapes={self._max_shapes}, "
                f"max_graphs_per_shape={self._max_graphs})")

    def clear(self) -> None:
        """Drop every graph, static buffer and memory pool (the counters stay)."""
        with self._lock:
            self._groups.clear()

    def __call__(self, key: Hashable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: Sequence, /, **kwargs: Any) -> torch.Tensor:
        """``sparse_prefill(q, k, v, plan, **kwargs)`` (``validate`` defaults to ``False``), through
        the graph of ``key`` and these arguments when one can be used. Returns the shape group's
        static output on the graph path (overwritten by the group's next call), else the direct
        call's result."""
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"key must be hashable (e.g. the layer index), got {type(key).__name__}") from None
        twice = sorted({"q", "k", "v", "plan"} & kwargs.keys())
        if twice:
            raise TypeError(f"{', '.join(twice)} given as keyword: q, k, v and plan are positional")
        kwargs.setdefault("validate", False)
        tensors = {"q": q, "k": k, "v": v}
        tensors.update(sorted((n, x) for n, x in kwargs.items() if isinstance(x, torch.Tensor)))
        if kwargs["validate"] is not False or not self._steps.graphable(tensors, kwargs.get("backend", "auto")):
            with self._lock:
                self._stats["direct"] += 1
            return sparse_prefill(q, k, v, plan, **kwargs)
        if isinstance(plan, (str, bytes)) or not isinstance(plan, Sequence):
            raise TypeError(f"plan must be a sequence of patterns, got {type(plan).__name__}")
        plan = tuple(plan)
        static = sorted((n, x) for n, x in kwargs.items() if n not in tensors)
        call = (key, plan, tuple(static))
        try:
            hash(call)
        except TypeError:
            bad = [n for n, x in static if not _hashable(x)] or ["plan"]
            raise TypeError(f"a graph's key holds every argument but the tensors, so they must be hashable; "
                            f"{', '.join(bad)} is not") from None
        signature = tuple((n, tuple(x.shape), x.stride(), x.dtype, x.device) for n, x in tensors.items())
        with self._lock:
            return self._run(signature, call, tensors, plan, kwargs)

    # -----------------------------------------------------------------------------------------

    def _run(self, signature: tuple, call: tuple, tensors: dict[str, torch.Tensor], plan: tuple,
             kwargs: dict[str, Any]) -> torch.Tensor:
        group = self._groups.get(signature)
        if group is None:
            group = self._new_group(signature, tensors)
        else:
            self._groups.move_to_end(signature)
        graph = group.graphs.get(call)
        if graph is None:
            if group.cursor != len(group.order):  # mid-round: the pool may hold a later graph's state
                return self._direct("out_of_order", tensors, plan, kwargs)
            if len(group.order) >= self._max_graphs:
                return self._direct("over_limit", tensors, plan, kwargs)
        elif graph.position not in (group.cursor, 0):
            return self._direct("out_of_order", tensors, plan, kwargs)
        self._steps.order_streams(group)
        for name, x in tensors.items():
            group.inputs[name].copy_(x)
        if graph is None:
            try:
                graph = self._capture(group, call, plan, kwargs)
            except BaseException:
                if not group.graphs:  # nothing captured: do not keep its buffers
                    self._groups.pop(signature, None)
                raise
        graph.replay()
        group.cursor = graph.position + 1
        self._stats["replays"] += 1
        return group.out

    def _direct(self, reason: str, tensors, plan, kwargs) -> torch.Tensor:
        self._stats[reason] += 1
        return sparse_prefill(tensors["q"], tensors["k"], tensors["v"], plan, **kwargs)

    def _new_group(self, signature: tuple, tensors: dict[str, torch.Tensor]) -> _Group:
        while len(self._groups) >= self._max_shapes:
            self._groups.popitem(last=False)
            self._stats["evictions"] += 1
        with torch.inference_mode(False), torch.no_grad():  # buffers usable in and out of inference mode
            inputs = {n: _buffer_like(x) for n, x in tensors.items()}
            out = _buffer_like(tensors["q"])
        device = tensors["q"].device
        group = _Group(device, inputs, out, self._steps.pool(device))
        self._groups[signature] = group
        return group

    def _capture(self, group: _Group, call: tuple, plan: tuple, kwargs: dict[str, Any]) -> _Graph:
        """Capture ``call`` at the end of ``group``'s order (its inputs are already copied in)."""
        inputs, out = group.inputs, group.out
        args = dict(kwargs)
        args.update((n, x) for n, x in inputs.items() if n not in ("q", "k", "v"))

        def step() -> None:
            out.copy_(sparse_prefill(inputs["q"], inputs["k"], inputs["v"], plan, **args))

        replay, retained = self._steps.capture(step, group, self._warmup)
        graph = _Graph(len(group.order), replay)
        # the capture read the plan's device tensors from the dispatcher's bounded cache: hold them
        graph.pinned = prepare_plan(plan, inputs["q"].shape[1], kwargs.get("head_offset", 0), group.device)
        group.graphs[call] = graph
        group.order.append(call)
        self._stats["captures"] += 1
        if retained > 0:
            self._stats["retained_bytes"] += retained
            if not self._warned:
                self._warned = True
                warnings.warn(f"a sparse_prefill capture kept {retained} bytes allocated in its graph pool (a device "
                              "cache filled during capture?); graphs of one shape stay correct in capture order, but "
                              "eager calls reading that cache may see it overwritten", RuntimeWarning, stacklevel=5)
        return graph


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True
