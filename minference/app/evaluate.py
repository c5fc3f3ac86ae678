"""``minference eval``: task accuracy and time to first token of a real model, sparse configs
against dense in the same run (DESIGN.md, "Real-model protocol").

For one model (:func:`minference.app.models.load_model`), several configs, lengths, tasks
(:mod:`minference.app.evals`) and samples, :func:`run_eval` measures

* **accuracy** per (config, task, length): the greedy answer (``max_new_tokens`` of the sample,
  stopping at EOS) scored by exact match with :func:`minference.app.evals.score`. The generation
  tasks' prompts of one sample all have the same length, so they are decoded as one batch (one
  prefill, one decode loop; no padding, so each row decodes as it would alone); for the
  perplexity task the mean next-token NLL per position bucket and overall, from ONE prefill of the
  decoder (the LM head runs in chunks of :data:`NLL_CHUNK` rows, never ``[n, vocab]`` at once);
* **TTFT**: prefill of the whole model for ONE prompt (``model(ids[None], use_cache=True,
  logits_to_keep=1)`` and the greedy first token; the first generation task's prompt of each
  sample), synchronised on CUDA, after the untimed warm-up prefills per (config, length)
  (:func:`warmup_lengths`; on CUDA one more after the profiled and coverage prefills); median
  and every value per (config, length);
* **the eq. 13 split** of a prefill into attention, index building (+ conversion) and everything
  else. It is the DEVICE time (sum of CUDA kernel durations) of one extra prefill per (config,
  length) run under ``torch.profiler``, not a split of the unprofiled TTFT: kernels launched under
  the ranges :data:`~minference.dispatch.ATTENTION_RANGE` (a patched layer's whole attention
  call) and :data:`~minference.dispatch.INDEX_RANGE` (index building and conversion inside it),
  plus, outside those ranges, ``aten::*scaled_dot_product*`` ops (the dense baseline's attention).
  ``attention`` is the attention time minus the index time, ``other`` the profiled prefill's
  total kernel time minus both. The CPU has no device timer: the split is ``None`` there;
* **density and coverage** on one sample per (config, length), in a separate untimed prefill
  whose observer (:attr:`minference.integration.LayerState.observer`) hands each sparse layer's
  real queries and keys to :func:`minference.app.search.plan_coverage` on about
  :data:`COVERAGE_ROWS` sampled query rows: logical density (fraction of the scored rows' causal
  pairs the index holds) and coverage (dense attention mass it captures), per layer. Physical
  density (area of the tiles the Triton kernels run, over the causal pairs) comes from the
  vertical-slash converter's tile count and the block-sparse blocks; it is ``None`` ("n/a") on
  the torch backend (masked dense arithmetic, no tiles) and for A-shape heads (no materialised
  index). Layers that run dense count 1 for all three.

Configs: ``"dense"`` (the unpatched model, transformers SDPA: the baseline), a PatternConfig file
(read and validated before the model loads; refused for another model unless ``allow_mismatch``,
by the model's known shape before it loads and its weights fingerprint once loaded), or one
pattern for every head as JSON (``'{"kind": "vertical_slash", "vertical": 1000, "slash": 6096}'``);
``name=SPEC`` names one.
The loop runs length -> sample -> config, so every config sees the same prompts.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import operator
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, TextIO, cast

import torch

from minference.app import guard_options  # the quality guard's options and summary (docs/guard.md)
from minference.app.models import (
    concat_caches,
    decode_step,
    forward_chunks,
    output_cache,
    synchronize,
    timed_prefill,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from minference.app.evals import Sample
    from minference.app.ruler import PromptSet, RulerSample
    from minference.guard import QualityGuard

__all__ = [
    "DENSE",
    "COVERAGE_ROWS",
    "NLL_CHUNK",
    "EvalError",
    "EvalConfig",
    "TimeSplit",
    "SampleRecord",
    "RunStats",
    "EvalReport",
    "uniform_config",
    "resolve_config",
    "sequence_nll",
    "split_events",
    "run_eval",
    "merge_reports",
    "format_report",
    "plot_eval",
    "add_cli",
]

#: Config spec of the baseline: the unpatched model (transformers SDPA).
DENSE = "dense"
#: Kernels per part that :class:`TimeSplit` names, and how much of each name it keeps.
TOP_KERNELS = 8
KERNEL_NAME_CHARS = 96
#: Query rows scored per layer by the coverage measurement (``row_stride = n // COVERAGE_ROWS``).
COVERAGE_ROWS = 512
#: Rows of hidden states per LM-head chunk in the perplexity task (``[NLL_CHUNK, vocab]`` fp32).
NLL_CHUNK = 2048
#: Position buckets of the perplexity task.
NLL_BUCKETS = 8
#: Default prompt lengths of :func:`run_eval` (SmolLM2's dense retrieval holds up to ~4K).
DEFAULT_LENGTHS = (4096,)
#: Default samples per (task, length).
DEFAULT_SAMPLES = 1
#: Default uniform config when evaluating Qwen without a config (DESIGN.md's vertical-slash budget).
DEFAULT_QWEN_PATTERN = '{"kind": "vertical_slash", "vertical": 1000, "slash": 6096}'
#: Names of ``aten`` ops whose kernels are the dense baseline's attention (SDPA and its backends).
SDPA_OPS = re.compile(r"^aten::_?scaled_dot_product")
#: CUDA runtime / driver calls that put work on the device (``cudaLaunchKernel``, ``cuLaunchKernelEx``,
#: ``cudaMemcpyAsync``...): a kernel belongs to the range open when its call ran.
_LAUNCH_CALLS = re.compile(r"^cu(da)?[A-Z]")
REPORT_FORMAT = "minference.eval_report"
#: Task sources of ``minference eval``: the procedural suite of :mod:`minference.app.evals`, and RULER
#: (:mod:`minference.app.ruler`, prompts generated elsewhere and read from a folder).
SUITES = ("procedural", "ruler")
REPORT_VERSION = 1
#: ``name=SPEC``: a config name is letters, digits and ``._+-``.
_NAMED = re.compile(r"^([A-Za-z0-9_.+\-]+)=(.+)$", re.S)


class EvalError(ValueError):
    """An evaluation that cannot run as asked (unknown task, config or model, bad lengths...)."""


# ---------------------------------------------------------------------------------------------
# Configs.


@dataclass
class EvalConfig:
    """One evaluated config.

    Attributes:
        name: readable name (the table's row label).
        spec: what was asked for (``"dense"``, a path, or a pattern's JSON).
        kind: ``"dense"``, ``"file"`` or ``"uniform"``.
        config: the full PatternConfig as plain JSON (``None`` for dense).
        pattern: the pattern of a uniform config (plain JSON), else ``None``.
    """

    name: str
    spec: str
    kind: str
    config: dict | None = None
    pattern: dict | None = None

    @property
    def dense(self) -> bool:
        return self.kind == "dense"

    def pattern_config(self):
        """The :class:`~minference.config.PatternConfig` (``None`` for dense)."""
        from minference.config import PatternConfig

        return None if self.config is None else PatternConfig.from_dict(self.config)

    def counts(self) -> dict[str, int]:
        """(layer, head) pairs per pattern kind (``{}`` for dense)."""
        out: dict[str, int] = {}
        for row in (self.config or {}).get("layers", []):
            for p in row:
                out[p["kind"]] = out.get(p["kind"], 0) + 1
        return out


def uniform_config(model: torch.nn.Module, pattern, *, model_id: str | None = None):
    """A :class:`~minference.config.PatternConfig` giving ``pattern`` to every layer and head of
    ``model`` (signature from the model, no weights fingerprint; provenance ``manual``)."""
    from minference.config import PatternConfig, Provenance, _now, _version, model_signature
    from minference.patterns import pattern_to_dict

    signature = model_signature(model, model_id=model_id, fingerprint=False)
    layers = [[pattern] * signature.num_heads for _ in range(signature.num_layers)]
    provenance = Provenance(source="manual", package_version=_version(), created=_now(),
                            notes=f"uniform: {json.dumps(pattern_to_dict(pattern))} for every layer and head")
    return PatternConfig(signature, layers, provenance)


def _pattern_name(pattern) -> str:
    """A uniform pattern's short name in reports: its budgets, then what differs from the
    defaults among the rule (with its threshold), the estimate and the scoring rows
    (``BS(top512,b128,relative0.03,query)``). Unnamed specs that differ only in other fields
    (sink blocks, minimum budgets, the forced diagonal) still share a name: ``eval`` refuses
    them before loading and asks for ``name=SPEC``."""
    kind = pattern.kind
    rule = [] if getattr(pattern, "rule", "top_k") == "top_k" else [f"{pattern.rule}{pattern.threshold:g}"]
    if kind == "vertical_slash":
        return f"VS({','.join([str(pattern.vertical), str(pattern.slash), *rule])})"
    if kind == "block_sparse":
        extra = [*rule, *([pattern.estimate] if pattern.estimate != "pooled" else []),
                 *([f"rows{pattern.score_rows}"] if pattern.score_rows else [])]
        return f"BS({','.join([f'top{pattern.top_k}', f'b{pattern.block}', *extra])})"
    if kind == "a_shape":
        return f"A({pattern.sink},{pattern.window})"
    return "dense-pattern"


def _split_spec(spec: str) -> tuple[str | None, str]:
    m = _NAMED.match(spec)
    if m and not spec.lstrip().startswith("{"):
        return m.group(1), m.group(2)
    return None, spec


def _parse_pattern(text: str):
    from minference.patterns import pattern_from_dict

    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise EvalError(f"config {text!r} is not valid JSON: {err}") from None
    try:
        return pattern_from_dict(data)
    except (TypeError, ValueError) as err:
        raise EvalError(f"config {text!r} is not a pattern: {err}") from None


def check_config_spec(spec: str):
    """Refuse, before any model is loaded, a spec that is neither ``dense``, a PatternConfig file
    that reads and validates (:func:`minference.config.load_config` without a model: JSON, schema,
    shapes) nor a valid pattern JSON. Returns the file's :class:`~minference.config.PatternConfig`
    (``None`` for dense and pattern JSON); checking it against the model needs the loaded model
    (:func:`resolve_config`).

    Raises:
        EvalError: one line; for a file, naming the file.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise EvalError(f"config spec must be a non-empty string, got {spec!r}")
    _, body = _split_spec(spec)
    body = body.strip()
    if body == DENSE:
        return None
    if body.startswith("{"):
        _parse_pattern(body)
        return None
    if not Path(body).is_file():
        raise EvalError(f"unknown config {spec!r}: expected 'dense', a PatternConfig file, or one pattern for "
                        f"every head as JSON, e.g. {DEFAULT_QWEN_PATTERN!r} (with an optional 'name=' prefix)")
    return _load_file_config(body)


def _same_spec(a: str, b: str) -> bool:
    """Whether two specs of one config name run the same thing: the same text after the ``name=``
    prefix (written or derived), or both one pattern as JSON that parse to one pattern (key order,
    spacing and fields at their defaults aside). A file spec compares as text; what the file holds
    is compared apart (:func:`_config_content`)."""
    body_a, body_b = _split_spec(a)[1].strip(), _split_spec(b)[1].strip()  # the callers compare one name's specs
    if body_a == body_b:
        return True
    if not (body_a.startswith("{") and body_b.startswith("{")):
        return False
    try:  # parsed patterns hold every field, defaults filled in
        return _parse_pattern(body_a) == _parse_pattern(body_b)
    except EvalError:
        return False


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text.strip())


def _load_file_config(path: str, signature=None, *, allow_mismatch: bool = False):
    """:func:`minference.config.load_config` of the file ``path`` (checked against ``signature``
    where given), every error one line naming the file. A config made for another model says what
    differs and whether ``--allow-mismatch`` would run it.

    Raises:
        EvalError: the file does not read, parse or validate, or does not fit ``signature``.
    """
    from minference.config import ConfigError, ConfigMismatchError, load_config

    try:
        return load_config(path, signature=signature, allow_mismatch=allow_mismatch)
    except ConfigMismatchError as err:
        differences = err.differences
        usable = False
        if not allow_mismatch:  # would --allow-mismatch run it (the config covers the model's layers and heads)?
            try:
                load_config(path, signature=signature, allow_mismatch=True)
                usable = True
            except ConfigMismatchError as again:
                differences = again.differences
        raise EvalError(f"{path} was made for another model: " + "; ".join(_one_line(d) for d in differences)
                        + (" (--allow-mismatch runs it anyway)" if usable else "")) from None
    except (ConfigError, OSError, TypeError, ValueError) as err:
        text = _one_line(str(err))
        raise EvalError(text if text.startswith(path) else f"{path}: {text}") from None


def _spec_name(spec: str) -> str:
    """The name a (checked) spec gets in the report: its ``name=`` prefix, else ``dense``, the
    pattern's short name or the file's stem."""
    name, body = _split_spec(spec)
    body = body.strip()
    if name:
        return name
    if body == DENSE:
        return DENSE
    if body.startswith("{"):
        return _pattern_name(_parse_pattern(body))
    return Path(body).stem


def _runs_sparse(spec: str, parsed) -> bool:
    """True when the (checked) spec has a head that is not dense: the dense threshold decides
    whether it runs sparse. ``parsed``: :func:`check_config_spec`'s result."""
    body = _split_spec(spec)[1].strip()
    if body == DENSE:
        return False
    if body.startswith("{"):
        return _parse_pattern(body).kind != "dense"
    return parsed is not None and any(p.kind != "dense" for row in parsed.layers for p in row)


def resolve_config(spec: str, model: torch.nn.Module, *, allow_mismatch: bool = False,
                   signature=None) -> EvalConfig:
    """:class:`EvalConfig` of one spec for ``model`` (see the module docstring for the forms). A
    file is checked against ``signature`` (default: ``model``'s, weights fingerprint included);
    a mismatch is one line naming the file (:class:`EvalError`)."""
    from minference.config import model_signature
    from minference.patterns import pattern_to_dict

    body = _split_spec(spec)[1].strip() if isinstance(spec, str) else ""
    if not body or body == DENSE or body.startswith("{") or not Path(body).is_file():
        check_config_spec(spec)  # a file is read once, below
    if body == DENSE:
        return EvalConfig(_spec_name(spec), spec, "dense")
    if body.startswith("{"):
        pattern = _parse_pattern(body)
        config = uniform_config(model, pattern)
        return EvalConfig(_spec_name(spec), spec, "uniform", config.to_dict(), pattern_to_dict(pattern))
    config = _load_file_config(body, model_signature(model) if signature is None else signature,
                               allow_mismatch=allow_mismatch)
    return EvalConfig(_spec_name(spec), spec, "file", config.to_dict())


# ---------------------------------------------------------------------------------------------
# Report.


@dataclass
class TimeSplit:
    """Device time (ms) of one profiled prefill: ``attention + index + other = total``.

    Attributes:
        attention_ms: attention kernels (inside :data:`~minference.dispatch.ATTENTION_RANGE`, or
            SDPA ops outside it) minus the index time.
        index_ms: kernels under :data:`~minference.dispatch.INDEX_RANGE` (building + conversion).
        other_ms: every other kernel of the prefill (projections, MLP, norms, LM head, copies).
        total_ms: all kernels of the profiled prefill.
        unlinked_ms: kernel time whose launch call was not in the trace (counted in ``other``).
        top: per part (``"attention"``, ``"index"``, ``"other"``) its :data:`TOP_KERNELS`
            costliest kernels by name (first :data:`KERNEL_NAME_CHARS` characters) -> ms: where
            the time goes (device split only).
    """

    attention_ms: float
    index_ms: float
    other_ms: float
    total_ms: float
    unlinked_ms: float = 0.0
    top: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class SampleRecord:
    """One (config, task, length, sample) run.

    Attributes:
        correct: exact match of the greedy answer (``None`` for the perplexity task): every
            answer found (:func:`minference.app.evals.score`).
        found: the fraction of the answers found (:func:`minference.app.evals.score_fraction`,
            RULER's partial credit for multi-answer tasks; ``None`` for perplexity).
        text: the generated text (``None`` for perplexity).
        ttft_s: the timed prefill (``None`` where none was timed).
        nll: mean next-token NLL (perplexity task), ``nll_buckets`` its mean per position bucket.
        prompt_tokens: the prompt's own length where it differs from ``n_tokens`` (RULER: ``n_tokens``
            is the set's RULER length, each prompt is shorter), else ``None``.
        decode_s: wall time of the greedy decode after the timed prefill (RULER suite), else ``None``;
            with ``batch_decode`` the time of the prompt's one batched decode, the same in each of
            its configs' records (a sum over records counts it once per config).
        stop: why decoding stopped (RULER suite): ``"eos"``, ``"max"`` (the task's RULER
            ``max_new_tokens``) or ``"settled"`` (the score is already 1; more text cannot change it).
        compiles: ``[kernel name, seconds]`` of every Triton kernel variant compiled while this
            record's timed prefill (and, RULER suite, its decode) ran (:class:`minference.compiles.
            CompileCounter`): a TTFT that holds a compile says so. Empty on the CPU's interpreter.
    """

    config: str
    task: str
    n_tokens: int
    index: int
    seed: int
    depth: float | None
    answers: list[str]
    correct: bool | None
    text: str | None
    ttft_s: float | None
    new_tokens: int = 0
    nll: float | None = None
    nll_buckets: list[float] | None = None
    found: float | None = None
    prompt_tokens: int | None = None
    decode_s: float | None = None
    stop: str | None = None
    compiles: list = field(default_factory=list)


@dataclass
class RunStats:
    """What was measured once per (config, length).

    Attributes:
        ttft_s: every timed prefill; ``ttft_median_s`` their median.
        warmup_s: the untimed warm-up prefill.
        settle_s: the untimed prefill after the profiled and coverage prefills (CUDA), so the timed
            ones do not pay for the state those leave (their multi-GB float32 scoring resizes the
            caching allocator's pool; the suspect of a slow first timed prompt, docs/testbed.md).
        split: :class:`TimeSplit` (``None``: CPU, or profiling off).
        density, physical_density, coverage: means over layers (``None``: not measured / n/a).
        layer_*: per layer.
        calls: attention calls per path in one prefill (``{}`` for dense: unpatched).
        yarn: the rotary embedding ran YaRN at this length.
        guard: the quality guard's summary (``QualityGuard.summary``; ``None``: no guard).
    """

    config: str
    n_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    ttft_median_s: float | None = None
    warmup_s: float | None = None
    settle_s: float | None = None
    split: TimeSplit | None = None
    density: float | None = None
    physical_density: float | None = None
    coverage: float | None = None
    layer_density: list[float] = field(default_factory=list)
    layer_physical: list[float | None] = field(default_factory=list)
    layer_coverage: list[float] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    yarn: bool = False
    guard: dict | None = None


def _build(cls, data: dict):
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class EvalReport:
    """Everything :func:`run_eval` measured; :meth:`to_dict` is the JSON file's content.

    ``settings`` are what runs must share to be merged (compared exactly); ``cuda_graph_stats`` is
    what was counted, not set: per sparse config, the :class:`~minference.graphs.PrefillGraphs`
    counters of a ``cuda_graphs`` run (captures, replays, direct calls...; ``{}`` without graphs),
    summed by :func:`merge_reports`.
    """

    model: dict
    machine: dict
    settings: dict
    configs: list[EvalConfig]
    lengths: list[int]
    tasks: list[str]
    records: list[SampleRecord] = field(default_factory=list)
    runs: list[RunStats] = field(default_factory=list)
    started: str = ""
    wall_s: float = 0.0
    cuda_graph_stats: dict[str, dict[str, int]] = field(default_factory=dict)

    def run(self, config: str, n_tokens: int) -> RunStats | None:
        return next((r for r in self.runs if r.config == config and r.n_tokens == n_tokens), None)

    def common_scores(self, n_tokens: int) -> tuple[dict[str, float], int]:
        """Per config, its mean score at ``n_tokens`` over the generation prompts that every config
        ran there (RULER: the per-sample metric; else 1 for a correct answer), and how many prompts
        that is. A config cut short on some tasks is compared with the others on the prompts they
        share, not drawn below dense for having run only the hard tasks. ``({}, 0)``: none shared."""
        ruler = self.settings.get("suite") == "ruler"
        runs: dict[str, dict[tuple, float]] = {}
        for r in self.records:
            if r.n_tokens == n_tokens and r.correct is not None:
                value = r.found if ruler and r.found is not None else float(bool(r.correct))
                runs.setdefault(r.config, {})[(r.task, r.seed, r.index)] = value
        common = set.intersection(*(set(v) for v in runs.values())) if runs else set()
        if not common:
            return {}, 0
        return {k: statistics.fmean(v[key] for key in common) for k, v in runs.items()}, len(common)

    def accuracy(self) -> list[dict]:
        """``{config, task, n_tokens, correct, total, found}`` per (config, task, length) of the
        generation tasks, in run order; ``found``: the mean fraction of answers found (``None``
        when a record lacks it)."""
        out: dict[tuple, dict] = {}
        fractions: dict[tuple, list] = {}
        for r in self.records:
            if r.correct is None:
                continue
            key = (r.config, r.task, r.n_tokens)
            row = out.setdefault(key, dict(config=r.config, task=r.task, n_tokens=r.n_tokens, correct=0, total=0))
            row["correct"] += int(r.correct)
            row["total"] += 1
            fractions.setdefault(key, []).append(r.found)
        for key, row in out.items():
            f = fractions[key]
            row["found"] = None if any(x is None for x in f) else statistics.fmean(f)
        return list(out.values())

    def ttft_summary(self) -> list[dict]:
        """Median and worst-case TTFT per (config, task, length), each against dense on the same
        prompts; ``task == "all"`` pools every timed prompt of the (config, length). Fields (times in
        ms, ``None`` where there is no dense run or no timed prompt):

        * ``config``, ``task``, ``n_tokens``, ``prompts``: the cell and its number of timed prompts;
        * ``ttft_median_ms``, ``ttft_max_ms``: median and maximum TTFT over the cell's prompts;
        * ``dense_median_ms``, ``dense_max_ms``: the same for dense on the same prompts (those dense
          timed too, matched by task and sample index);
        * ``speedup_median`` = ``dense_median_ms / ttft_median_ms`` and ``speedup_max`` =
          ``dense_max_ms / ttft_max_ms``: > 1 is faster than dense (the worst case against dense's
          worst case);
        * ``worst_ratio``: the largest ``ttft / dense ttft`` of one prompt (> 1: slower than dense on
          that prompt), ``worst_task`` and ``worst_index`` name it.
        """
        dense = next((c.name for c in self.configs if c.dense), None)
        timed: dict[tuple, float] = {}
        for r in self.records:
            if r.ttft_s is not None:
                timed[(r.config, r.task, r.n_tokens, r.index)] = r.ttft_s
        cells: dict[tuple, list[tuple[str, int, float]]] = {}
        for (config, task, n, index), t in timed.items():
            for key in ((config, task, n), (config, "all", n)):
                cells.setdefault(key, []).append((task, index, t))
        out = []
        for (config, task, n), items in cells.items():
            times = [t for _, _, t in items]
            pairs = [(t, dt, k, i) for k, i, t in items if dense and (dt := timed.get((dense, k, n, i))) is not None]
            d = [p[1] for p in pairs]
            med, top = statistics.median(times), max(times)
            worst = max(pairs, key=lambda p: p[0] / p[1]) if pairs else None
            ms = lambda x: None if x is None else x * 1e3
            out.append(dict(
                config=config, task=task, n_tokens=n, prompts=len(times), ttft_median_ms=ms(med), ttft_max_ms=ms(top),
                dense_median_ms=ms(statistics.median(d)) if d else None, dense_max_ms=ms(max(d)) if d else None,
                speedup_median=statistics.median(d) / med if d else None, speedup_max=max(d) / top if d else None,
                worst_ratio=worst[0] / worst[1] if worst else None, worst_task=worst[2] if worst else None,
                worst_index=worst[3] if worst else None))
        return out

    def perplexity(self) -> list[dict]:
        """``{config, n_tokens, samples, nll, buckets}``: means over the perplexity samples."""
        groups: dict[tuple, list[tuple[float, list[float] | None]]] = {}
        for r in self.records:
            if r.nll is not None:
                groups.setdefault((r.config, r.n_tokens), []).append((r.nll, r.nll_buckets))
        out = []
        for (config, n), recs in groups.items():
            buckets = [statistics.fmean(col) for col in zip(*(b for _, b in recs))]
            out.append(dict(config=config, n_tokens=n, samples=len(recs),
                            nll=statistics.fmean(nll for nll, _ in recs), buckets=buckets))
        return out

    def to_dict(self) -> dict:
        data = {"format": REPORT_FORMAT, "version": REPORT_VERSION, **asdict(self)}
        data["summary"] = {"accuracy": self.accuracy(), "perplexity": self.perplexity(), "ttft": self.ttft_summary()}
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=True)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, data) -> EvalReport:
        """The report of :meth:`to_dict`'s JSON. Checked: an object with the report's format tag and
        every field without a default, its configs, records and runs objects with their required
        fields. A report written before :attr:`cuda_graph_stats` had its own field keeps them in
        ``settings``: they move there (so it merges with newer reports).

        Raises:
            ValueError: not an eval report, or a malformed one (one line).
        """
        if not isinstance(data, dict):
            raise ValueError(f"not an eval report (a JSON {type(data).__name__}, not an object)")
        if data.get("format") != REPORT_FORMAT:
            raise ValueError(f"not an eval report (format {data.get('format')!r})")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required + ["records", "runs"] if k not in data]
        if missing:
            raise ValueError(f"malformed eval report: no {', '.join(map(repr, missing))}")
        try:
            runs = []
            for r in data["runs"]:
                r = dict(r)
                r["split"] = None if r.get("split") is None else _build(TimeSplit, r["split"])
                runs.append(_build(RunStats, r))
            body = {k: v for k, v in data.items() if k not in ("format", "version", "summary")}
            body["configs"] = [_build(EvalConfig, c) for c in data["configs"]]
            body["records"] = [_build(SampleRecord, r) for r in data["records"]]
            body["runs"] = runs
            if isinstance(body["settings"], dict) and "cuda_graph_stats" in body["settings"]:
                body["settings"] = dict(body["settings"])
                body.setdefault("cuda_graph_stats", body["settings"].pop("cuda_graph_stats"))
            return _build(cls, body)
        except (TypeError, AttributeError, KeyError, ValueError) as err:
            raise ValueError(f"malformed eval report: {type(err).__name__}: {err}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalReport:
        """:meth:`from_dict` of a JSON file; its ``ValueError`` (bad JSON, not a report) names the file."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


def merge_reports(reports: Sequence[EvalReport], names: Sequence[str] | None = None) -> EvalReport:
    """One report from several runs of one model on one machine (e.g. the device calls of one
    session, each within its time limit): configs and lengths in first-seen order, records and
    runs concatenated, :attr:`EvalReport.cuda_graph_stats` summed per config. Speed-ups stay per
    (config, length) against the dense run of that length, so every sparse config must have been
    measured with dense in the same run (:func:`_check_dense_in_each`).
    One (config, length) may come from several reports when they ran disjoint samples (a RULER
    length split over calls with ``--tasks``, or a cut call continued with ``--continue``): its
    TTFTs are joined and their median taken again; the warm-up, the split, density and coverage
    (and the quality guard's summary) are the first report's, or the first that has them: runs
    that differ only in ``--no-profile`` / ``--no-coverage`` (untimed extra prefills) merge.
    ``names`` name the reports in errors (default ``report 1``, ``report 2``...; the CLI passes
    the files).

    Raises:
        EvalError: a different model, dtype, GPU or settings (the differing keys named), a config
            name with two specs or two contents, one (config, task, length, sample) in two
            reports, or a sparse config without dense in its own report.
    """
    if not reports:
        raise EvalError("nothing to merge")
    names = [f"report {i + 1}" for i in range(len(reports))] if names is None else list(names)
    first = reports[0]
    keys = ("name", "dtype", "model_id")
    configs: dict[str, EvalConfig] = {}
    runs: dict[tuple, RunStats] = {}
    lengths: list[int] = []
    tasks: list[str] = []
    records: list[SampleRecord] = []
    seen: dict[tuple, set[tuple]] = {}  # (config, length) -> (task, seed, index) of the samples merged so far
    # the coverage figures of every report must be of one kind: compared with the first that has them
    coverage_ref = next(((n, r) for n, r in zip(names, reports) if r.settings.get("coverage")), None)
    graph_stats: dict[str, dict[str, int]] = {}
    for name, rep in zip(names, reports):
        if any(rep.model.get(k) != first.model.get(k) for k in keys):
            raise EvalError(f"{name}: different models: {rep.model} vs {first.model}")
        if rep.machine.get("gpu") != first.machine.get("gpu"):
            raise EvalError(f"reports from different machines cannot be merged ({name}: GPU "
                            f"{rep.machine.get('gpu')!r}, {names[0]}: {first.machine.get('gpu')!r})")
        differ = _settings_conflict(first.settings, rep.settings)
        if differ:
            raise EvalError(f"reports with different settings cannot be merged ({names[0]} vs {name}: {differ})")
        if coverage_ref is not None:
            ref_name, ref = coverage_ref
            rows = _rows_conflict(ref.settings, rep.settings)
            if rows:
                raise EvalError(f"reports with different settings cannot be merged ({ref_name} vs {name}: {rows})")
        for c in rep.configs:
            known = configs.get(c.name)
            if known is not None and not _same_spec(known.spec, c.spec):
                raise EvalError(f"config {c.name!r} has two specs: {known.spec!r} and {c.spec!r} ({name})")
            if known is not None and _config_content(known) != _config_content(c):
                raise EvalError(f"config {c.name!r} has two contents under the specs {known.spec!r} and {c.spec!r} "
                                f"({name} differs: a file changed between the runs?)")
            configs.setdefault(c.name, c)
        for config, counts in rep.cuda_graph_stats.items():
            into = graph_stats.setdefault(config, {})
            for k, v in counts.items():
                into[k] = into.get(k, 0) + v
        for r in rep.runs:
            key = (r.config, r.n_tokens)
            mine = {(x.task, x.seed, x.index) for x in rep.records if (x.config, x.n_tokens) == key}
            if key in runs:
                both = seen[key] & mine
                if both or not mine:
                    raise EvalError(f"{r.config} at {r.n_tokens} tokens is in two reports"
                                    + (f" ({_samples_text(both)} in both)" if both else ""))
                merged = runs[key]
                merged.ttft_s = merged.ttft_s + r.ttft_s
                merged.ttft_median_s = float(statistics.median(merged.ttft_s)) if merged.ttft_s else None
                _fill_extras(merged, r)
                seen[key] |= mine
                continue
            runs[key] = copy.deepcopy(r)
            seen[key] = set(mine)
        lengths += [n for n in rep.lengths if n not in lengths]
        tasks += [t for t in rep.tasks if t not in tasks]
        records += rep.records
    _check_dense_in_each(reports, names, configs)
    settings = dict(first.settings)
    for extra in ("profile", "coverage"):  # a measurement any report made is in the merged one
        if extra in settings:
            settings[extra] = any(rep.settings.get(extra) for rep in reports)
    if coverage_ref is not None and "coverage_rows" in coverage_ref[1].settings:
        settings["coverage_rows"] = coverage_ref[1].settings["coverage_rows"]
    return EvalReport(model=first.model, machine=first.machine, settings=settings, configs=list(configs.values()),
                      lengths=lengths, tasks=tasks, records=records, runs=list(runs.values()), started=first.started,
                      wall_s=sum(r.wall_s for r in reports), cuda_graph_stats=graph_stats)


# Settings that add an untimed prefill per (config, length) and change no scored value: reports
# that differ only in them merge (each run keeps the first report's extra that has it). That they
# leave the timed prefills alone is assumed: a settling prefill follows them on CUDA (``settle_s``;
# whether it absorbs their effect on the next timed prefill is still to be shown, docs/testbed.md).
_EXTRA_SETTINGS = ("profile", "coverage", "coverage_rows")


def _settings_conflict(ours: dict, theirs: dict, skip: Sequence[str] = ()) -> str:
    """:func:`_settings_diff` without :data:`_EXTRA_SETTINGS` (nor ``skip``): what keeps two runs
    apart (``""``: nothing); :func:`_rows_conflict` compares the coverage of runs that measured it."""
    return _settings_diff(ours, theirs, skip=(*skip, *_EXTRA_SETTINGS))


def _rows_conflict(ours: dict, theirs: dict) -> str:
    """``coverage_rows: a vs b`` when both runs measured coverage on different numbers of sample
    rows (figures of two kinds), else ``""``."""
    if ours.get("coverage") and theirs.get("coverage") and ours.get("coverage_rows") != theirs.get("coverage_rows"):
        return f"coverage_rows: {ours.get('coverage_rows')!r} vs {theirs.get('coverage_rows')!r}"
    return ""


def _fill_extras(merged: RunStats, other: RunStats) -> None:
    """Give ``merged`` the profile split and the density / coverage figures of ``other`` where it
    has none (a (config, length) profiled in one call of a split RULER length but not another)."""
    if merged.split is None:
        merged.split = copy.deepcopy(other.split)
    if merged.density is None and merged.coverage is None:
        for name in ("density", "physical_density", "coverage", "layer_density", "layer_physical", "layer_coverage"):
            setattr(merged, name, copy.deepcopy(getattr(other, name)))


def _settings_diff(ours: dict, theirs: dict, skip: Sequence[str] = ()) -> str:
    """The keys whose values differ between two reports' settings (a key one lacks differs), as
    ``key: ours vs theirs; ...`` with each value cut to 40 characters; ``""``: the same. Keys in
    ``skip`` are not compared."""
    def text(settings: dict, key: str) -> str:
        value = repr(settings[key]) if key in settings else "absent"
        return value if len(value) <= 40 else value[:39] + "…"

    absent = object()
    keys = [k for k in dict.fromkeys([*ours, *theirs])
            if k not in skip and ours.get(k, absent) != theirs.get(k, absent)]
    return "; ".join(f"{k}: {text(ours, k)} vs {text(theirs, k)}" for k in keys)


def _config_content(config: EvalConfig) -> tuple:
    """What a config runs: its pattern and its PatternConfig without the provenance (a uniform
    config's creation time differs from run to run; a file's provenance says nothing it runs),
    patterns in their canonical form (:func:`minference.patterns.canonical_layers`)."""
    from minference.patterns import canonical_layers, canonical_pattern_dict

    body = None
    if config.config is not None:
        body = {k: v for k, v in config.config.items() if k != "provenance"}
        body["layers"] = canonical_layers(body.get("layers"))
    pattern = None if config.pattern is None else canonical_pattern_dict(config.pattern)
    return body, pattern


def _check_dense_in_each(reports: Sequence[EvalReport], names: Sequence[str], configs: dict[str, EvalConfig]) -> None:
    """Every ratio against dense compares the timings of one run: in each report, a sparse
    (config, length) needs the merged report's dense config at that length, timed on every prompt
    the sparse one was timed on. Nothing to check where no config is dense (no ratios).

    Raises:
        EvalError: the first report and sparse config that lacks it (one line).
    """
    dense = next((c.name for c in configs.values() if c.dense), None)
    if dense is None:
        return
    for name, rep in zip(names, reports):
        lengths = {r.n_tokens for r in rep.runs if r.config == dense}
        timed = {(x.task, x.n_tokens, x.index) for x in rep.records if x.config == dense and x.ttft_s is not None}
        for r in rep.runs:
            config = configs.get(r.config)
            if config is None or config.dense:
                continue
            lacking = {(x.task, x.seed, x.index) for x in rep.records
                       if (x.config, x.n_tokens) == (r.config, r.n_tokens) and x.ttft_s is not None
                       and (x.task, x.n_tokens, x.index) not in timed}
            if r.n_tokens not in lengths or lacking:
                where = "at that length" if r.n_tokens not in lengths else f"on {_samples_text(lacking)}"
                raise EvalError(f"{name}: {r.config} at {r.n_tokens} tokens has no {dense} run {where} in the same "
                                f"report; every ratio against dense must come from one run (merge each sparse config "
                                f"with the dense run of its own call)")


def _samples_text(samples: set[tuple]) -> str:
    """``{(task, seed, index), ...}`` as ``task a samples 0, 1; task b sample 3``."""
    by_task: dict[str, list[int]] = {}
    for task, _, index in samples:
        by_task.setdefault(task, []).append(index)
    return "; ".join(f"task {t} sample{'s' if len(i) > 1 else ''} {', '.join(map(str, sorted(i)))}"
                     for t, i in sorted(by_task.items()))


# ---------------------------------------------------------------------------------------------
# Measurements.


def _prefill(model, ids: torch.Tensor, chunk: int = 0):
    """Whole-model prefill of one prompt ``ids [n]`` (in chunks of ``chunk`` tokens through the
    cache: chunked prefill; :func:`~minference.app.models.timed_prefill`); returns ``(seconds,
    cache, first token id tensor)`` synchronised."""
    seconds, out, first = timed_prefill(model, ids[None], chunk)
    return seconds, output_cache(out), first[0]


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _generate(model, ids: torch.Tensor, max_new_tokens: Sequence[int], eos: set[int],
              settled: Callable[[int, list[int]], bool] | None = None, chunk: int = 0) -> list[list[int]]:
    """Greedy decode of a batch of equal-length prompts ``ids [B, n]`` (no padding, so each row
    decodes exactly as it would alone): row ``b`` up to ``max_new_tokens[b]`` tokens, stopping at
    EOS (not returned), or as soon as ``settled(b, tokens)`` says more tokens cannot change the
    row's score. One prefill (in chunks of ``chunk`` tokens, 0: one call) and one decode loop for
    the batch."""
    with torch.no_grad():
        out = forward_chunks(model, ids, chunk, logits_to_keep=1)
        seqs, _ = _decode(model, output_cache(out), out.logits[:, -1].argmax(-1), max_new_tokens, eos, settled)
    return seqs


def _decode(model, cache, nxt: torch.Tensor, max_new_tokens: Sequence[int], eos: set[int],
            settled: Callable[[int, list[int]], bool] | None = None) -> tuple[list[list[int]], list[str]]:
    """The greedy loop after a prefill: ``nxt [B]`` the prefill's next tokens, ``cache`` its KV
    cache. Returns each row's tokens (EOS dropped) and why it stopped (``"eos"``, ``"max"``,
    ``"settled"``)."""
    B = nxt.shape[0]
    seqs: list[list[int]] = [[] for _ in range(B)]
    stops: list[str | None] = [None] * B
    with torch.no_grad():
        while True:
            for b, t in enumerate(nxt.tolist()):
                if stops[b] is None:
                    seqs[b].append(t)
                    if t in eos:
                        stops[b] = "eos"
                    elif settled is not None and settled(b, seqs[b]):
                        stops[b] = "settled"
                    elif len(seqs[b]) >= max_new_tokens[b]:
                        stops[b] = "max"
            if all(x is not None for x in stops):
                break
            out = decode_step(model, nxt, cache, nxt.device)
            cache = output_cache(out)
            nxt = out.logits[:, -1].argmax(-1)
    del cache
    done = cast("list[str]", stops)  # the loop ends only once every row has stopped
    return [s[:-1] if s and s[-1] in eos else s for s in seqs], done


def _answer(model, ids: torch.Tensor, max_new_tokens: int, eos: set[int],
            settled: Callable[[list[int]], bool] | None = None, chunk: int = 0):
    """One prompt ``ids [n]``: the timed prefill (its time is the TTFT) and the greedy decode from
    its cache. Returns ``(ttft_s, tokens, decode_s, stop)``."""
    ttft, cache, first = _prefill(model, ids, chunk)
    start = time.perf_counter()
    seqs, stops = _decode(model, cache, first.reshape(1), [max_new_tokens], eos,
                          None if settled is None else (lambda b, tokens: settled(tokens)))
    synchronize(ids.device)
    return ttft, seqs[0], time.perf_counter() - start, stops[0]


def _settled(sample, tokens: list[int], tokenizer) -> bool:
    """True when every answer already occurs as a whole word and the text ends in a character
    that is no letter or digit: later tokens can then neither add nor break a match
    (:func:`minference.app.evals.score`), so decoding may stop (same score, fewer steps)."""
    from minference.app import evals

    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return bool(text) and not text[-1].isalnum() and evals.score(sample, text)


def sequence_nll(model: PreTrainedModel, ids: torch.Tensor, *, chunk: int = NLL_CHUNK,
                 prefill_chunk: int = 0, last: int | None = None) -> torch.Tensor:
    """Next-token NLL ``[n - 1]`` float32 (on the CPU) of ``ids [n]`` from ONE prefill of the
    decoder (in chunks of ``prefill_chunk`` tokens through the cache, 0: one call): the LM head and
    log-softmax run on ``chunk`` hidden rows at a time, so no ``[n, vocab]`` tensor is ever
    built. Position ``i`` is ``-log p(ids[i + 1] | ids[: i + 1])``. ``last``: only the final
    ``last`` positions (``[last]``, the same values up to float rounding): the LM head skips the
    other rows (at 131K tokens and Qwen's 151,936-word vocabulary, predicted to be about half of a
    last-layer forward; not timed)."""
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(f"ids must be 1-D with at least 2 tokens, got shape {tuple(ids.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    n = ids.numel()
    if last is not None:
        given = last
        try:
            last = -1 if isinstance(given, bool) else operator.index(given)  # numpy and torch ints too
        except TypeError:
            last = -1
        if not 1 <= last <= n - 1:
            raise ValueError(f"last must be an int in 1..{n - 1} (the positions with a next token), got {given!r}")
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    targets = ids[1:]
    begin = 0 if last is None else n - 1 - last  # the first position scored
    out = torch.empty(n - 1 - begin, dtype=torch.float32, device=ids.device)

    def score(first: int, step) -> None:  # the hidden rows of positions first .. first + len - 1
        hidden = step.last_hidden_state[0]
        for s in range(max(begin - first, 0), hidden.shape[0], chunk):
            lo, hi = first + s, min(first + min(s + chunk, hidden.shape[0]), n - 1)
            if lo >= hi:
                break
            logp = torch.log_softmax(head(hidden[s : s + hi - lo]).float(), dim=-1)  # [c, vocab]
            out[lo - begin : hi - begin] = -logp.gather(1, targets[lo:hi, None].long())[:, 0]
            del logp

    with torch.no_grad():
        if prefill_chunk:
            forward_chunks(decoder, ids[None], prefill_chunk, each=score)
        else:
            score(0, decoder(input_ids=ids[None], use_cache=False))
    return out.cpu()


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def split_events(events, *, device: bool = True) -> TimeSplit:
    """The eq. 13 split of one profiled prefill from ``torch.profiler`` events (``prof.events()``).

    ``device=True``: every device kernel (and copy) counts once, for the host range that was open
    when its launch call (``cudaLaunchKernel``, ``cuLaunchKernelEx``, ... matched by correlation
    id) ran, so Triton launches through the driver count as well as ATen's. Ranges count at
    their outermost occurrence; SDPA ops inside an attention range belong to that range.
    ``device=False`` splits CPU wall time of the same ranges instead (tests on CPU-only machines).
    """
    from minference.dispatch import ATTENTION_RANGE, INDEX_RANGE

    cpu = torch.autograd.DeviceType.CPU
    host = [e for e in events if e.device_type == cpu and not e.is_async]

    def outermost(test) -> list:
        return [e for e in host if test(e) and not any(test(a) for a in _ancestors(e))]

    attention = outermost(lambda e: e.name == ATTENTION_RANGE)
    attention += [e for e in outermost(lambda e: bool(SDPA_OPS.match(e.name)))
                  if not any(a.name == ATTENTION_RANGE for a in _ancestors(e))]
    index = outermost(lambda e: e.name == INDEX_RANGE)
    if not device:
        total = sum(e.cpu_time_total for e in host if e.cpu_parent is None)
        att, idx, unlinked = (sum(e.cpu_time_total for e in attention), sum(e.cpu_time_total for e in index), 0.0)
    else:
        kernels = [e for e in events if e.device_type != cpu and not getattr(e, "is_user_annotation", False)
                   and e.name not in (ATTENTION_RANGE, INDEX_RANGE)]
        launches = {e.id: e for e in host if _LAUNCH_CALLS.match(e.name)}
        windows = lambda group: [(e.time_range.start, e.time_range.end) for e in group]
        att_w, idx_w = windows(attention), windows(index)
        total = att = idx = unlinked = 0.0
        by_part: dict[str, dict[str, float]] = {"attention": {}, "index": {}, "other": {}}
        for k in kernels:
            t = k.time_range.elapsed_us()
            total += t
            call = launches.get(k.id)
            part = "other"
            if call is None:
                unlinked += t
            else:
                at = call.time_range.start
                if any(a <= at <= b for a, b in att_w):
                    att += t
                    part = "attention"
                    if any(a <= at <= b for a, b in idx_w):
                        idx += t
                        part = "index"
            name = k.name[:KERNEL_NAME_CHARS]
            by_part[part][name] = by_part[part].get(name, 0.0) + t
        top = {part: {n: round(t * 1e-3, 3) for n, t in sorted(d.items(), key=lambda x: -x[1])[:TOP_KERNELS]}
               for part, d in by_part.items()}
    ms = 1e-3
    return TimeSplit(attention_ms=(att - idx) * ms, index_ms=idx * ms, other_ms=(total - att) * ms,
                     total_ms=total * ms, unlinked_ms=unlinked * ms, top=top if device else {})


def _profiled_split(model, ids: torch.Tensor, chunk: int = 0) -> TimeSplit:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            forward_chunks(model, ids[None], chunk, logits_to_keep=1)
        synchronize(ids.device)
    return split_events(prof.events(), device=True)


def _physical_density(plan, query: torch.Tensor, key: torch.Tensor, scale, fill_gaps: int) -> list[float | None]:
    """Per local head: area of the tiles the Triton kernels run over the causal pairs, from the
    dispatcher's own index (vertical-slash: converted tiles; block-sparse: chosen blocks; dense:
    1); ``None`` for A-shape heads (no materialised index)."""
    from minference.backend import get_backend
    from minference.index import build_group_index, prepare_plan
    from minference.kernels import convert_vertical_slash, vs_physical_tiles
    from minference.kernels._common import default_tiles

    B, Hq, N, _ = query.shape
    pairs = N * (N + 1) / 2
    out: list[float | None] = [None] * Hq
    tiles = default_tiles(query)
    triton = get_backend("triton")
    for dg in prepare_plan(plan, Hq, 0, query.device):
        heads = dg.heads.tolist()
        kind = dg.group.kind
        if kind == "dense":
            area = [pairs] * len(heads)
        elif kind == "vertical_slash":
            vertical, slash = build_group_index(triton, dg, query, key, scale=scale, seqlens=None, seqstarts=None,
                                                head_offset=0)
            index = convert_vertical_slash(vertical, slash, N, block_m=tiles.block_m, fill_gaps=fill_gaps,
                                           block_n=tiles.block_n)
            area = (vs_physical_tiles(index, tiles.block_n)[0].double() * tiles.block_m * tiles.block_n).tolist()
        elif kind == "block_sparse":
            blocks = build_group_index(triton, dg, query, key, scale=scale, seqlens=None, seqstarts=None,
                                       head_offset=0)  # [B, Hg, NQB, K]
            qb = torch.arange(blocks.shape[2], device=blocks.device)[:, None]
            chosen = ((blocks >= 0) & (blocks <= qb)).sum(dim=(-1, -2))[0]  # [Hg]
            area = (chosen.double() * dg.group.key[0] ** 2).tolist()
        else:
            continue
        for h, a in zip(heads, area):
            out[h] = min(1.0, a / pairs) if kind != "dense" else 1.0
    return out


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values or len(present) < len(values):
        return None
    return float(statistics.fmean(present))


def _measure_coverage(model, config, ids: torch.Tensor, stats: RunStats, *, physical: bool) -> None:
    """One untimed prefill whose observer scores every sparse layer (fills ``stats.layer_*``)."""
    import minference.integration as integ
    from minference.app.search import plan_coverage
    from minference.dispatch import FILL_GAPS

    n = ids.numel()
    stride = max(1, n // COVERAGE_ROWS)
    states = integ.layer_states(model)
    modules = integ.attention_modules(model)
    L = max(modules) + 1
    density: list[float] = [1.0] * L
    cover: list[float] = [1.0] * L
    phys: list[float | None] = [1.0] * L

    def observer(layer, query, key, _value, seqlens, seqstarts):
        state = states[layer]
        heads = query.shape[1]
        plan = state.plan[state.head_offset: state.head_offset + heads]
        scale = getattr(modules[layer], "scaling", None)
        m, d = plan_coverage(query[0].float(), key[0].float(), plan, scale=scale, row_stride=stride)
        cover[layer], density[layer] = float(m.mean()), float(d.mean())
        if physical:
            per_head = _physical_density(plan, query, key, scale, state.fill_gaps or FILL_GAPS)
            phys[layer] = _mean(per_head)
        else:
            phys[layer] = None

    for state in states.values():
        state.observer = observer
    try:
        with torch.no_grad():
            model(ids[None], use_cache=False, logits_to_keep=1)
    finally:
        for state in states.values():
            state.observer = None
    stats.layer_density, stats.layer_coverage, stats.layer_physical = density, cover, phys
    stats.density, stats.coverage, stats.physical_density = _mean(density), _mean(cover), _mean(phys)


# ---------------------------------------------------------------------------------------------
# The run.


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EvalError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_tasks(tasks: Sequence[str]) -> list[str]:
    from minference.app import evals

    known = tuple(evals.TASKS) + (evals.PERPLEXITY_TASK,)
    tasks = list(tasks)
    if not tasks:
        raise EvalError(f"no tasks given; choose from {', '.join(known)}")
    for t in tasks:
        if t not in known:
            raise EvalError(f"unknown task {t!r}; choose from {', '.join(known)}")
    if len(set(tasks)) != len(tasks):
        raise EvalError(f"tasks repeat: {tasks}")
    return tasks


def _native_context(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    saved = getattr(model, "_minference_rope", None)  # set_context_length keeps the model's own
    return int(saved[1]) if saved else int(cfg.max_position_embeddings)


def _context_limit(model_name: str, native: int, force_length: bool) -> tuple[int, str]:
    """``(tokens, its description)``: the longest prompt plus answer ``model_name`` reads, from its
    ``native`` context (YaRN x4 for Qwen, or with ``force_length``)."""
    from minference.app.models import QWEN_YARN_FACTOR, is_qwen

    if is_qwen(model_name) or force_length:
        return int(QWEN_YARN_FACTOR * native), f"YaRN x{QWEN_YARN_FACTOR:g} of the native {native}-token context"
    return native, f"{model_name}'s {native}-token context (force_length / --force-length: run YaRN beyond it)"


@dataclass
class _Round:
    """The procedural prompts of one (length, sample index): a sample per generation task, in task
    order, and the perplexity task's ids ``[n]`` (``None``: that task is not run)."""

    samples: dict[str, Sample]
    perplexity: torch.Tensor | None = None

    def tasks(self) -> list[str]:
        """The round's tasks in run order: the generation tasks, then the perplexity task."""
        from minference.app import evals

        return list(self.samples) + ([evals.PERPLEXITY_TASK] if self.perplexity is not None else [])

    def first_ids(self) -> torch.Tensor:
        """``[n]`` the first task's prompt (what the once-per-length prefills run)."""
        for sample in self.samples.values():
            return sample.ids
        if self.perplexity is None:
            raise EvalError("a round without prompts (no tasks)")
        return self.perplexity

    def max_new_tokens(self) -> int:
        """The most new tokens a generation task of the round asks for (0: none)."""
        return max((s.max_new_tokens for s in self.samples.values()), default=0)


def _first_prompts(ruler_set, tokenizer, lengths, tasks, samples, seed, limit: int, limit_text: str,
                   allow_mismatch: bool) -> tuple[dict[int, list[RulerSample]], dict[int, _Round]]:
    """``(RULER prompts per length, {length: first procedural round})``, each checked to fit its
    task and the model's context ``limit``; raises :class:`EvalError` naming the length."""
    from minference.app import evals

    if ruler_set is not None:
        return _ruler_prompts(ruler_set, tokenizer, lengths, tasks, samples, limit, limit_text, allow_mismatch), {}
    first: dict[int, _Round] = {}
    for n in lengths:
        first[n] = _Round({})
        for task in (t for t in tasks if t != evals.PERPLEXITY_TASK):
            try:
                first[n].samples[task] = evals.make_sample(task, tokenizer, n, 0, samples=samples, seed=seed)
            except ValueError as err:
                raise EvalError(f"length {n} does not fit task {task!r}: {err}") from None
        if evals.PERPLEXITY_TASK in tasks:
            if n - 1 < NLL_BUCKETS:
                raise EvalError(f"length {n} is too short for the perplexity task: it needs at least "
                                f"{NLL_BUCKETS + 1} tokens ({NLL_BUCKETS} position buckets)")
            try:
                first[n].perplexity = evals.perplexity_ids(tokenizer, n, 0, seed=seed)
            except ValueError as err:
                raise EvalError(f"length {n} does not fit the perplexity task: {err}") from None
        need = n + first[n].max_new_tokens()
        if need > limit:
            raise EvalError(f"length {n} + {need - n} new tokens exceeds {limit_text}")
    return {}, first


def machine_info(device: torch.device) -> dict:
    """Machine, GPU and package versions of a run."""
    from importlib import metadata

    from minference.config import hardware_string

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "hardware": hardware_string(), "platform": platform.platform(), "cpus": os.cpu_count(), "gpu": gpu,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": version("transformers"), "triton": version("triton"),
                     "minference": version("minference")},
    }


def run_eval(
    model_name: str = "smollm2",
    *,
    model_path: str | os.PathLike | None = None,
    configs: Sequence[str] | None = None,
    lengths: Sequence[int] | None = None,
    tasks: Sequence[str] | None = None,
    samples: int | None = None,
    seed: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    dense_threshold: int | None = None,
    backend: str = "auto",
    coverage: bool = True,
    profile: bool = True,
    allow_mismatch: bool = False,
    force_length: bool = False,
    progress: bool = True,
    loaded: tuple | None = None,
    dense_tail: int = 0,
    checkpoint: Callable[[EvalReport], None] | None = None,
    cuda_graphs: bool = False,
    prefill_chunk: int = 0,
    suite: str = "procedural",
    prompts: str | os.PathLike | None = None,
    guard=None,
    done: EvalReport | None = None,
    batch_decode: bool = False,
) -> EvalReport:
    """Evaluate ``configs`` on ``model_name`` (see the module docstring). ``checkpoint`` is called
    with the report so far after every (length, sample) round (the CLI saves it: a run cut short
    keeps what it measured).

    Args:
        model_name: one of :data:`minference.app.models.MODEL_CHOICES`; ``model_path`` the Qwen GGUF.
        suite: ``"procedural"`` (:mod:`minference.app.evals`, prompts made here from ``seed``) or
            ``"ruler"`` (RULER's 13 tasks from the prompt set folder ``prompts``, made by
            ``minference ruler generate``; :func:`_run_ruler`).
        configs: config specs (default: dense + the bundled config for SmolLM2, dense +
            :data:`DEFAULT_QWEN_PATTERN` for Qwen).
        lengths: prompt lengths in tokens (each at least what every task needs, at most the model's
            context: SmolLM2 8K unless ``force_length``, Qwen 128K with YaRN; default
            :data:`DEFAULT_LENGTHS`); RULER: lengths of the prompt set (default all of them).
        tasks: names from :data:`minference.app.evals.TASKS` and ``PERPLEXITY_TASK`` (default all);
            RULER: its task names (default every task of the set).
        samples: prompts per (task, length) (default :data:`DEFAULT_SAMPLES`; RULER: every sample
            the set holds for each task and length, the same count everywhere).
        seed: the procedural prompts' seed (default 0); RULER prompts carry their own.
        dense_threshold: passed to :func:`minference.patch` (``None``: the dispatcher's default).
            A sparse config at a length whose prompts are shorter runs dense (``dense_short``): a
            note on stderr says so before the model loads, and the table shows its ratios as
            ``dense`` (:data:`DENSE_CELL_NOTE`).
        dense_tail: passed to :func:`minference.patch`: the last prompt tokens of a sparse
            prefill that attend densely (0: none).
        cuda_graphs: sparse configs run their layers through CUDA graphs
            (:class:`minference.graphs.PrefillGraphs`, one cache per config kept across its
            patches and cleared at each new length; captured by the untimed warm-up prefill, so
            the timed prefills replay). Only CUDA tensors on the Triton backend use graphs. The
            profiled split then books index building under attention (a replay has no index
            ranges); :attr:`EvalReport.cuda_graph_stats` counts captures, replays and fallbacks.
            Procedural suite only: RULER's prompts vary in length, more shapes than the cache
            holds, so graphs would be captured inside timed prefills (refused before loading);
            refused before loading too off a CUDA device or with ``backend="torch"`` (graphs never run).
        prefill_chunk: every timed, profiled, answering and perplexity prefill feeds the prompt in
            chunks of this many tokens through the KV cache (chunked prefill, as serving engines
            run it; each later chunk runs the patched model's ``sparse_continue`` path); the TTFT is
            then all chunks' time. Coverage and density stay one-shot measurements of the config.
            0 (default): one call.
        coverage: measure density and coverage; ``profile``: the CUDA split (ignored on the CPU).
        loaded: an already loaded, unpatched ``(model, tokenizer)`` (left unpatched).
        guard: :class:`minference.app.guard_options.GuardOptions` over each config's
            ``runtime.guard``: one quality guard per sparse (config, length), its summary in
            ``RunStats.guard`` (docs/guard.md). ``None``: the configs' own settings.
        done: RULER: a report of an earlier run with the same settings on the same prompt set (a
            call cut by its time bound; checked before the model loads, :func:`_check_continued`):
            only the (config, task, length, sample) prompts it lacks run, and the result (and
            every checkpoint) is that report merged with the new measurements
            (:func:`merge_reports`). A sparse config may not run a prompt whose dense TTFT is in
            that report (its ratio would mix runs): refused before any prompt runs.
        batch_decode: RULER: each prompt's configs prefill one after another (each TTFT its own),
            then decode as one batch from their joined caches (:func:`_ruler_rounds`): the decode's
            host time (most of a RULER run's time on a GPU) is paid once per prompt, not once per
            config. Recorded in the settings; refused for the procedural suite, and right after
            loading for a model whose cache layers cannot be joined (sliding-window layers).

    Raises:
        EvalError: unknown task, config or model; lengths, samples or seeds out of range;
            ``cuda_graphs`` with RULER or off CUDA; ``done`` of another model, prompt set or
            settings (all before the model loads); a config file that does not read or validate,
            or was made for another model (by its shape before loading, by the weights
            fingerprint right after loading, before any prompt), one line naming the file.
    """
    from tqdm.auto import tqdm

    import minference.integration as integ
    from minference.app import evals
    from minference.app.main_job import DEFAULT_CONFIG
    from minference.app.models import (
        MODEL_CHOICES,
        canonical_model,
        load_model,
        load_tokenizer,
        native_context,
        set_context_length,
    )
    from minference.config import model_signature

    t_start = time.perf_counter()
    if model_name not in MODEL_CHOICES:
        raise EvalError(f"unknown model {model_name!r}; choose from {', '.join(MODEL_CHOICES)}")
    model_name = canonical_model(model_name)
    if suite not in SUITES:
        raise EvalError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    ruler_set = None
    if suite == "ruler":
        ruler_set, lengths, tasks, samples = _ruler_plan(prompts, lengths, tasks, samples, seed)
    else:
        if done is not None:
            raise EvalError("--continue is for --suite ruler")
        if prompts is not None:
            raise EvalError("--prompts is for --suite ruler (the procedural suite makes its prompts from --seed)")
        lengths = DEFAULT_LENGTHS if lengths is None else lengths
        tasks = _check_tasks(tasks if tasks is not None else tuple(evals.TASKS) + (evals.PERPLEXITY_TASK,))
        samples = DEFAULT_SAMPLES if samples is None else samples
        seed = 0 if seed is None else seed
        _check_int("samples", samples, 1)
        _check_int("seed", seed, 0)
    _check_int("dense_tail", dense_tail, 0)
    _check_int("prefill_chunk", prefill_chunk, 0)
    if not isinstance(cuda_graphs, bool):
        raise EvalError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
    if not isinstance(batch_decode, bool):
        raise EvalError(f"batch_decode must be a bool, got {batch_decode!r}")
    if batch_decode and ruler_set is None:
        raise EvalError("--batch-decode is for --suite ruler (the procedural suite batches its own prompts)")
    if cuda_graphs and ruler_set is not None:
        from minference.graphs import DEFAULT_MAX_SHAPES

        raise EvalError(f"--cuda-graphs is for --suite procedural: RULER's prompts vary in length, more shapes than "
                        f"the graph cache's {DEFAULT_MAX_SHAPES}, so captures would fall inside timed prefills")
    lengths = [_check_int("length", n, 2) for n in lengths]
    if not lengths:
        raise EvalError("no lengths given")
    if len(set(lengths)) != len(lengths):
        raise EvalError(f"lengths repeat: {lengths}")
    if dense_threshold is not None:
        _check_int("dense_threshold", dense_threshold, 0)
    if configs is None:
        configs = [DENSE, str(DEFAULT_CONFIG) if model_name == "smollm2" else DEFAULT_QWEN_PATTERN]
    if ruler_set is not None and not any(_split_spec(c)[1].strip() == DENSE for c in configs):
        raise EvalError("the RULER suite reports every TTFT against dense on the same prompts: add --config dense")
    configs = list(configs)
    if not configs:
        raise EvalError("no configs given")
    # every file config read and validated now (one line naming the file), not after the model loads;
    # whether it fits the model needs the model's signature (resolve_config, right after loading)
    parsed = [check_config_spec(spec) for spec in configs]
    names = [_spec_name(spec) for spec in configs]
    if len(set(names)) != len(names):
        raise EvalError(f"config names repeat: {names}; name them with name=SPEC")
    if loaded is None:  # a config for another model, by the model's known shape (the fingerprint: after loading)
        from minference.app.models import model_shape

        for spec, config in zip(configs, parsed):
            if config is not None:
                _load_file_config(_split_spec(spec)[1].strip(), model_shape(model_name), allow_mismatch=allow_mismatch)
    if loaded is not None:
        dev = next(loaded[0].parameters()).device
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise EvalError(f"unknown device {device!r}: {_one_line(str(err))}") from None
    _check_cuda_graphs(cuda_graphs, dev, backend)
    # what the report records as its settings ("device" once more when the model is loaded: its index)
    settings = {"device": str(dev), "dense_threshold": dense_threshold, "backend": backend, "seed": seed,
                "samples": samples, "coverage": coverage, "profile": profile and dev.type == "cuda",
                "coverage_rows": COVERAGE_ROWS, "nll_chunk": NLL_CHUNK, "nll_buckets": NLL_BUCKETS,
                "allow_mismatch": allow_mismatch, "force_length": force_length, "dense_tail": dense_tail,
                "cuda_graphs": cuda_graphs, "prefill_chunk": prefill_chunk, "suite": suite,
                **({"ruler": _ruler_settings(ruler_set)} if ruler_set is not None else {})}
    # the command line's guard overrides: a run with them neither continues nor merges one without
    # (absent: no overrides, or a report written before the key)
    if guard is not None and guard.settings:
        settings["guard"] = dict(guard.settings)
    if batch_decode:  # absent: each config decodes alone (every report written before the key)
        settings["batch_decode"] = True
    if done is not None:
        _check_continued(done, model_name, settings, configs)

    # Every check that needs only the tokenizer runs before the model loads: the tokenizer takes
    # about a second once converted, the weights 5 s (SmolLM2) to a minute (the 1.5B on a GPU).
    tokenizer = loaded[1] if loaded is not None else load_tokenizer(model_name, path=model_path)
    gen_tasks = [t for t in tasks if t != evals.PERPLEXITY_TASK]
    with_ppl = evals.PERPLEXITY_TASK in tasks
    limit, limit_text = _context_limit(model_name, native_context(model_name) if loaded is None else
                                       _native_context(loaded[0]), force_length)
    # Build every task's first prompt of every length now (RULER: read every prompt): a length too
    # short for a task (or too long for the model) fails here, not hours into the run.
    ruler_prompts, first = _first_prompts(ruler_set, tokenizer, lengths, tasks, samples, seed, limit, limit_text,
                                          allow_mismatch)
    note = _dense_short_note(configs, parsed, dense_threshold, ruler_prompts or {n: [n] for n in lengths})
    if note:
        print(f"minference eval: note: {note}", file=sys.stderr)

    model, tokenizer = loaded if loaded is not None else load_model(model_name, path=model_path, device=dev,
                                                                    dtype=dtype)
    if integ.is_patched(model):
        raise EvalError("pass an unpatched model")
    if batch_decode:
        from minference.app.models import check_joinable

        try:
            check_joinable(model)
        except ValueError as err:
            raise EvalError(f"--batch-decode: {err}") from None
    dev = next(model.parameters()).device
    loaded_limit = _context_limit(model_name, _native_context(model), force_length)
    if loaded_limit[0] != limit:
        # a Qwen file given by path with another context than the testbed's: its config decides
        limit, limit_text = loaded_limit
        ruler_prompts, first = _first_prompts(ruler_set, tokenizer, lengths, tasks, samples, seed, limit,
                                              limit_text, allow_mismatch)
    # a file config against the loaded model: its weights fingerprint and rotary settings too
    signature = model_signature(model) if any(c is not None for c in parsed) else None
    resolved = [resolve_config(spec, model, allow_mismatch=allow_mismatch, signature=signature) for spec in configs]
    pattern_configs = {c.name: c.pattern_config() for c in resolved}

    report = EvalReport(
        model={"name": model_name, "path": None if model_path is None else str(model_path),
               "model_id": str(getattr(model.config, "name_or_path", "") or model_name),
               "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
               "native_context": _native_context(model)},
        machine=machine_info(dev),
        settings=dict(settings, device=str(dev)),
        configs=resolved, lengths=lengths, tasks=tasks,
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    eos = _eos_ids(model, tokenizer)
    physical = _triton_backend(backend, dev)
    graphs = {}
    if cuda_graphs:
        from minference.graphs import PrefillGraphs

        graphs = {c.name: PrefillGraphs() for c in resolved if pattern_configs[c.name] is not None}
    guard_opts = guard or guard_options.GuardOptions()
    guards: dict[tuple[str, int], QualityGuard | None] = {}  # one quality guard per sparse (config, length)

    def guard_for(name: str, n: int) -> QualityGuard | None:
        """The quality guard of (config ``name``, length ``n``), made at its first prompt (``None``:
        dense, or the guard is off)."""
        if pattern_configs[name] is not None and (name, n) not in guards:
            guards[(name, n)] = guard_opts.make(pattern_configs[name], f"{name}@{n}")
        return guards.get((name, n))

    def apply(name: str, run_guard: QualityGuard | None) -> None:
        """Patch the model for config ``name`` (dense: unpatched) with its graphs and ``run_guard``."""
        _apply(model, pattern_configs[name], dense_threshold, backend, allow_mismatch, dense_tail, graphs.get(name),
               run_guard or guard_options.OFF)

    skip: set[tuple] = set()  # (config, task, length, index) measured by the continued report
    if done is not None:
        base = merge_reports([done, report], _CONTINUED)  # the same model, machine and configs, or one line now
        skip = {(x.config, x.task, x.n_tokens, x.index) for x in done.records}
        _check_dense_left(base, resolved, ruler_prompts, skip)
        if checkpoint is not None:
            save = checkpoint
            checkpoint = lambda partial: save(merge_reports([done, partial], _CONTINUED))  # noqa: E731
    if ruler_set is not None:  # the prompts still to run: a continued report's are skipped
        left = sum((c, s.task, n, s.index) not in skip for n, ss in ruler_prompts.items() for s in ss for c in names)
    else:
        left = len(lengths) * samples * len(resolved)
    bar = tqdm(total=left, desc="eval", unit="run", disable=not progress)
    compiles = _compile_counter(dev)
    try:
        if ruler_set is not None:
            _ruler_rounds(model, tokenizer, report, resolved, pattern_configs, ruler_prompts, eos, dev, bar,
                          apply=apply, guard_for=guard_for, coverage=coverage, profile=profile, physical=physical,
                          chunk=prefill_chunk, checkpoint=checkpoint, t_start=t_start, skip=skip, compiles=compiles,
                          batch_decode=batch_decode)
        else:
            assert seed is not None  # the procedural suite's seed, 0 by default (set above)
            for n in lengths:
                need = n + first[n].max_new_tokens()
                yarn = set_context_length(model, need)
                for cache in graphs.values():  # one length's shapes at a time
                    cache.clear()
                for index in range(samples):
                    if index == 0:
                        round_prompts = first[n]
                    else:
                        round_prompts = _Round({t: evals.make_sample(t, tokenizer, n, index, samples=samples, seed=seed)
                                                for t in gen_tasks})
                        if with_ppl:
                            round_prompts.perplexity = evals.perplexity_ids(tokenizer, n, index, seed=seed)
                    for cfg in resolved:
                        bar.set_postfix_str(f"{cfg.name} @ {n} tokens, sample {index}")
                        run_guard = guard_for(cfg.name, n)
                        guard_options.set_prompt(run_guard, [f"{t}/{n}/{index}" for t in round_prompts.tasks()])
                        apply(cfg.name, run_guard)
                        stats = report.run(cfg.name, n)
                        if stats is None:
                            stats = RunStats(cfg.name, n, yarn=yarn)
                            report.runs.append(stats)
                            _once_per_length(model, cfg, pattern_configs[cfg.name], round_prompts.first_ids(), stats,
                                             dev, coverage=coverage, profile=profile, physical=physical,
                                             chunk=prefill_chunk)
                        if gen_tasks:
                            # TTFT: one timed single-prompt prefill (the first task's); the answers:
                            # every task's prompt (all n tokens) in one batch, one greedy decode loop
                            guard_options.set_prompt(run_guard, f"{gen_tasks[0]}/{n}/{index}")
                            gen = round_prompts.samples
                            _take(compiles)  # the warm-ups' compiles are not this prompt's
                            ttft = _prefill(model, gen[gen_tasks[0]].ids.to(dev), prefill_chunk)[0]
                            timed_compiles = _take(compiles)
                            stats.ttft_s.append(ttft)
                            batch = torch.stack([gen[t].ids for t in gen_tasks]).to(dev)
                            guard_options.set_prompt(run_guard, [f"{t}/{n}/{index}" for t in gen_tasks])

                            def settled(b: int, tokens: list[int], p: dict[str, Sample] = gen) -> bool:
                                return _settled(p[gen_tasks[b]], tokens, tokenizer)

                            answers = _generate(model, batch, [gen[t].max_new_tokens for t in gen_tasks], eos,
                                                settled=settled, chunk=prefill_chunk)
                            for task, tokens in zip(gen_tasks, answers):
                                sample = gen[task]
                                text = tokenizer.decode(tokens, skip_special_tokens=True)
                                report.records.append(SampleRecord(
                                    cfg.name, task, n, index, int(sample.seed), sample.depth, list(sample.answers),
                                    bool(evals.score(sample, text)), text, ttft if task == gen_tasks[0] else None,
                                    len(tokens), found=float(evals.score_fraction(sample, text)),
                                    compiles=timed_compiles if task == gen_tasks[0] else []))
                        if round_prompts.perplexity is not None:  # the perplexity task (with_ppl)
                            ids = round_prompts.perplexity.to(dev)
                            guard_options.set_prompt(run_guard, f"{evals.PERPLEXITY_TASK}/{n}/{index}")
                            ttft, timed_compiles = None, []
                            if not gen_tasks:  # nothing else is timed: time this prompt's prefill
                                _take(compiles)
                                ttft = _prefill(model, ids, prefill_chunk)[0]
                                timed_compiles = _take(compiles)
                                stats.ttft_s.append(ttft)
                            nll = sequence_nll(model, ids, prefill_chunk=prefill_chunk)
                            buckets = [float(b) for b in evals.position_buckets(nll, NLL_BUCKETS)]
                            report.records.append(SampleRecord(
                                cfg.name, evals.PERPLEXITY_TASK, n, index, seed, None, [], None, None, ttft,
                                nll=float(nll.mean()), nll_buckets=buckets, compiles=timed_compiles))
                        stats.ttft_median_s = float(statistics.median(stats.ttft_s))
                        bar.update(1)
                    if checkpoint is not None:
                        report.wall_s = time.perf_counter() - t_start
                        checkpoint(report)
    finally:
        bar.close()
        if compiles is not None:
            compiles.close()
        if integ.is_patched(model):
            integ.unpatch(model)
        set_context_length(model, 1)  # the model's own rotary embedding again
        if graphs:
            report.cuda_graph_stats = {name: cache.stats for name, cache in graphs.items()}
            graphs.clear()
        for (name, n), run_guard in guards.items():  # the quality guards' summaries
            stats = report.run(name, n)
            if run_guard is not None and stats is not None:
                stats.guard = run_guard.summary()
                run_guard.close()
    report.wall_s = time.perf_counter() - t_start
    return report if done is None else merge_reports([done, report], _CONTINUED)


def _ruler_plan(prompts, lengths, tasks, samples, seed) -> tuple[PromptSet, list[int], list[str], int]:
    """``(prompt set, lengths, tasks, samples)`` of a RULER run, checked against the set before any
    model is loaded."""
    from minference.app import ruler

    if prompts is None:
        raise EvalError("--suite ruler needs --prompts DIR (a prompt set made by `minference ruler generate`)")
    if seed is not None:
        raise EvalError("RULER prompts carry the seed they were generated with; drop --seed")
    try:
        prompt_set = ruler.load_prompt_set(prompts)
    except (ruler.RulerError, OSError, ValueError) as err:
        raise EvalError(str(err)) from None
    lengths = list(prompt_set.lengths if lengths is None else lengths)
    tasks = list(prompt_set.tasks if tasks is None else tasks)
    if not tasks or not lengths:
        raise EvalError(f"{prompts} holds no prompts")
    if len(set(tasks)) != len(tasks):
        raise EvalError(f"tasks repeat: {tasks}")
    missing = [f"{t} @ {n}" for n in lengths for t in tasks if not prompt_set.available(t, n)]
    if missing:
        raise EvalError(f"{prompts} has no prompts for {', '.join(missing)} (it holds lengths {prompt_set.lengths} "
                        f"and tasks {', '.join(prompt_set.tasks)})")
    have = min(prompt_set.available(t, n) for n in lengths for t in tasks)
    if samples is None:
        samples = have
    _check_int("samples", samples, 1)
    if samples > have:
        raise EvalError(f"{samples} samples asked, but {prompts} holds {have} for some task and length")
    return prompt_set, lengths, tasks, samples


def _ruler_prompts(prompt_set, tokenizer, lengths, tasks, samples, limit, limit_text,
                   allow_mismatch) -> dict[int, list[RulerSample]]:
    """Every RULER prompt per length (task order, then sample order), after checking the
    tokenizer and the model's context."""
    from minference.app import ruler

    try:
        prompt_set.check_tokenizer(tokenizer)
    except ruler.RulerError as err:
        if not allow_mismatch:
            raise EvalError(f"{err} (--allow-mismatch runs it anyway)") from None
    out: dict[int, list[RulerSample]] = {}
    for n in lengths:
        try:
            out[n] = [s for t in tasks for s in prompt_set.samples(t, n, samples)]
        except ruler.RulerError as err:
            raise EvalError(str(err)) from None
        need = max(s.n_tokens + s.max_new_tokens for s in out[n])
        if need > limit:
            raise EvalError(f"RULER length {n}: a prompt plus its new tokens needs {need} tokens, beyond {limit_text}")
    return out


def _check_continued(done: EvalReport, model_name: str, settings: dict, specs: Sequence[str]) -> None:
    """``--continue``'s report, before the model loads: RULER's, of ``model_name``, made on this
    prompt set, with these ``settings`` (all but the device's index, known once the model is
    loaded; then :func:`merge_reports` checks it, the dtype, GPU and what each config runs), and
    each of this run's config ``specs`` whose name the report holds given as it was there
    (:func:`_same_spec`). Raises :class:`EvalError` naming what differs."""
    if done.settings.get("suite") != "ruler":
        raise EvalError("--continue takes a report of --suite ruler")
    if done.model.get("name") != model_name:
        raise EvalError(f"--continue: that report ran the model {done.model.get('name')!r}, this run {model_name!r}")
    theirs = done.settings.get("ruler", {}).get("manifest_sha256")
    ours = settings["ruler"]["manifest_sha256"]
    if theirs != ours:
        raise EvalError(f"--continue: that report ran another prompt set (manifest sha256 {str(theirs)[:12]}…, "
                        f"this set {ours[:12]}…)")
    differ = _settings_conflict(done.settings, settings, skip=("device",)) or _rows_conflict(done.settings, settings)
    if differ:
        raise EvalError(f"--continue: that report ran other settings ({differ}); continue it with its options")
    theirs_by_name = {c.name: c.spec for c in done.configs}
    for spec in specs:
        name = _spec_name(spec)
        known = theirs_by_name.get(name)
        if known is not None and not _same_spec(known, spec):
            raise EvalError(f"--continue: config {name!r} ran as {known!r} in that report, this run gives {spec!r}")


def _check_dense_left(base: EvalReport, resolved: Sequence[EvalConfig], prompts: dict[int, list[RulerSample]],
                      skip: set[tuple]) -> None:
    """``--continue``, before any prompt runs: each prompt a sparse config still has to run, dense
    (``base``'s) runs too in this call, so that the merged report holds no ratio between two runs
    (:func:`_check_dense_in_each`; a config new to the continued report has that report's dense
    prompts to run). Raises :class:`EvalError` naming the config and prompt."""
    dense = next((c.name for c in base.configs if c.dense), None)
    for n, samples in prompts.items():
        for s in samples:
            left = [c for c in resolved if (c.name, s.task, n, s.index) not in skip]
            alone = [c.name for c in left if not c.dense]
            if dense is not None and alone and dense not in {c.name for c in left}:
                raise EvalError(f"--continue: {alone[0]} has {s.task} sample {s.index} at {n} tokens left, which "
                                f"{dense} does not run in this call (it is in the continued report): its ratio "
                                f"against dense would mix two runs (run {alone[0]} in a call of its own)")


#: How :func:`run_eval` names a ``--continue`` report and its own in :func:`merge_reports`'s errors.
_CONTINUED = ("the continued report", "this run")


def _ruler_settings(prompt_set) -> dict:
    m = prompt_set.manifest
    digest = hashlib.sha256((prompt_set.folder / "manifest.json").read_bytes()).hexdigest()
    return {"manifest_sha256": digest, "seed": m["seed"], "template": m["template"], "headroom": m["headroom"],
            "tokenizer": m["tokenizer"]["fingerprint"], "versions": m["versions"],
            "metrics": {t: i["metric"] for t, i in m["tasks"].items()}}


def _ruler_rounds(model, tokenizer, report: EvalReport, resolved, pattern_configs,
                  prompts: dict[int, list[RulerSample]], eos: set[int], dev: torch.device, bar, *,
                  apply: Callable[[str, QualityGuard | None], None],
                  guard_for: Callable[[str, int], QualityGuard | None], coverage: bool, profile: bool,
                  physical: bool, chunk: int, checkpoint, t_start: float,
                  skip: frozenset[tuple] | set[tuple] = frozenset(), compiles=None,
                  batch_decode: bool = False) -> None:
    """The RULER loop: length -> prompt -> config. Each prompt runs once per config: one timed
    prefill (the TTFT of that prompt) and the greedy decode from its cache, up to RULER's
    ``max_new_tokens`` of the task, stopping at EOS or once the score is 1 (:func:`ruler.settled`).
    ``batch_decode``: the prompt's configs first prefill one after another (each timed alone), then
    decode together as one batch (:func:`~minference.app.models.concat_caches`; every config
    decodes dense, the ``dense_decode`` path, and the rows share no padding, so each row's tokens
    are its own decode's up to kernel rounding); each record's ``decode_s`` is the batch's, and
    compiles during that decode are booked on the last config's record. While the later configs
    prefill, the earlier ones' caches stay in memory (one per config; joined, one copy in all).
    The once-per-length prefills (warm-up...) run on the first prompt a config is timed on at a
    length. ``apply(config, guard)`` patches the model with ``guard_for(config, length)``, the
    quality guard of that (config, length). A ``(config, task, length, index)`` in ``skip`` is not
    run (measured by a continued report). ``compiles``: the run's :class:`~minference.compiles.
    CompileCounter` (``None``: none), read around each timed prompt."""
    from minference.app import ruler
    from minference.app.models import set_context_length

    for n, samples in prompts.items():
        yarn = set_context_length(model, max(s.n_tokens + s.max_new_tokens for s in samples))
        for sample in samples:
            ids = sample.ids.to(dev)

            def check(tokens: list[int], s=sample) -> bool:
                return ruler.settled(s.metric, tokenizer.decode(tokens, skip_special_tokens=True), s.answers)

            def record(name, stats, ttft, tokens, decode_s, stop, timed_compiles, s=sample, n=n) -> None:
                stats.ttft_s.append(ttft)
                stats.ttft_median_s = float(statistics.median(stats.ttft_s))
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                value = ruler.score(s.metric, text, s.answers)
                report.records.append(SampleRecord(
                    name, s.task, n, s.index, int(report.settings["ruler"]["seed"]), None,
                    list(s.answers), value >= 1.0, text, ttft, len(tokens), found=value,
                    prompt_tokens=s.n_tokens, decode_s=decode_s, stop=stop, compiles=timed_compiles))
                bar.update(1)

            pending: list[tuple] = []  # batch_decode: (config, stats, TTFT, compiles) of each prefill...
            caches: list = []  # ...its KV cache...
            firsts: list[torch.Tensor] = []  # ...and its first answer token
            for cfg in resolved:
                if (cfg.name, sample.task, n, sample.index) in skip:
                    continue
                bar.set_postfix_str(f"{cfg.name} @ {n}, {sample.task} #{sample.index}")
                run_guard = guard_for(cfg.name, n)
                guard_options.set_prompt(run_guard, f"{sample.task}/{n}/{sample.index}")
                apply(cfg.name, run_guard)
                stats = report.run(cfg.name, n)
                if stats is None:  # this prompt is the first one timed: the warm-up runs it
                    stats = RunStats(cfg.name, n, yarn=yarn)
                    report.runs.append(stats)
                    _once_per_length(model, cfg, pattern_configs[cfg.name], sample.ids, stats, dev,
                                     coverage=coverage, profile=profile, physical=physical, chunk=chunk)
                _take(compiles)  # the warm-ups' compiles are not this prompt's
                if batch_decode:
                    ttft, cache, first = _prefill(model, ids, chunk)
                    pending.append((cfg.name, stats, ttft, _take(compiles)))
                    caches.append(cache)
                    firsts.append(first)
                    del cache
                    continue
                ttft, tokens, decode_s, stop = _answer(model, ids, sample.max_new_tokens, eos, check, chunk)
                record(cfg.name, stats, ttft, tokens, decode_s, stop, _take(compiles))
            if pending:  # batch_decode: the prompt's configs decode as one batch
                start = time.perf_counter()
                joined = concat_caches(caches)  # empties the other caches: one copy in memory
                caches.clear()
                seqs, stops = _decode(model, joined, torch.stack(firsts), [sample.max_new_tokens] * len(pending),
                                      eos, lambda b, tokens: check(tokens))
                synchronize(dev)
                decode_s = time.perf_counter() - start
                del joined
                late = _take(compiles)  # the shared decode's, booked once: on the last config (its patch ran it)
                for k, ((name, stats, ttft, timed), tokens, stop) in enumerate(zip(pending, seqs, stops)):
                    record(name, stats, ttft, tokens, decode_s, stop, timed + (late if k == len(pending) - 1 else []))
            if checkpoint is not None:
                report.wall_s = time.perf_counter() - t_start
                checkpoint(report)


def _check_cuda_graphs(cuda_graphs: bool, device: torch.device, backend: str) -> None:
    """``cuda_graphs`` only where graphs run: a CUDA device and not the torch backend (elsewhere
    every call would run directly, and the report would still say "CUDA graphs"). Raises
    :class:`EvalError` (one line) before anything loads."""
    if not cuda_graphs:
        return
    if device.type != "cuda":
        raise EvalError(f"--cuda-graphs needs a CUDA device (--device cuda), not {str(device)!r}: graphs never run "
                        f"on {device.type}, every call would run directly")
    if backend == "torch":
        raise EvalError("--cuda-graphs replays the Triton kernels' graphs: --backend torch never uses them "
                        "(use --backend auto or triton)")


def _dense_short_note(configs: Sequence[str], parsed: Sequence, dense_threshold: int | None,
                      prompts: dict[int, list]) -> str:
    """The note :func:`run_eval` prints before the model loads when a sparse config will run dense
    under the dense threshold (path ``dense_short``: the prompt's keys are fewer than the threshold,
    every chunk of a chunked prefill included): which configs, at which lengths. ``prompts``: per
    length, its prompts' token counts (procedural: the length) or RULER samples (``n_tokens``).
    ``""``: none does."""
    from minference.dispatch import DENSE_THRESHOLD

    threshold = DENSE_THRESHOLD if dense_threshold is None else dense_threshold
    sparse = [_spec_name(spec) for spec, p in zip(configs, parsed) if _runs_sparse(spec, p)]
    where = []
    for n, items in prompts.items():
        sizes = [x if isinstance(x, int) else x.n_tokens for x in items]
        short = sum(size < threshold for size in sizes)
        if short == len(sizes):
            where.append(str(n))
        elif short:
            where.append(f"{n} ({short} of {len(sizes)} prompts)")
    if not sparse or not where:
        return ""
    return (f"{', '.join(sparse)} will run dense at {', '.join(where)} tokens (path dense_short: prompts shorter "
            f"than the dense threshold {_threshold_text(dense_threshold)} run dense); their TTFT against dense there "
            f"is dense against dense, shown as 'dense' in the table, not a speed-up (--dense-threshold N runs "
            f"prompts of N tokens and more sparse)")


def _triton_backend(backend: str, device: torch.device) -> bool:
    """True when the dispatcher runs the Triton kernels (physical tiles are measurable)."""
    from minference.dispatch import resolve_backend

    return resolve_backend(backend, device) == "triton"


def _apply(model, config, dense_threshold, backend: str, allow_mismatch: bool, dense_tail: int = 0,
           graphs=None, guard=None) -> None:
    import minference.integration as integ

    if integ.is_patched(model):
        integ.unpatch(model)
    if config is not None:
        extra = {} if graphs is None else {"cuda_graphs": graphs}  # the config's PrefillGraphs, kept across patches
        if guard is not None:  # the (config, length)'s quality guard, kept across patches
            extra["guard"] = guard
        integ.patch(model, config, dense_threshold=dense_threshold, backend=backend, allow_mismatch=allow_mismatch,
                    check_fingerprint=False, dense_tail=dense_tail,  # fingerprint checked once by resolve_config
                    **extra)


def warmup_lengths(n: int, device: torch.device) -> list[int]:
    """The prompt lengths a config's untimed warm-up prefills at, for a timed length ``n``.

    On a GPU, Triton specialises integer kernel arguments on divisibility by 16, so a kernel whose
    arguments derive from the prompt length compiles a second variant the first time a prompt of
    the other class arrives: a recompile inside a timed prefill (the 1.5B at 130K, 2026-12-05: one
    17.0 s TTFT against a 2.6 s median). Dense seems to pay a first use too: at 32K on an H100 its
    first prompt of a length divisible by 16 took 840 ms against a 385 ms median (session 26; cause
    not profiled). So the warm-up also prefills the prompt cut to a length of the other class, for
    every config. On the CPU the interpreter compiles nothing: ``[n]``."""
    if device.type != "cuda" or n < 17:
        return [n]
    return [n, n - 1 if n % 16 == 0 else n - n % 16]


def _compile_counter(dev: torch.device):
    """A :class:`~minference.compiles.CompileCounter` for a run on ``dev``: on a GPU (the CPU's
    interpreter compiles nothing), ``None`` elsewhere."""
    if dev.type != "cuda":
        return None
    from minference.compiles import CompileCounter

    return CompileCounter()


def _take(counter) -> list[list]:
    """``counter``'s compiles since the last take, as ``[name, seconds]`` (``[]`` without a counter)."""
    return [] if counter is None else [[name, round(seconds, 4)] for name, seconds in counter.take()]


def _once_per_length(model, cfg: EvalConfig, config, prompt: torch.Tensor, stats: RunStats, dev: torch.device, *,
                     coverage: bool, profile: bool, physical: bool, chunk: int = 0) -> None:
    """Warm-up prefill (untimed; at every :func:`warmup_lengths`), the profiled
    prefill (CUDA), the coverage prefill and, after either on CUDA, one more untimed prefill
    (``settle_s``), on the first prompt ``prompt [n]`` of this (config, length)."""
    import minference.integration as integ

    ids = prompt.to(dev)
    if config is not None:
        integ.reset_counts(model)
    stats.warmup_s = _prefill(model, ids, chunk)[0]
    if config is not None:
        stats.calls = {k: v for k, v in integ.call_counts(model).items() if v}
    for m in warmup_lengths(ids.shape[-1], dev)[1:]:
        _prefill(model, ids[:m], chunk)
    if profile and dev.type == "cuda":
        stats.split = _profiled_split(model, ids, chunk)
    if config is None:
        L = len(integ.attention_modules(model))
        stats.layer_density, stats.layer_coverage, stats.layer_physical = [1.0] * L, [1.0] * L, [1.0] * L
        stats.density = stats.coverage = stats.physical_density = 1.0
    elif coverage:
        _measure_coverage(model, config, ids, stats, physical=physical)
    if dev.type == "cuda" and (profile or (coverage and config is not None)):
        stats.settle_s = _prefill(model, ids, chunk)[0]


# ---------------------------------------------------------------------------------------------
# Table and plot.


def _compile_lines(report: EvalReport) -> list[str]:
    """The markdown's note on Triton compiles inside timed prompts (records' ``compiles``): one line
    per prompt that held any, "none" for a GPU run without; nothing on the CPU (no compiles)."""
    held = [r for r in report.records if r.compiles]
    if not held:
        gpu = str(report.settings.get("device", "")).startswith("cuda")
        return ["", "Kernels compiled inside timed prompts: none"] if gpu else []
    lines = ["", "Kernels compiled inside timed prompts (the prefill, for RULER also its decode):", ""]
    for r in held:
        what = ", ".join(f"`{name}` {seconds:.2f} s" for name, seconds in r.compiles)
        ttft = "" if r.ttft_s is None else f" (TTFT {r.ttft_s * 1000:.1f} ms)"
        lines.append(f"- {r.config} @ {r.n_tokens}, {r.task} #{r.index}{ttft}: {what}")
    return lines


def _threshold_text(value: int | None) -> str:
    if value is None:
        from minference.dispatch import DENSE_THRESHOLD

        return f"{DENSE_THRESHOLD} (dispatcher default)"
    return str(value)


#: The footnote under the table where a sparse config's ratio cells read ``dense`` (:func:`_ran_dense`).
DENSE_CELL_NOTE = ("dense (in vs dense, max vs dense, worst / dense): the config ran no sparse attention at that "
                   "length, every attention call on a dense path (paths: dense_short: prompts shorter than the dense "
                   "threshold run dense); its TTFT there is dense against dense, so no speed-up is claimed.")


def _ran_dense(config: EvalConfig, stats: RunStats) -> bool:
    """True for a sparse config whose counted prefill of a (config, length) ran no sparse path
    (:attr:`RunStats.calls`: e.g. only ``dense_short``, under the dense threshold): its ratios
    against dense compare dense with dense. ``False`` where nothing was counted (dense, or none)."""
    return (not config.dense and bool(stats.calls)
            and not any(stats.calls.get(path) for path in ("sparse", "sparse_continue")))


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def _answered_lines(report: EvalReport, acc: dict, tasks: list[str], dense: str | None) -> list[str]:
    """RULER's fully answered samples per (length, config, task), the count the ship rule compares
    (:func:`minference.app.frontier.ship_choice`), with a sparse config's shortfall against dense's
    count on the same number of samples, or dense's sample count where it differs."""
    from minference.app.frontier import SHIP_SAMPLE_SLACK

    head = ["length", "config", *tasks, "all"]
    lines = ["", "Fully answered samples per task (score 1: every reference found, for qa any; the count the ship "
             f"rule compares, which allows {SHIP_SAMPLE_SLACK} fewer than dense): answered / samples; (-k): k fewer "
             "than dense on as many samples; (dense n=m): dense ran m samples, not comparable", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in report.lengths:
        for c in report.configs:
            row, answered, total = [str(n), c.name], 0, 0
            for t in tasks:
                a = acc.get((c.name, t, n))
                if a is None:
                    row.append("-")
                    continue
                d = None if c.dense or dense is None else acc.get((dense, t, n))
                gap = 0 if d is None or d["total"] != a["total"] else d["correct"] - a["correct"]
                other = "" if d is None or d["total"] == a["total"] else f" (dense n={d['total']})"
                row.append(f"{a['correct']}/{a['total']}" + (f" (-{gap})" if gap > 0 else "") + other)
                answered, total = answered + a["correct"], total + a["total"]
            if total:
                lines.append("| " + " | ".join([*row, f"{answered}/{total}"]) + " |")
    return lines


def format_report(report: EvalReport) -> str:
    """Markdown: accuracy per task and length (with counts; RULER: its score), TTFT median and
    maximum with both against dense in the same run, the split, density and coverage; then TTFT per
    task (RULER), perplexity by position bucket."""
    acc = {(a["config"], a["task"], a["n_tokens"]): a for a in report.accuracy()}
    ppl = {(p["config"], p["n_tokens"]): p for p in report.perplexity()}
    ttft = {(t["config"], t["task"], t["n_tokens"]): t for t in report.ttft_summary()}
    gen_tasks = [t for t in report.tasks if any(k[1] == t for k in acc)]
    dense = next((c.name for c in report.configs if c.dense), None)
    is_ruler = report.settings.get("suite") == "ruler"
    m = report.model
    gpu = report.machine.get("gpu") or report.machine.get("hardware")
    seed = report.settings["ruler"]["seed"] if is_ruler else report.settings["seed"]
    lines = [f"## minference eval: {m['name']} ({m['dtype']}) on {report.settings['device']} ({gpu})", "",
             ("RULER (nvidia-long-context-eval prompts, base template), " if is_ruler else "")
             + f"samples {report.settings['samples']} per task and length, seed {seed}, "
             f"dense threshold {_threshold_text(report.settings['dense_threshold'])}, "
             f"backend {report.settings['backend']}, dense tail {report.settings.get('dense_tail', 0)} tokens"
             + (", CUDA graphs" if report.settings.get("cuda_graphs") else "")
             + (", each prompt's configs decoded as one batch" if report.settings.get("batch_decode") else "")
             + (f", prefill in chunks of {report.settings['prefill_chunk']} tokens"
                if report.settings.get("prefill_chunk") else ""), ""]
    head = ["length", "config"] + gen_tasks + (["avg"] if is_ruler else []) + (["NLL"] if ppl else []) + [
        "TTFT ms", "vs dense", "TTFT max ms", "max vs dense", "worst / dense", "attn ms", "index ms", "other ms",
        "density (log/phys)", "coverage", "paths"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    marked = False  # a sparse config that ran dense somewhere: its ratios read "dense" (footnote below)
    for n in report.lengths:
        base = report.run(dense, n) if dense else None
        for c in report.configs:
            s = report.run(c.name, n)
            if s is None:
                continue
            row = [str(n), c.name]
            scores = []
            complete = True  # every task shown, at the header's sample count: only then an average
            for t in gen_tasks:
                a = acc.get((c.name, t, n))
                if a is None:
                    row.append("-")
                    complete = False
                elif is_ruler:  # RULER's score: the mean per-sample metric, x100
                    scores.append(100 * a["found"])
                    short = a["total"] != report.settings["samples"]  # e.g. a call cut by its time bound
                    complete = complete and not short
                    row.append(f"{scores[-1]:.1f}" + (f" (n={a['total']})" if short else ""))
                else:  # all answers found / samples, and for multi-answer tasks the mean share found
                    part = a.get("found")
                    multi = part is not None and a["correct"] < a["total"] and part > a["correct"] / a["total"]
                    row.append(f"{a['correct']}/{a['total']}" + (f" ({part:.2f})" if multi else ""))
            if is_ruler:
                row.append(f"{statistics.fmean(scores):.1f}" if scores and complete else "-")
            if ppl:
                p = ppl.get((c.name, n))
                row.append("-" if p is None else f"{p['nll']:.3f}")
            med = s.ttft_median_s
            row.append(_fmt(None if med is None else med * 1e3, ".1f"))
            speed = (base.ttft_median_s / med) if base is not None and base.ttft_median_s and med else None
            w = ttft.get((c.name, "all", n))
            as_dense = _ran_dense(c, s) and speed is not None  # dense against dense: no speed-up to claim
            marked = marked or as_dense
            row.append("dense" if as_dense else "-" if speed is None else f"{speed:.2f}x")
            row.append(_fmt(None if w is None else w["ttft_max_ms"], ".1f"))
            row.append("dense" if as_dense else "-" if w is None or w["speedup_max"] is None
                       else f"{w['speedup_max']:.2f}x")
            row.append("dense" if as_dense else "-" if w is None or w["worst_ratio"] is None
                       else f"{w['worst_ratio']:.2f}")
            sp = s.split
            parts = ("attention_ms", "index_ms", "other_ms")
            row += [_fmt(None if sp is None else getattr(sp, f), ".1f") for f in parts]
            row.append(f"{_fmt(s.density)} / {_fmt(s.physical_density)}")
            row.append(_fmt(s.coverage))
            row.append(", ".join(f"{k} {v}" for k, v in s.calls.items()) or ("SDPA" if c.dense else "-"))
            lines.append("| " + " | ".join(row) + " |")
    if marked:
        lines += ["", DENSE_CELL_NOTE]
    cells = ("Task cells: RULER's score, the mean of its per-sample metric x 100 (string_match_all: share of the "
             "references found; string_match_part, qa: any reference found); avg: mean over the tasks shown, "
             "only for a config that ran them all in full; "
             "(n=k): a cell of k samples where the header says otherwise."
             if is_ruler else
             "Task cells: samples with every answer found / samples; in brackets, where higher, the mean "
             "share of answers found (RULER's partial credit for multi-answer tasks).")
    lines += ["", cells,
              "", "TTFT: median of the timed prefills (whole model, synchronised, after the untimed warm-up, "
              "profiled and coverage prefills and, on CUDA, one settling prefill); "
              "TTFT max: the slowest of them; vs dense: dense median / median; max vs dense: dense max / max; "
              "worst / dense: the largest TTFT / dense TTFT of one prompt (> 1: slower than dense there). "
              "attn / index / other: device (CUDA kernel) time of one separate profiled prefill, not a split of the "
              "TTFT (n/a on the CPU: no device timer). density: fraction of causal pairs computed, logical on "
              f"~{COVERAGE_ROWS} sampled rows / physical tile area (n/a: torch backend or A-shape heads). coverage: "
              "dense attention mass captured (mean over layers). paths: attention calls per path in one prefill."]
    if is_ruler:
        head = ["length", "config"] + gen_tasks
        lines += ["", "TTFT per task: median / max ms (dense median / median, dense max / max)", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for n in report.lengths:
            for c in report.configs:
                row = [str(n), c.name]
                for t in gen_tasks:
                    w = ttft.get((c.name, t, n))
                    if w is None:
                        row.append("-")
                        continue
                    cell = f"{w['ttft_median_ms']:.0f} / {w['ttft_max_ms']:.0f}"
                    s = report.run(c.name, n)
                    if not c.dense and w["speedup_median"] is not None:
                        cell += (" (dense)" if s is not None and _ran_dense(c, s)
                                 else f" ({w['speedup_median']:.2f}x, {w['speedup_max']:.2f}x)")
                    row.append(cell)
                if len(row) > 2 and any(x != "-" for x in row[2:]):
                    lines.append("| " + " | ".join(row) + " |")
        lines += _answered_lines(report, acc, gen_tasks, dense)
    lines += _compile_lines(report)
    if ppl:
        buckets = max(len(p["buckets"]) for p in ppl.values())
        head = ["length", "config"] + [f"b{i + 1}" for i in range(buckets)] + ["all"]
        lines += ["", f"Perplexity task: mean next-token NLL per position bucket (b1 = start, b{buckets} = end)", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for (config, n), p in ppl.items():
            lines.append("| " + " | ".join([str(n), config] + [f"{b:.3f}" for b in p["buckets"]]
                                           + [f"{p['nll']:.3f}"]) + " |")
    configs = [f"- {c.name}: {c.spec} ({c.kind}; {c.counts() or 'SDPA'})" for c in report.configs]
    lines += ["", "Configs:"] + configs
    longest = max(report.lengths) if report.lengths else None
    tops = [(r.config, r.split.top) for r in report.runs if r.n_tokens == longest and r.split is not None
            and r.split.top]
    if tops:
        lines += ["", f"Costliest kernels at {longest} tokens (device ms in the profiled prefill, top 3 per part)", ""]
        for config, top in tops:
            for part in ("attention", "index", "other"):
                items = list(top.get(part, {}).items())[:3]
                if items:
                    lines.append(f"- {config} / {part}: " + "; ".join(f"`{n}` {t:.1f}" for n, t in items))
    return "\n".join(lines)


def plot_eval(report: EvalReport, path: str | os.PathLike, *, dpi: int = 110):
    """Accuracy (on the prompts every config ran, :meth:`EvalReport.common_scores`; RULER: the mean
    score) against median TTFT, one colour
    per config and one marker per length; dense drawn as black stars; a whisker from each point
    reaches the maximum TTFT of that (config, length) (the worst case). With the perplexity task, a second panel draws
    the mean next-token NLL against the same TTFT (at a few samples per task the accuracy cannot
    tell configs apart; the NLL can). Returns the matplotlib figure. Needs matplotlib (the ``plot``
    extra)."""
    from minference.app.plots import MATPLOTLIB_HINT

    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as err:
        raise ImportError(f"{MATPLOTLIB_HINT} ({err})") from None
    pooled = {(c, n): v for n in report.lengths for c, v in report.common_scores(n)[0].items()}
    nll = {(p["config"], p["n_tokens"]): p["nll"] for p in report.perplexity()}
    panels = [(pooled, ("RULER score / 100" if report.settings.get("suite") == "ruler" else "accuracy")
               + " on the prompts every config ran", "accuracy")]
    if nll:
        panels.append((nll, "mean next-token NLL (nats, lower is better)", "NLL"))
    markers = "osD^vP<>Xh"
    fig = Figure(figsize=(7.0 * len(panels), 4.6))
    colors = [f"C{i % 10}" for i in range(len(report.configs))]
    for pi, (values, ylabel, what) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), pi + 1)
        for c, color in zip(report.configs, colors):
            xs, ys = [], []
            for li, n in enumerate(report.lengths):
                s = report.run(c.name, n)
                y = values.get((c.name, n))
                if s is None or s.ttft_median_s is None or y is None:
                    continue
                x = s.ttft_median_s * 1e3
                xs.append(x)
                ys.append(y)
                worst = max(s.ttft_s) * 1e3 if s.ttft_s else x  # the worst case: a whisker to the slowest prefill
                if worst > x:
                    ax.plot([x, worst], [y, y], color="black" if c.dense else color, lw=1.0, alpha=0.6, zorder=2)
                    ax.scatter([worst], [y], marker="|", s=80, color="black" if c.dense else color, zorder=2)
                if c.dense:
                    ax.scatter([x], [y], marker="*", s=160, color="black", zorder=3)
                else:
                    ax.scatter([x], [y], marker=markers[li % len(markers)], s=55, color=color, zorder=3)
                ax.annotate(c.name if len(report.lengths) == 1 else (f"{n // 1024}K" if n >= 1024 else str(n)),
                            (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if len(xs) > 1:
                ax.plot(xs, ys, color="black" if c.dense else color, lw=0.8, alpha=0.5, ls="--" if c.dense else "-")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT, median; whisker to the maximum (ms, log scale)")
        ax.set_ylabel(ylabel)
        if what == "accuracy":
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{report.model['name']}: {what} vs time to first token ({report.settings['device']})", fontsize=9)
        handles = [Line2D([], [], marker="*" if c.dense else "o", ls="", color="black" if c.dense else col,
                          label=c.name + (" (dense)" if c.dense and c.name != DENSE else ""))
                   for c, col in zip(report.configs, colors)]
        handles += [Line2D([], [], marker=markers[i % len(markers)], ls="", color="gray", label=f"{n} tokens")
                    for i, n in enumerate(report.lengths)]
        ax.legend(handles=handles, fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return fig


# ---------------------------------------------------------------------------------------------
# CLI.

EVAL_DESCRIPTION = (
    "Task accuracy and time to first token of a real model, sparse configs against dense in the same run. "
    "For every length, sample and config: greedy answers scored by exact match, perplexity by position, TTFT "
    "after a warm-up, the device-time split of one profiled prefill (CUDA only), density and coverage on sampled "
    "rows. Prints a markdown table; --out writes every record as JSON, --plot draws accuracy vs TTFT."
)


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand to ``minference``'s CLI."""
    from minference.app.models import MODEL_CHOICES

    p = subparsers.add_parser("eval", help="accuracy and TTFT of a real model: sparse configs vs dense, same run",
                              description=EVAL_DESCRIPTION)
    p.add_argument("--model", choices=MODEL_CHOICES, default="smollm2",
                   help="which real model (qwen = qwen0.5b)")
    p.add_argument("--model-path", default=None,
                   help="Qwen GGUF file (default: $MINFERENCE_QWEN_GGUF / $MINFERENCE_QWEN15_GGUF or the cache)")
    p.add_argument("--suite", choices=SUITES, default="procedural",
                   help="task source: the procedural suite (prompts made here) or RULER (prompts read from --prompts)")
    p.add_argument("--prompts", dest="prompt_set", default=None, metavar="DIR",
                   help="RULER prompt set made by `minference ruler generate` (with --suite ruler)")
    p.add_argument("--config", dest="configs", action="extend", nargs="+", default=None, metavar="SPEC",
                   help="'dense', a PatternConfig file, or a pattern JSON for every head, optionally 'name=SPEC' "
                        "(repeatable; default: dense + the bundled config, or dense + uniform VS(1000,6096) for qwen)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, metavar="N",
                   help=f"prompt lengths in tokens (default {DEFAULT_LENGTHS[0]}; RULER: the set's lengths)")
    p.add_argument("--tasks", nargs="+", default=None, metavar="T",
                   help="tasks (default: all, perplexity included; RULER: every task of the set)")
    p.add_argument("--samples", type=int, default=None,
                   help=f"prompts per task and length (default: {DEFAULT_SAMPLES}); RULER: every prompt the set holds")
    p.add_argument("--seed", type=int, default=None, help="prompt seed of the procedural suite (default: 0)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--dense-threshold", type=int, default=None,
                   help="prompts shorter than this run dense (default: the dispatcher's)")
    p.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto", help="dispatcher backend")
    p.add_argument("--dense-tail", type=int, default=0, metavar="T",
                   help="the last T prompt tokens of a sparse prefill attend densely (default 0: none)")
    p.add_argument("--prefill-chunk", type=int, default=0, metavar="C",
                   help="feed every prompt in chunks of C tokens through the KV cache (chunked prefill; "
                        "later chunks run sparse on query rows); 0: one call (default)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="sparse layers replay CUDA graphs captured by the warm-up prefill (CUDA, Triton backend, "
                        "procedural suite; docs/integration.md)")
    p.add_argument("--batch-decode", action="store_true",
                   help="RULER: each prompt's configs prefill one by one (each timed alone), then decode as one batch "
                        "(the decode's host time once per prompt, not per config)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("--plot", default=None, help="draw accuracy vs TTFT here (needs matplotlib)")
    p.add_argument("--no-coverage", action="store_true", help="skip density and coverage")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled prefill (CUDA split)")
    p.add_argument("--allow-mismatch", action="store_true", help="use a config made for another model")
    p.add_argument("--force-length", action="store_true", help="lengths beyond SmolLM2's 8K context (YaRN)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--continue", dest="continue_from", default=None, metavar="REPORT",
                   help="RULER: run only the (config, task, length, sample) prompts this report of a cut run "
                        "lacks, same settings; --out and its checkpoints hold the merged report")
    p.add_argument("--merge", nargs="+", default=None, metavar="REPORT",
                   help="run nothing: merge these report JSONs (runs of one model and machine) into --out / --plot")
    guard_options.add_arguments(p)
    p.set_defaults(func=_eval_cmd)


def _eval_cmd(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from minference.app.models import ModelNotAvailable
    from minference.config import ConfigError, ConfigMismatchError

    out = out or sys.stdout
    if args.configs and not args.merge and not args.continue_from and not any(
            _split_spec(spec)[1].strip() == DENSE for spec in args.configs):
        print(f"minference eval: note: no '{DENSE}' among --config: the 'vs dense' columns stay empty and the "
              f"ship rule has no baseline (add --config {DENSE})", file=sys.stderr)
    try:
        if args.merge:
            report = merge_reports([EvalReport.load(p) for p in args.merge], names=args.merge)
        else:
            report = _run_from_args(args)
    except (EvalError, ConfigError, ConfigMismatchError, ModelNotAvailable, OSError, ValueError) as err:
        print(f"minference eval: error: {err}", file=sys.stderr)
        return 2
    return _write_outputs(report, args, out)


def _run_from_args(args: argparse.Namespace) -> EvalReport:
    return run_eval(
        args.model, model_path=args.model_path, configs=args.configs, lengths=args.lengths, tasks=args.tasks,
        samples=args.samples, seed=args.seed, device=args.device, dense_threshold=args.dense_threshold,
        backend=args.backend, coverage=not args.no_coverage, profile=not args.no_profile,
        allow_mismatch=args.allow_mismatch, force_length=args.force_length, progress=not args.no_progress,
        dense_tail=args.dense_tail, cuda_graphs=args.cuda_graphs, prefill_chunk=args.prefill_chunk,
        suite=args.suite, prompts=args.prompt_set, batch_decode=args.batch_decode,
        done=EvalReport.load(args.continue_from) if args.continue_from else None,
        checkpoint=(lambda partial: partial.save(args.out)) if args.out else None,
        guard=guard_options.from_args(args),  # the quality guard (docs/guard.md)
    )


def _write_outputs(report: EvalReport, args: argparse.Namespace, out: TextIO) -> int:
    print(format_report(report), file=out)
    if any(r.guard for r in report.runs):  # the quality guard (docs/guard.md)
        print(guard_options.format_summaries({f"{r.config} @ {r.n_tokens}": r.guard for r in report.runs if r.guard}),
              file=out)
    if args.out:
        report.save(args.out)
        print(f"wrote {args.out}", file=out)
    if args.plot:
        try:
            plot_eval(report, args.plot)
        except ImportError as err:
            print(f"minference eval: error: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}", file=out)
    return 0
