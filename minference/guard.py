"""Quality guard: sampled shadow-dense checks of the sparse prefill, a per-head floor on captured
attention mass with a dense fallback, and metrics an operator can watch (docs/guard.md).

A config is searched offline on a few prompts; real traffic drifts away from them. The guard
checks a sample of the live prefill calls against dense attention:

* **Sampling.** :class:`QualityGuard` draws, once per prefill call (one model forward that runs
  a sparse layer; :meth:`QualityGuard.begin_call` / :meth:`~QualityGuard.end_call`, which
  :func:`minference.integration.patch` hooks onto the model), whether the call is checked, with
  probability ``GuardSettings.sample_rate``. An unchecked call costs one Python random draw per
  forward and one attribute read per layer: no tensor, no device work, no host sync.
* **Shadow dense.** On a checked call each sparse layer hands the guard its index
  (:class:`ShadowCheck`, the ``shadow=`` argument of :func:`minference.dispatch.sparse_prefill`).
  For a few query rows of every batch row (:func:`check_positions`: the last ``tail_rows`` rows the
  pattern computes, which make the first generated token, and ``spread_rows`` spread over the
  earlier ones) :func:`shadow_rows` computes the exact attention of those rows against every key
  (float32 logits and softmax) and, per (row, head), the **captured mass** (the dense
  probability of the keys the head's sparse set holds, :func:`head_sets`) and the squared error of
  the sparse output against the dense one. Per (batch row, head), :func:`head_stats`: the mean
  and minimum mass over that batch row's checked rows and the relative output error
  ``‖o_sparse − o_dense‖ / ‖o_dense‖`` over them. Each batch row (prompt) is judged on its own:
  a prompt whose head misses is not averaged away by clean batch-mates.
* **Policy.** ``mode="observe"`` reports; ``mode="enforce"`` also recomputes densely, in this call,
  every head whose mean mass is below ``GuardSettings.min_mass`` in at least one batch row (the
  dispatcher's dense path on those heads, for the whole batch: at most one dense attention of
  the layer). Both count the event, attributed to the failing batch rows only.
* **Metrics.** Per (layer, global head): checked prompts (batch rows), those below the floor,
  fallbacks, mass and error sums, extremes and histograms over the prompts (:data:`MASS_BINS`,
  :data:`ERROR_BINS`). Each checked call gives one record (a dict; one JSON line in the
  ``jsonl`` file, passed to ``on_record``, and a ``logging`` line on the :data:`LOGGER_NAME`
  logger). :meth:`QualityGuard.summary` and :func:`format_summary` give the totals, the worst
  heads, and whether the config is **flagged for re-search** (enough checked calls with a head
  below the floor), with the ids of the prompts that triggered it (bounded). A call counts as
  checked once a layer recorded a check (a call whose layers all took the dense path is drawn
  but not checked).

Host syncs happen on checked calls only: in ``enforce`` mode one per checked layer (the heads to
recompute are read on the host before the layer returns), in ``observe`` mode one per checked
call (every layer's statistics are read together in :meth:`QualityGuard.end_call`). CUDA-graph
replays are bypassed on checked calls (the integration runs them directly).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO, TypedDict

import torch

from minference._checks import arange_constant, check_query_rows, check_ragged, query_rows_bound
from minference.config import GuardSettings
from minference.index import QueryRows, extra_row_positions
from minference.index_sets import slash_set

__all__ = [
    "QualityGuard",
    "ShadowCheck",
    "HeadStats",
    "check_positions",
    "head_sets",
    "shadow_rows",
    "head_stats",
    "format_summary",
    "LOGGER_NAME",
    "MASS_BINS",
    "ERROR_BINS",
    "SHADOW_CHUNK_ELEMENTS",
    "RECORD_VERSION",
]

#: Name of the guard's ``logging`` logger: INFO for each checked call with a head below the floor
#: (DEBUG otherwise), WARNING when the config is first flagged for re-search.
LOGGER_NAME = "minference.guard"
logger = logging.getLogger(LOGGER_NAME)
#: Upper edges of the captured-mass histogram bins; one more bin holds ``(MASS_BINS[-1], 1]``.
MASS_BINS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999)
#: Upper edges of the relative-output-error histogram bins; one more bin holds the rest.
ERROR_BINS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
#: Largest ``B * Hq * rows * N`` boolean key-set block of the shadow computation: more checked rows
#: are done in chunks of rows (at least one row a chunk), and within a chunk the keys in blocks
#: whose float32 logits and upcast k and v hold at most a quarter of it (:func:`shadow_rows`): no
#: float32 copy of whole k or v. The extra memory of a checked layer is a few times
#: ``max(SHADOW_CHUNK_ELEMENTS, B * Hq * N)`` bytes (head_sets' temporaries) plus the key blocks:
#: measured 337 MB peak RSS (527 MB with ragged rows) at N = 1M, B = 1, Hq = 14, Hkv = 2, D = 64
#: on CPU (docs/guard.md, "Cost").
SHADOW_CHUNK_ELEMENTS = 1 << 26
#: ``"v"`` field of every record (one JSON line per checked call).
RECORD_VERSION = 2


# ---------------------------------------------------------------------------------------------
# The computation (device tensors, no host sync).


def check_positions(lens: torch.Tensor, q_lens: torch.Tensor, *, tail_rows: int, spread_rows: int,
                    dense_tail: int, N: int, bound: int) -> torch.Tensor:
    """Logical positions ``[B, R]`` int64 of the checked query rows of each batch row (-1: none),
    ``R = tail_rows + min(spread_rows, N, bound)``.

    Row ``b`` has ``n = lens[b]`` keys and its queries are its last ``c = q_lens[b]`` positions
    (``c = n`` for a whole prompt); the pattern computes the queries before the dense tail,
    ``[q_lo, hi)`` with ``q_lo = n - c`` and ``hi = n - min(dense_tail, c)`` (the tail's rows are
    dense whatever the config). Checked: the last ``tail_rows`` of them, ``hi - tail_rows .. hi -
    1`` (those ``>= q_lo``), and ``spread_rows`` points spread evenly over the rows before,
    ``[q_lo, hi - tail_rows)``, by the rule of :func:`minference.index.extra_row_positions`
    (``floor((k + 1) m / (E + 1))``, repeats dropped). ``bound``: host-known bound of every ``c``.
    """
    n, c = lens.long(), q_lens.long()
    q_lo = n - c
    hi = n - c.clamp(max=dense_tail)
    tail = hi[:, None] - tail_rows + arange_constant(tail_rows, lens.device)[None, :]  # [B, tail_rows]
    tail = torch.where(tail >= q_lo[:, None], tail, -1)
    spread_hi = torch.maximum(hi - tail_rows, q_lo)
    # the earlier rows [q_lo, spread_hi) as the query rows of a row of length spread_hi, no last rows
    spread = extra_row_positions(spread_hi, N, 0, spread_rows, QueryRows(spread_hi - q_lo, q_lens, bound, N))
    return torch.cat([spread, tail], dim=1)


@dataclass
class _GroupSets:
    """One dispatcher group's heads and what defines their key sets."""

    kind: str
    heads: torch.Tensor  # [Hg] local query heads
    sink: torch.Tensor | None = None  # a_shape: [Hg]
    window: torch.Tensor | None = None
    vertical: torch.Tensor | None = None  # vertical_slash: [B, Hg, NV] columns, -1 padded
    slash: torch.Tensor | None = None  # [B, Hg, NS] offsets, -1 padded
    dense: torch.Tensor | None = None  # [B, Hg] bool: the converter replaced the head by dense (dense_over)
    blocks: torch.Tensor | None = None  # block_sparse: [B, Hg, NQB, K] key blocks, -1 padded
    block: int = 0


def _required(x: torch.Tensor | None, kind: str, name: str) -> torch.Tensor:
    """``x``, a tensor the ``kind`` group's key sets are defined by (``None`` only in other kinds)."""
    if x is None:
        raise ValueError(f"a {kind} group needs its {name} tensor")
    return x


def _scatter(n: int, idx: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bool set of the entries of ``idx [..., K]`` in ``[0, n)``."""
    idx = idx.long()
    target = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.bool, device=idx.device)
    target.scatter_(-1, torch.where((idx >= 0) & (idx < n), idx, n), True)
    return target[..., :n]


def head_sets(groups: Sequence[_GroupSets], pos: torch.Tensor, Hq: int, N: int, fill_gaps: int) -> torch.Tensor:
    """``[B, Hq, R, N]`` bool: key ``j`` (logical) is in the set head ``h`` computes for the row at
    logical position ``pos[b, r]`` (causal: ``j <= pos``; nothing for ``pos = -1``). The sets are
    the patterns' definitions (:mod:`minference.reference.masks`) on the index the call built:
    A-shape ``j < sink or j > i - window``; vertical-slash ``j ∈ C or i - j ∈ D`` with ``D``
    closed over gaps of ``fill_gaps`` (:func:`~minference.index_sets.slash_set`), every key
    for a head the converter made dense; block-sparse the listed key blocks of ``i``'s query
    block; dense every key."""
    B, R = pos.shape
    dev = pos.device
    j = arange_constant(N, dev)
    causal = j[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, R, N]
    member = torch.zeros(B, Hq, R, N, dtype=torch.bool, device=dev)
    for g in groups:
        Hg = g.heads.shape[0]
        if g.kind == "dense":
            m = torch.ones(B, Hg, R, N, dtype=torch.bool, device=dev)
        elif g.kind == "a_shape":
            i = pos[:, None, :, None]
            sink, window = _required(g.sink, g.kind, "sink"), _required(g.window, g.kind, "window")
            m = (j[None, None, None, :] < sink.long()[None, :, None, None]) | (
                j[None, None, None, :] > i - window.long()[None, :, None, None])
        elif g.kind == "vertical_slash":
            cols = _scatter(N, _required(g.vertical, g.kind, "vertical"))  # [B, Hg, N]
            diags = slash_set(N, _required(g.slash, g.kind, "slash"), fill_gaps)  # [B, Hg, N] offsets
            # row i reads offset i - j at key j: window i of the flipped offsets, padded with N misses
            flipped = torch.nn.functional.pad(diags.flip(-1), (0, N))  # [B, Hg, 2N]: entry N-1-i+j
            windows = flipped.unfold(-1, N, 1)  # [B, Hg, N + 1, N] view: window s is entries s .. s+N-1
            start = (N - 1 - pos).clamp(0, N)  # [B, R]; pos = -1 -> the all-miss window N
            bi = arange_constant(B, dev)[:, None]
            m = windows[bi, :, start].permute(0, 2, 1, 3) | cols[:, :, None, :]  # [B, Hg, R, N]
            if g.dense is not None:
                m |= g.dense[:, :, None, None]
        elif g.kind == "block_sparse":
            blocks = _required(g.blocks, g.kind, "blocks")
            K = blocks.shape[-1]
            nkb = -(-N // g.block)
            qb = (pos.clamp(min=0) // g.block)[:, None, :, None].expand(B, Hg, R, K)
            rows = blocks.gather(2, qb)  # [B, Hg, R, K] key blocks of each row's query block
            m = _scatter(nkb, rows).repeat_interleave(g.block, dim=-1)[..., :N]
        else:
            raise ValueError(f"unknown group kind {g.kind!r}")
        member.index_copy_(1, g.heads.long(), m.expand(B, Hg, R, N))
    return member & causal


def shadow_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, pos: torch.Tensor,
                groups: Sequence[_GroupSets], *, scale: float, lens: torch.Tensor, starts: torch.Tensor,
                q_lens: torch.Tensor, q_starts: torch.Tensor, ragged: bool, fill_gaps: int,
                chunk_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact attention of the rows ``pos [B, R]`` (logical, -1 none) and their comparison with the
    sparse output ``out [B, Hq, Nq, D]``, for every head.

    Returns float32 ``(mass, err2, ref2)``, each ``[B, Hq, R]``: the dense probability mass of the
    head's key set (:func:`head_sets`), ``‖out_row − dense_row‖²`` and ``‖dense_row‖²``; zeros at
    rows ``pos = -1``. Logits, softmax and products in float32. Rows in chunks whose key sets
    (``B * Hq * rows * N`` booleans) hold at most ``chunk_elements`` (default
    :data:`SHADOW_CHUNK_ELEMENTS`) elements; within a chunk, per kv head, the keys in blocks (an
    online softmax: running maximum, rescaled sums) whose float32 logits and upcast k and v hold at
    most ``chunk_elements / 4`` elements: no whole-``N`` float32 copy of k or v. Device ops
    only. With ``ragged`` rows each block's keys are gathered at logical positions
    (``starts[b] + j``); values past a row's length (NaN allowed) read as 0.
    """
    chunk_elements = SHADOW_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    B, Hq, Nq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    R = pos.shape[1]
    dev = q.device
    j = arange_constant(N, dev)
    q_lo = lens.long() - q_lens.long()
    qrow = (q_starts.long()[:, None] + pos - q_lo[:, None]).clamp(0, max(Nq - 1, 0))  # [B, R] rows of q and out
    index = qrow[:, None, :, None].expand(B, Hq, R, D)
    q_rows = q.gather(2, index).float()  # [B, Hq, R, D]
    o_sparse = out.gather(2, index).float()
    mass = torch.zeros(B, Hq, R, dtype=torch.float32, device=dev)
    err2, ref2 = torch.zeros_like(mass), torch.zeros_like(mass)
    tiny = torch.finfo(torch.float32).tiny
    step = max(1, chunk_elements // max(1, B * Hq * N))
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        Rc = r1 - r0
        p_rows = pos[:, r0:r1]
        member = head_sets(groups, p_rows, Hq, N, fill_gaps)  # [B, Hq, Rc, N]
        kstep = max(1, chunk_elements // (4 * max(1, B * (G * Rc + 2 * D))))  # float32 block elements
        for g in range(Hkv):
            h0, h1 = g * G, (g + 1) * G
            qg = q_rows[:, h0:h1, r0:r1].reshape(B, G * Rc, D)
            top = torch.full((B, G * Rc), float("-inf"), device=dev)  # running maximum of the logits
            z, kept = torch.zeros(B, G * Rc, device=dev), torch.zeros(B, G * Rc, device=dev)
            acc = torch.zeros(B, G * Rc, D, device=dev)  # running sum of p · v
            for c0 in range(0, N, kstep):
                jb = j[c0:c0 + kstep]
                if ragged:  # the block's keys at logical positions (clamped; j >= lens[b] is never read)
                    at = (starts.long()[:, None] + jb[None, :]).clamp(max=N - 1)[:, :, None].expand(B, len(jb), D)
                    kb, vb = k[:, g].gather(1, at), v[:, g].gather(1, at)
                else:
                    kb, vb = k[:, g, c0:c0 + kstep], v[:, g, c0:c0 + kstep]
                vb = torch.where((jb[None, :] < lens.long()[:, None])[:, :, None], vb.float(), 0.0)  # [B, Kb, D]
                s = torch.bmm(qg, kb.float().transpose(1, 2)).mul_(scale)  # [B, G * Rc, Kb]
                causal = (jb[None, None, :] <= p_rows[:, :, None])[:, None].expand(B, G, Rc, len(jb))
                s.masked_fill_(~causal.reshape(B, G * Rc, len(jb)), float("-inf"))
                new = torch.maximum(top, s.amax(-1))
                base = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
                alpha = (top - base).exp()  # 0 while nothing was seen
                p = s.sub_(base[..., None]).exp_()  # unnormalised probabilities, 0 off the causal keys
                in_set = member[:, h0:h1, :, c0:c0 + kstep].reshape(B, G * Rc, len(jb))
                z = z * alpha + p.sum(-1)
                kept = kept * alpha + (p * in_set).sum(-1)
                acc = acc * alpha[..., None] + torch.bmm(p, vb)
                top = new
            dense = (acc / z.clamp(min=tiny)[..., None]).view(B, G, Rc, D)
            z, kept = z.view(B, G, Rc), kept.view(B, G, Rc)
            valid = z > 0
            mass[:, h0:h1, r0:r1] = torch.where(valid, kept / z.clamp(min=tiny), 0.0)
            diff = (o_sparse[:, h0:h1, r0:r1] - dense).square().sum(-1)
            err2[:, h0:h1, r0:r1] = torch.where(valid, diff, 0.0)
            ref2[:, h0:h1, r0:r1] = torch.where(valid, dense.square().sum(-1), 0.0)
    return mass, err2, ref2


def head_stats(mass: torch.Tensor, err2: torch.Tensor, ref2: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Per (batch row, head) over that batch row's checked rows (``pos >= 0``): ``[4, B, Hq]``
    float32 of the mean mass, the smallest mass, the relative output error ``sqrt(Σ err2 / Σ
    ref2)`` (0 where both sums are 0) and the number of rows. NaN mass (and error) for a batch row
    with no checked row. Each batch row (prompt) is judged on its own: a prompt whose head misses
    is not averaged with clean batch-mates. Device ops."""
    valid = (pos >= 0)[:, None, :].float()  # [B, 1, R]
    rows = valid.sum(2).expand(mass.shape[0], mass.shape[1])  # [B, Hq]
    mean = (mass * valid).sum(2) / rows
    low = torch.where(valid > 0, mass, float("inf")).amin(2) if mass.shape[2] else torch.full_like(rows, math.inf)
    e, r = (err2 * valid).sum(2), (ref2 * valid).sum(2)
    error = torch.where(r > 0, (e / r.clamp(min=torch.finfo(torch.float32).tiny)).sqrt(),
                        torch.where(e > 0, float("inf"), 0.0))
    none = rows == 0
    nan = torch.full_like(mean, float("nan"))
    return torch.stack([torch.where(none, nan, mean), torch.where(none, nan, low), torch.where(none, nan, error),
                        rows])


# ---------------------------------------------------------------------------------------------
# One checked layer call (what the dispatcher talks to).


class ShadowCheck:
    """The check of one layer in one checked call: :func:`minference.dispatch.sparse_prefill`
    (``shadow=``) hands it each group's index (:meth:`add_index`) and, once the output is
    written (dense tail included), calls :meth:`finish`, which returns the local heads to
    recompute densely (``enforce`` mode) or ``None``."""

    def __init__(self, guard: QualityGuard, layer: int, head_offset: int = 0):
        self.guard, self.layer, self.head_offset = guard, layer, head_offset
        self._indices: dict[int, dict] = {}

    def add_index(self, group: Any, **index: torch.Tensor | None) -> None:
        """The index the dispatcher built for ``group`` (a :class:`minference.index.DeviceGroup`):
        ``vertical=, slash=, dense=`` (vertical-slash; ``dense`` the converter's ``[B, Hg]``
        dense-fallback flags, ``None`` without) or ``blocks=`` (block-sparse)."""
        self._indices[id(group)] = index

    def _groups(self, groups: Sequence[Any], head_offset: int) -> list[_GroupSets]:
        out = []
        for dg in groups:
            kind, heads = dg.group.kind, dg.heads
            if kind == "a_shape":
                at = heads.long() + head_offset
                out.append(_GroupSets(kind, heads, sink=dg.budgets["sink"][at], window=dg.budgets["window"][at]))
            elif kind in ("vertical_slash", "block_sparse"):
                index = self._indices.get(id(dg))
                if index is None:
                    raise RuntimeError(f"layer {self.layer}: no index was handed to the guard for the {kind} heads "
                                       f"{list(dg.group.heads)}")
                block = dg.group.key[0] if kind == "block_sparse" else 0
                out.append(_GroupSets(kind, heads, block=block, **index))
            else:
                out.append(_GroupSets("dense", heads))
        return out

    def finish(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, groups: Sequence[Any], *,
               scale: float, seqlens: torch.Tensor | None = None, seqstarts: torch.Tensor | None = None,
               q_seqlens: int | torch.Tensor | None = None, q_seqstarts: torch.Tensor | None = None,
               head_offset: int = 0, dense_tail: int = 0, fill_gaps: int = 0) -> torch.Tensor | None:
        """Check the layer's output ``out [B, Hq, Nq, D]`` (the dispatcher's arguments); return
        ``[F]`` int32 local heads to recompute densely, or ``None``. Each batch row is judged on
        its own; the dispatcher recomputes a head for every batch row, so a head goes dense when
        its mass is below the floor in at least one batch row."""
        s = self.guard.settings
        B, Hq, Nq, _ = q.shape
        N = k.shape[2]
        given = seqlens is not None or seqstarts is not None
        lens, starts = check_ragged(seqlens, seqstarts, B, N, q.device, values=False)
        chosen = check_query_rows(q_seqlens, q_seqstarts, lens, starts, Nq, N, given_rows=given, values=False)
        q_lens, q_starts = chosen if chosen is not None else (lens, starts)
        pos = check_positions(lens, q_lens, tail_rows=s.tail_rows, spread_rows=s.spread_rows, dense_tail=dense_tail,
                              N=N, bound=query_rows_bound(q_seqlens, Nq))
        mass, err2, ref2 = shadow_rows(q, k, v, out, pos, self._groups(groups, head_offset), scale=scale, lens=lens,
                                       starts=starts, q_lens=q_lens, q_starts=q_starts, ragged=seqstarts is not None,
                                       fill_gaps=fill_gaps)
        stats = head_stats(mass, err2, ref2, pos)  # [4, B, Hq] on the device
        if s.mode != "enforce":
            self.guard._layer_done(self, stats, None)
            return None
        host = stats.cpu()  # the one sync of an enforced layer: which heads to recompute
        # the dispatcher recomputes a head for the whole batch: a head below the floor in any batch
        # row goes dense (its batch-mates get dense output too); NaN (no row) is never below
        low = [h for h in range(Hq) if bool((host[0, :, h] < s.min_mass).any())]
        self.guard._layer_done(self, host, low)
        return torch.tensor(low, dtype=torch.int32, device=q.device) if low else None


# ---------------------------------------------------------------------------------------------
# Metrics.


def _bin(value: float, edges: Sequence[float]) -> int:
    for b, edge in enumerate(edges):
        if value <= edge:
            return b
    return len(edges)


@dataclass
class HeadStats:
    """Running metrics of one (layer, global head) over its checked prompts: one prompt is one
    batch row of a checked call, judged on its own. ``checked``, ``below_floor``, the sums, the
    extremes and the histograms count prompts (their mean mass over the row's checked rows, their
    relative error); ``fallbacks`` counts the checked calls that recomputed the head densely (for
    the whole batch)."""

    checked: int = 0
    below_floor: int = 0
    fallbacks: int = 0
    mass_sum: float = 0.0
    mass_min: float = math.inf
    error_sum: float = 0.0
    error_max: float = 0.0
    mass_hist: list[int] = field(default_factory=lambda: [0] * (len(MASS_BINS) + 1))
    error_hist: list[int] = field(default_factory=lambda: [0] * (len(ERROR_BINS) + 1))

    def add(self, mass: float, mass_min: float, error: float, below: bool, fallback: bool = False) -> None:
        """One prompt's check (``fallback``: count a call's dense recomputation here, once a call)."""
        self.checked += 1
        self.below_floor += below
        self.fallbacks += fallback
        self.mass_sum += mass
        self.mass_min = min(self.mass_min, mass_min)
        self.error_sum += error
        self.error_max = max(self.error_max, error)
        self.mass_hist[_bin(mass, MASS_BINS)] += 1
        self.error_hist[_bin(error, ERROR_BINS)] += 1

    def to_dict(self) -> dict:
        n = max(self.checked, 1)
        return {"checked": self.checked, "below_floor": self.below_floor, "fallbacks": self.fallbacks,
                "mass_mean": _num(self.mass_sum / n if self.checked else math.nan), "mass_min": _num(self.mass_min),
                "error_mean": _num(self.error_sum / n if self.checked else math.nan), "error_max": _num(self.error_max),
                "mass_hist": list(self.mass_hist), "error_hist": list(self.error_hist)}


class _LayerRecord(TypedDict):
    """One checked layer in a call's record (``"layers"``; :func:`_num` values). Per batch row
    ``b`` (a prompt): ``rows[b]`` checked rows, ``row_mass[b][h]`` the mean mass over them,
    ``row_error[b][h]`` the relative error, ``row_below[b]`` the global heads below the floor.
    Per head, over the batch rows: ``mass`` the lowest row mean (what the floor judges),
    ``mass_min`` the lowest single row, ``error`` the largest row error; ``below`` the heads below
    the floor in some batch row, ``fallback`` those recomputed densely (for the whole batch)."""

    layer: int
    heads: list[int]
    rows: list[int]
    mass: list[float | None]
    mass_min: list[float | None]
    error: list[float | None]
    row_mass: list[list[float | None]]
    row_error: list[list[float | None]]
    row_below: list[list[int]]
    below: list[int]
    fallback: list[int]


def _least(xs: Any) -> float:
    """The smallest of ``xs`` ignoring NaN (NaN when there is none)."""
    return min((x for x in xs if not math.isnan(x)), default=math.nan)


def _num(x: float) -> float | None:
    """A JSON-safe float (6 significant digits; ``None`` for NaN and infinities)."""
    return float(f"{x:.6g}") if math.isfinite(x) else None


# ---------------------------------------------------------------------------------------------
# The guard.


class QualityGuard:
    """Sampled quality checks of a model's sparse prefill (module docstring; docs/guard.md).

    Args:
        settings: :class:`minference.config.GuardSettings` (the config's ``runtime.guard``);
            default ``GuardSettings(mode="observe")``.
        jsonl: where to append one JSON line per checked call: a path (opened on the first
            record, closed by :meth:`close`) or a text file object; ``None``: no file.
        on_record: called with each checked call's record (a dict, as in the JSON line).
        name: a label for log lines and the summary (e.g. the config's name).

    Set :attr:`prompt_id` (any JSON value: a string, a number, a list of one id per batch row)
    before a prefill; it is stored with that call's record and, when a head fell below the floor,
    among the saved prompt ids (at most ``settings.max_saved_prompts``, first seen kept): with
    one id per batch row, only the ids of the batch rows that fell below.

    Counters: ``calls`` prefill calls (drawn), ``sampled`` checked calls (drawn for a check and at
    least one layer checked: the flag rate's denominator), ``calls_below_floor`` checked calls
    with a head below the floor in some batch row, ``below_floor`` (batch row, layer, head)
    events below the floor, ``fallbacks`` (layer, head) dense recomputations (each for the whole
    batch).
    """

    def __init__(self, settings: GuardSettings | None = None, *, jsonl: str | os.PathLike | TextIO | None = None,
                 on_record: Callable[[dict], None] | None = None, name: str | None = None):
        settings = GuardSettings(mode="observe") if settings is None else settings
        if not isinstance(settings, GuardSettings):
            raise TypeError(f"settings must be a GuardSettings, got {type(settings).__name__}")
        if on_record is not None and not callable(on_record):
            raise TypeError(f"on_record must be callable, got {type(on_record).__name__}")
        if jsonl is not None and not isinstance(jsonl, (str, os.PathLike)) and not hasattr(jsonl, "write"):
            raise TypeError(f"jsonl must be a path or a text file, got {type(jsonl).__name__}")
        self.settings, self.on_record, self.name = settings, on_record, name
        self._jsonl_target = jsonl
        self._jsonl_file: TextIO | None = None
        self.prompt_id: Any = None
        self._rng = random.Random(settings.seed)
        self.heads: dict[tuple[int, int], HeadStats] = {}
        self.saved_prompts: list[Any] = []
        self.calls = self.sampled = self.calls_below_floor = self.below_floor = self.fallbacks = 0
        self.flagged = False
        self._open = self._implicit = self._drawn = self._sampled = False
        self._last_layer = -1
        self._layers: list[tuple[ShadowCheck, torch.Tensor, list[int] | None]] = []
        self._prompt: Any = None

    @property
    def mode(self) -> str:
        return self.settings.mode

    # -- calls ----------------------------------------------------------------------------------

    def begin_call(self) -> None:
        """A model forward starts (the integration's forward pre-hook). Whether it is checked is
        drawn at its first sparse layer, so forwards without one (decode steps) draw nothing."""
        if self._open:
            self.end_call()
        self._open, self._implicit, self._drawn, self._sampled = True, False, False, False
        self._last_layer, self._layers = -1, []

    def end_call(self) -> None:
        """The forward ended: a checked call's statistics are read (``observe``: its one sync),
        counted and recorded. A call drawn for a check whose layers recorded nothing (each took
        the dispatcher's dense path) is not counted as checked."""
        if not self._open:
            return
        self._open = False
        if self._sampled and self._layers:
            self._record()
        self._layers = []

    @contextmanager
    def call(self, prompt_id: Any = None):
        """``with guard.call(prompt_id):`` around one prefill made of direct
        :func:`~minference.dispatch.sparse_prefill` calls (a patched model calls
        :meth:`begin_call` / :meth:`end_call` itself)."""
        self.prompt_id = prompt_id
        self.begin_call()
        try:
            yield self
        finally:
            self.end_call()

    def flush(self) -> None:
        """End a call that was opened implicitly (layers called with no :meth:`begin_call`)."""
        if self._open and self._implicit:
            self.end_call()

    def layer_check(self, layer: int, head_offset: int = 0) -> ShadowCheck | None:
        """The :class:`ShadowCheck` of ``layer`` in the current call, or ``None`` (mode off, or the
        call is not checked: then nothing else happens). A layer called outside
        :meth:`begin_call` opens a call itself; a layer index that does not increase then starts
        the next one."""
        if self.settings.mode == "off":
            return None
        if not self._open or (self._implicit and layer <= self._last_layer):
            self.begin_call()
            self._implicit = True
        self._last_layer = layer
        if not self._drawn:
            self._drawn = True
            self.calls += 1
            self._sampled = self._rng.random() < self.settings.sample_rate  # counted in `sampled` once checked
            self._prompt = self.prompt_id
        return ShadowCheck(self, layer, head_offset) if self._sampled else None

    def _layer_done(self, check: ShadowCheck, stats: torch.Tensor, fallback: list[int] | None) -> None:
        self._layers.append((check, stats, fallback))

    # -- records and metrics --------------------------------------------------------------------

    def _record(self) -> None:
        s = self.settings
        flat = torch.cat([stats.reshape(-1) for _, stats, _ in self._layers]).cpu()  # observe: the call's one sync
        host = [part.view(stats.shape).tolist() for part, (_, stats, _) in  # per layer [4][B][Hq]
                zip(flat.split([stats.numel() for _, stats, _ in self._layers]), self._layers)]
        layers: list[_LayerRecord] = []
        below_total, fallback_total = 0, 0
        failing: set[int] = set()  # batch rows with a head below the floor in some layer
        batch = 0
        for (check, _, fallback), (mass, low, error, rows) in zip(self._layers, host):
            batch = len(mass)
            H = len(mass[0]) if batch else 0
            heads = [check.head_offset + h for h in range(H)]
            row_below = [[heads[h] for h in range(H) if mass[b][h] < s.min_mass] for b in range(batch)]
            done = [] if fallback is None else [check.head_offset + h for h in fallback]
            for h, g in enumerate(heads):
                seen = [b for b in range(batch) if not math.isnan(mass[b][h])]  # batch rows with checked rows
                if seen:
                    st = self.heads.setdefault((check.layer, g), HeadStats())
                    for b in seen:
                        st.add(mass[b][h], low[b][h], error[b][h], g in row_below[b])
                    st.fallbacks += g in done  # only a head with a row below goes dense
            failing.update(b for b in range(batch) if row_below[b])
            below_total += sum(len(x) for x in row_below)
            fallback_total += len(done)
            layers.append({"layer": check.layer, "heads": heads,
                           "rows": [int(rows[b][0]) if H else 0 for b in range(batch)],
                           "mass": [_num(_least(mass[b][h] for b in range(batch))) for h in range(H)],
                           "mass_min": [_num(_least(low[b][h] for b in range(batch))) for h in range(H)],
                           "error": [_num(-_least(-error[b][h] for b in range(batch))) for h in range(H)],
                           "row_mass": [[_num(x) for x in row] for row in mass],
                           "row_error": [[_num(x) for x in row] for row in error],
                           "row_below": row_below, "below": sorted(set().union(*row_below)), "fallback": done})
        self.sampled += 1  # a checked call: at least one layer recorded (a dense early return records none)
        self.below_floor += below_total
        self.fallbacks += fallback_total
        below_rows = sorted(failing)
        if below_total:
            self.calls_below_floor += 1
            self._save_prompt(self._prompt, below_rows, batch)
        record = {"v": RECORD_VERSION, "guard": self.name, "call": self.calls, "time": round(time.time(), 3),
                  "prompt": self._prompt, "mode": s.mode, "min_mass": s.min_mass, "below_floor": below_total,
                  "below_rows": below_rows, "fallbacks": fallback_total, "layers": layers}
        self._write(record)
        if self.on_record is not None:
            self.on_record(record)
        level = logging.INFO if below_total else logging.DEBUG
        if logger.isEnabledFor(level):
            worst = min((x for lay in layers for x in lay["mass"] if x is not None), default=None)
            logger.log(level, "guard%s: call %d (prompt %r) checked %d layers: %d head events below mass %.3g in batch "
                       "rows %s (%d heads recomputed dense); lowest mean mass %s", f" {self.name}" if self.name else "",
                       self.calls, self._prompt, len(layers), below_total, s.min_mass, below_rows, fallback_total,
                       worst)
        self._update_flag()

    def _save_prompt(self, prompt: Any, rows: Sequence[int], batch: int) -> None:
        """Keep the ids of the failing batch ``rows``: a list or tuple of ``batch`` ids names one per
        batch row; any other id (one for the whole call, a list of another length) is kept whole."""
        if isinstance(prompt, (list, tuple)):
            ids = [prompt[b] for b in rows] if len(prompt) == batch else list(prompt)
        else:
            ids = [prompt]
        for x in ids:
            if len(self.saved_prompts) >= self.settings.max_saved_prompts:
                return
            if x is not None and x not in self.saved_prompts:
                self.saved_prompts.append(x)

    def _update_flag(self) -> None:
        s = self.settings
        if self.flagged or self.sampled < s.flag_min_calls:
            return
        if self.calls_below_floor >= s.flag_rate * self.sampled and self.calls_below_floor > 0:
            self.flagged = True
            logger.warning("guard%s: config flagged for re-search: %d of %d checked calls had heads below captured "
                           "mass %.3g (flag rate %.3g); prompts %s", f" {self.name}" if self.name else "",
                           self.calls_below_floor, self.sampled, s.min_mass, s.flag_rate, self.saved_prompts)

    def _write(self, record: dict) -> None:
        if self._jsonl_target is None:
            return
        if self._jsonl_file is None:
            target = self._jsonl_target
            self._jsonl_file = open(target, "a", encoding="utf-8") if isinstance(target, (str, os.PathLike)) \
                else target
        self._jsonl_file.write(json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n")
        self._jsonl_file.flush()

    def close(self) -> None:
        """Close the JSON-lines file the guard opened (a file object passed in is left open)."""
        if self._jsonl_file is not None and isinstance(self._jsonl_target, (str, os.PathLike)):
            self._jsonl_file.close()
        self._jsonl_file = None

    def metrics(self) -> dict:
        """Every (layer, head)'s metrics: ``{"layer:head": HeadStats.to_dict()}`` plus the bins."""
        self.flush()
        return {"mass_bins": list(MASS_BINS), "error_bins": list(ERROR_BINS),
                "heads": {f"{l}:{h}": st.to_dict() for (l, h), st in sorted(self.heads.items())}}

    def summary(self, worst: int = 8) -> dict:
        """Totals, whether the config is flagged for re-search, the saved prompt ids, and the
        ``worst`` heads (most often below the floor, then lowest mean mass)."""
        self.flush()
        s = self.settings
        ranked = sorted(self.heads.items(), key=lambda kv: (-kv[1].below_floor, kv[1].mass_sum / kv[1].checked))
        return {"name": self.name, "mode": s.mode, "sample_rate": s.sample_rate, "min_mass": s.min_mass,
                "calls": self.calls, "checked_calls": self.sampled, "calls_below_floor": self.calls_below_floor,
                "below_floor": self.below_floor, "fallbacks": self.fallbacks, "flagged": self.flagged,
                "flag_rate": s.flag_rate, "flag_min_calls": s.flag_min_calls, "prompts": list(self.saved_prompts),
                "worst_heads": [{"layer": l, "head": h, **st.to_dict()} for (l, h), st in ranked[:worst]]}

    def reset(self) -> None:
        """Forget every count, metric and saved prompt (the sampling draws go on)."""
        self.heads.clear()
        self.saved_prompts.clear()
        self.calls = self.sampled = self.calls_below_floor = self.below_floor = self.fallbacks = 0
        self.flagged = False


def format_summary(summary: dict) -> str:
    """A few lines for a terminal from :meth:`QualityGuard.summary`."""
    name = f" [{summary['name']}]" if summary.get("name") else ""
    lines = [f"quality guard{name}: mode {summary['mode']}, floor {summary['min_mass']:g} on captured mass, "
             f"sample rate {summary['sample_rate']:g}: {summary['checked_calls']} of {summary['calls']} prefill "
             f"calls checked, {summary['calls_below_floor']} with heads below the floor ({summary['below_floor']} "
             f"head events, {summary['fallbacks']} recomputed dense)"]
    worst = [h for h in summary["worst_heads"] if h["checked"]][:5]
    if worst:
        lines.append("  lowest heads: " + ", ".join(
            f"L{h['layer']}H{h['head']} mass {h['mass_mean']:.3f} (min {h['mass_min']:.3f}, below {h['below_floor']}"
            f"/{h['checked']}, error {h['error_mean']:.3f})" for h in worst))
    if summary["flagged"]:
        lines.append(f"  FLAGGED for re-search: {summary['calls_below_floor']} of {summary['checked_calls']} checked "
                     f"calls had heads below the floor (flag rate {summary['flag_rate']:g}); prompts: "
                     f"{summary['prompts']}")
    elif summary["prompts"]:
        lines.append(f"  prompts with heads below the floor: {summary['prompts']}")
    return "\n".join(lines)
