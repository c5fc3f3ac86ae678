"""Per-head NLL sensitivity: how much does switching ONE head to a cheaper pattern cost?

The frontier's error proxy weights every head alike by its missed attention mass (docs/search.md).
On the 0.5B at 130K one head (layer 9, head 8) made an A-shape accounted for +0.025 nats of NLL,
most of a config's damage, although its captured mass (0.897) looked fine: mass does not rank the
heads' damage. This script measures it. For every selected head it runs the BASE config with that
one head switched to PROBE's pattern for it (:func:`layer_ablation.set_head`) and records the NLL
change against BASE on the perplexity prompts of ``minference eval --tasks perplexity``
(:func:`minference.app.evals.perplexity_ids`, same ``--tokens``, ``--samples`` and ``--seed``: the
dense and BASE numbers compare with an eval run's), so the offline allocation can use a measured
per-head damage instead of the proxy:

    python benchmarks/head_sensitivity.py fixtures/configs/qwen2.5-coder-0.5b.json .stage/cfg/q05_ashape.json \\
      --model qwen0.5b --device cuda --tokens 130000 --samples 1 --dense-tail 128 --out .stage/q05_heads.json

BASE and PROBE are PatternConfig files of the same layers and heads; a PROBE of one pattern
everywhere can be BASE with every head replaced:

    python -c "import dataclasses as d; from minference.config import load_config; from minference.patterns \
      import AShape; c = load_config('fixtures/configs/qwen2.5-coder-0.5b.json'); d.replace(c, layers=[[AShape(\
      sink=128, window=16384)] * len(r) for r in c.layers]).save('.stage/cfg/q05_ashape.json')"

A head whose PROBE pattern equals its BASE pattern is skipped (counted). ``--heads
9:8,11:3`` restricts the run to those heads (default all). Patching is eval's (``_apply``): backend
``auto``, ``--dense-threshold``, ``--dense-tail``, the weights fingerprint checked once; the
configs' quality guard is off (the measurement is the patterns' own damage). ``--out`` is
rewritten (atomically) after every config (``"complete": false`` until the last), so a run cut short
keeps the heads it measured, and ``move`` can use those; ``--continue RESULT`` (same settings, BASE
and PROBE) measures only the heads RESULT lacks, keeping its dense and BASE values, so one
measurement can span several device calls.

Cost: one forward per probed head per sample, plus a dense and a BASE forward per sample (all 336
heads of the 0.5B at 130K, one sample: 338 forwards). A head's forward starts at its own layer:
the BASE forward records every layer's input, and moving a head of layer L changes nothing before
L, so layers 0..L-1 are not run again (:func:`from_layer`; about half the layers on average; the
result says ``"layers_skipped": true``; a decoder whose layers take different masks runs whole).
The recorded inputs take layers × tokens × hidden size per prompt of device memory (the 0.5B at
130K: 24 × 130,000 × 896 bf16, 5.6 GB).

NLL on prose does not see every head that matters: on the 0.5B at 128K, configs whose measured NLL
equalled dense's lost RULER's multi-query needles (docs/search.md, session 33). ``--answers DIR``
measures another objective on a RULER prompt set (``minference ruler generate``): the reference
answer appended to each prompt and scored teacher-forced, the value of a prompt being the summed
NLL of the answer's tokens (nats per answer, the log-probability of the whole answer: the ``--answers``
result's deltas are in these units). The target text is a space and the references joined by
", " for RULER's ``string_match_all`` tasks, a space and the first reference for
``string_match_part``; the model's own wording may differ (a numbered list, say), which shifts every
config's value alike. ``--tokens`` is the set's RULER length, ``--tasks`` (default
``niah_multiquery,niah_multikey_2``) its tasks, ``--samples`` the prompts of each task (the set's
own seed chose them: ``--seed`` is refused). Decoding reads the answer densely, after the prompt's
``--dense-tail`` rows: the tail is grown by the longest answer's tokens (recorded as the result's
``dense_tail``), so each prompt keeps its dense rows and its answer is read densely:

    python benchmarks/head_sensitivity.py fixtures/configs/qwen2.5-coder-0.5b.json p_1.json --model qwen0.5b \
      --device cuda --answers .stage/ruler/r128 --tokens 131072 --samples 1 --dense-tail 128 --out answers.json

``move`` turns a result into configs, no model needed: BASE with the measured heads moved to their
PROBE pattern, least damage first, while the sum of the moved heads' deltas (a negative one counted
as 0) stays within each ``--budget`` (nats against BASE, the prediction an NLL run then checks):

    python benchmarks/head_sensitivity.py move fixtures/configs/qwen2.5-coder-0.5b.json .stage/q05_heads.json \
      --budget 0.002 0.005 0.01 --out 'moved_{budget}.json'

``plot RESULT --out F.png`` draws a result (needs matplotlib): the per-head map and the share of the
damage the most damaging heads carry (with 2 or more prompts, the title gives how alike the prompts
rank the heads: :func:`minference.app.frontier.rank_agreement`, Spearman's, of their per-head
deltas, pairs of one task apart from pairs across tasks; the markdown summary too). ``--against
OTHER`` (a result of the same model, say the NLL one for an ``--answers`` one) adds a third panel:
this result's deltas against OTHER's for the heads both measured, with their rank agreement and
the most damaging heads named.

``proxies RESULT --from-measurements M`` sets the error proxies that ``minference search``
allocates on (missed mass; output error where measured) against what the heads measured: for each
head the proxy's change for the same move, their rank agreement, how many of the most damaging
heads the proxy also ranks among its largest changes, and where the five most damaging rank.

With several results (say the NLL one and an ``--answers`` one, measured against the same BASE and
PROBE), each ``--budget`` item gives one budget per result, joined by commas (``0.012,0.5``; in
``{budget}``, by ``_``): only heads every result measured can move, ranked by their largest share
of a budget (each delta, counted at least 0, over its result's budget), and a head moves when every
result's sum stays within its budget (one that does not fit is passed over, and smaller ones after
it may still move).

``--from-measurements M --cost-table T`` (the inputs of ``minference search --from-measurements``)
make ``move`` cost-aware: each head's modelled time saved by its move (the cost model of
docs/search.md at the search's length, BASE's pattern against PROBE's; both must be candidates of
the measurements) divides its share, so the heads that buy the most time per unit of damage move
first; a head whose move saves no modelled time does not move; each config's modelled attention +
index time is printed and recorded. On the 0.5B at 130K this predicts ~10 ms less than the
damage-only order at the same budgets (e.g. budget 0.025: 238.1 against 248.4 ms modelled).

A budget is against BASE and counts a negative change as 0; the ship rule's NLL clause is against
dense. So ``move`` also prints and records, per result, BASE's own change against dense on the
measured prompts and the moved config's if every moved head's change added up with its sign
(:func:`against_dense`): the bound above it and this signed sum below it bracket the NLL runs of
sessions 33–35 (docs/search.md, "The 0.012-budget moved configs").
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_ablation import _with_layers, set_head  # noqa: E402  (this folder's script, not a package)

from minference.app.cli import check_arguments, check_output_file  # noqa: E402
from minference.app.evals import perplexity_ids  # noqa: E402
from minference.app.evaluate import (  # noqa: E402
    _apply,
    _context_limit,
    _load_file_config,
    _one_line,
    _pattern_name,
    sequence_nll,
)
from minference.app.frontier import PROXIES, rank_agreement  # noqa: E402
from minference.app.models import (  # noqa: E402
    MODEL_CHOICES,
    canonical_model,
    check_config_model,
    is_qwen,
    load_model,
    native_context,
    set_context_length,
)
from minference.app.ruler import RulerError, load_prompt_set  # noqa: E402
from minference.config import ConfigError, GuardSettings, data_fingerprint, model_signature  # noqa: E402
from minference.integration import is_patched, unpatch  # noqa: E402
from minference.patterns import pattern_from_dict, pattern_to_dict  # noqa: E402

FORMAT = "minference.head_sensitivity"
VERSION = 1
#: Heads listed in the markdown summary.
TOP = 20
#: What patch runs without a quality guard (a config's own guard would repair what is measured).
GUARD_OFF = GuardSettings(mode="off")
_PAIR = re.compile(r"^(\d+):(\d+)$")
#: The two objectives: mean next-token NLL of prose prompts, summed NLL of RULER reference answers.
OBJECTIVES = ("perplexity", "answers")
#: ``--answers``' tasks unless ``--tasks`` says otherwise: the multi-needle ones NLL does not see.
ANSWER_TASKS = "niah_multiquery,niah_multikey_2"
UNITS = {"perplexity": "nats per token", "answers": "nats per answer"}


class Refused(ValueError):
    """Bad input: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line too
        print(f"head_sensitivity: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_heads(text: str, num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """``(layer, head)`` pairs of ``text`` in layer order: ``"all"`` (every head), or
    ``"L:H,L:H,..."``. Raises ``ValueError`` (one line) for a malformed item, a pair outside
    ``num_layers x num_heads`` or a pair given twice."""
    if text.strip() == "all":
        return [(l, h) for l in range(num_layers) for h in range(num_heads)]
    pairs = []
    for item in text.split(","):
        m = _PAIR.match(item.strip())
        if m is None:
            raise ValueError(f"--heads takes 'all' or layer:head pairs separated by commas (e.g. 9:8,11:3); "
                             f"got {item.strip()!r} in {text!r}")
        l, h = int(m.group(1)), int(m.group(2))
        if l >= num_layers or h >= num_heads:
            raise ValueError(f"--heads {l}:{h}: no such head; the configs have {num_layers} layers of "
                             f"{num_heads} heads")
        if (l, h) in pairs:
            raise ValueError(f"--heads names {l}:{h} twice")
        pairs.append((l, h))
    return sorted(pairs)


def _not_an_input(out: str, *inputs: str) -> None:
    """Refuse (one line) an output path that is one of ``inputs``."""
    if any(Path(out).resolve() == Path(p).resolve() for p in inputs):
        raise Refused(f"--out {out} would overwrite an input")


def answer_text(metric: str, answers) -> str:
    """The teacher-forced target of a RULER prompt (``--answers``): a space and the references
    joined by ", " for ``string_match_all`` (every reference counts), a space and the first one for
    ``string_match_part`` (any one counts)."""
    if metric == "string_match_all":
        return " " + ", ".join(answers)
    if metric == "string_match_part":
        return " " + answers[0]
    raise ValueError(f"no answer target for RULER metric {metric!r}")


def _check_answers(args: argparse.Namespace):
    """``--answers``' prompt set, tasks and samples (ids read and checked), before the model loads:
    ``(PromptSet, tasks, samples)``, or ``None`` without ``--answers``; raises :class:`Refused`
    (one line)."""
    if args.answers is None:
        if args.tasks is not None:
            raise Refused("--tasks chooses --answers' RULER tasks: give --answers DIR too")
        return None
    try:
        prompt_set = load_prompt_set(args.answers)
    except (RulerError, OSError, ValueError) as err:
        raise Refused(f"--answers: {err}") from None
    if args.tokens not in prompt_set.lengths:
        raise Refused(f"--tokens {args.tokens}: {args.answers} has RULER lengths {prompt_set.lengths}")
    tasks = [t.strip() for t in (args.tasks or ANSWER_TASKS).split(",")]
    for task in tasks:
        have = prompt_set.available(task, args.tokens)
        if not have:
            raise Refused(f"--tasks {task}: {args.answers} has no prompts of it at {args.tokens} (tasks there: "
                          f"{', '.join(t for t in prompt_set.tasks if prompt_set.available(t, args.tokens))})")
        if have < args.samples:
            raise Refused(f"--samples {args.samples}: {args.answers} has {have} prompts of {task} at {args.tokens}")
    if len(set(tasks)) != len(tasks):
        raise Refused(f"--tasks names a task twice: {args.tasks}")
    if args.seed is not None:
        raise Refused(f"--seed chooses the perplexity prompts; --answers' prompts are {args.answers}'s (seed "
                      f"{prompt_set.manifest.get('seed')})")
    try:  # the ids are read and checked (sha256, sizes) here, before the model loads
        samples = [x for task in tasks for x in prompt_set.samples(task, args.tokens, args.samples)]
    except (RulerError, OSError, ValueError) as err:
        raise Refused(f"--answers: {err}") from None
    return prompt_set, tasks, samples


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Everything checkable before the model loads: ``(model name, device, base, probe, probed
    heads, skipped count, answers)`` (``answers``: :func:`_check_answers`); raises
    :class:`Refused` / ``ValueError`` (one line). The options the ``minference`` commands share
    (``--tokens``, ``--seed``, ``--device``, ``--out``, ...) get their checks
    (:func:`minference.app.cli.check_arguments`)."""
    check_arguments(parser, args)
    if args.samples < 1:
        raise Refused(f"argument --samples: must be >= 1, got {args.samples}")
    name = canonical_model(args.model)
    if args.model_path is not None and not is_qwen(name):
        raise Refused(f"--model-path is for the qwen models; {name} loads from its package")
    limit, limit_text = _context_limit(name, native_context(name), False)
    if args.tokens > limit:
        raise Refused(f"--tokens {args.tokens} exceeds {limit_text}")
    device = torch.device(args.device)
    base, probe = _load_file_config(args.base), _load_file_config(args.probe)  # one line naming the file
    shape = lambda c: [len(row) for row in c.layers]  # noqa: E731
    if shape(base) != shape(probe):
        raise Refused(f"BASE {args.base} has {len(base.layers)} layers of {sorted(set(shape(base)))} heads, PROBE "
                      f"{args.probe} {len(probe.layers)} layers of {sorted(set(shape(probe)))}: they must match")
    try:
        check_config_model(base, name, hint=None)
    except ValueError as err:
        raise Refused(f"BASE {args.base} {err}") from None
    _not_an_input(args.out, args.base, args.probe)
    heads = parse_heads(args.heads, len(base.layers), max(shape(base)))
    probed = [(l, h) for l, h in heads if probe.layers[l][h] != base.layers[l][h]]
    return name, device, base, probe, probed, len(heads) - len(probed), _check_answers(args)


def skip_ahead_works(decoder) -> bool:
    """Whether a forward can start at a later layer (:func:`from_layer`): the decoder has its
    ``embed_tokens`` and ``layers``, and every layer takes the same mask (the decoder picks each
    layer's mask by its position in ``layers``, which starting later would shift)."""
    types = getattr(getattr(decoder, "config", None), "layer_types", None)
    return (isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList) and hasattr(decoder, "embed_tokens")
            and (types is None or len(set(types)) <= 1))


@contextlib.contextmanager
def record_layer_inputs(decoder, store: list):
    """Append each decoder layer's input hidden state to ``store`` (in layer order) during the
    forwards inside."""
    def keep(module, args, kwargs):
        store.append(args[0] if args else kwargs["hidden_states"])

    handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in decoder.layers]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


class _Given(torch.nn.Module):
    """Stands in for the embedding: the given hidden state, whatever the ids."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, ids):
        return self.hidden


@contextlib.contextmanager
def from_layer(decoder, first: int, hidden: torch.Tensor):
    """The decoder's forwards inside run layers ``first..`` only, from ``hidden`` (that layer's
    input, recorded by :func:`record_layer_inputs` under a config equal to this one below
    ``first``: the result is the full forward's). Moving a head of layer ``first`` changes nothing
    before it, so this saves the work of the earlier layers (half a forward, on average)."""
    embed, layers = decoder.embed_tokens, decoder.layers
    decoder.embed_tokens, decoder.layers = _Given(hidden), torch.nn.ModuleList(list(layers)[first:])
    try:
        yield
    finally:
        decoder.embed_tokens, decoder.layers = embed, layers


def layout_sha256(config) -> str:
    """A fingerprint of a config's patterns, every head (``--continue`` compares BASE's)."""
    layers = [[pattern_to_dict(p) for p in row] for row in config.layers]
    return hashlib.sha256(json.dumps(layers, sort_keys=True).encode()).hexdigest()


def _check_continue(args: argparse.Namespace, name: str, base, probe, answers) -> dict:
    """The ``--continue`` result, refused (one line) unless it was measured with the same model,
    objective, length, dense settings, BASE (every head's pattern), PROBE (each kept head's) and,
    with ``--answers``, the same prompt ids (the perplexity prompts' ids are compared once the
    tokenizer has made them)."""
    previous = read_result(args.continue_from)
    for key in ("base_layout_sha256", "prompt_sha256", "dense_tail"):
        if key not in previous:
            raise Refused(f"--continue {args.continue_from} has no {key}: it was written before --continue could check "
                          "it; measure again")
    seed = (0 if args.seed is None else args.seed) if answers is None else answers[0].manifest.get("seed")
    tail = previous.get("dense_tail_option", previous["dense_tail"])
    want = {"model": name, "objective": "perplexity" if answers is None else "answers", "tokens": args.tokens,
            "samples": args.samples, "seed": seed, "dense_threshold": args.dense_threshold,
            "tasks": None if answers is None else answers[1], "dense tail": args.dense_tail}
    have = {**{k: previous.get(k) for k in want}, "objective": objective_of(previous),
            "tasks": (previous.get("answers") or {}).get("tasks"), "dense tail": tail}
    differ = [f"{k} {have[k]!r} there, {want[k]!r} here" for k in want if have[k] != want[k]]
    if differ:
        raise Refused(f"--continue {args.continue_from} was measured with other settings: {'; '.join(differ)}")
    if previous["base_layout_sha256"] != layout_sha256(base):
        raise Refused(f"--continue {args.continue_from} was measured against another BASE (its patterns differ)")
    if answers is not None and previous["prompt_sha256"] != [data_fingerprint([x.ids.tolist()]) for x in answers[2]]:
        raise Refused(f"--continue {args.continue_from} was measured on other prompts than {args.answers}'s")
    for e in previous["heads"]:
        l, h = e["layer"], e["head"]
        if e["base"] != pattern_to_dict(base.layers[l][h]) or e["probe"] != pattern_to_dict(probe.layers[l][h]):
            raise Refused(f"--continue {args.continue_from}: layer {l}, head {h} was measured with another BASE or "
                          f"PROBE pattern")
    return previous


def summary(result: dict) -> str:
    """The markdown summary of a result: dense and BASE NLL, the :data:`TOP` largest deltas, the sum,
    and with 2 or more prompts how alike they rank the heads (:func:`agreement_text`)."""
    dense, base = _mean_nlls(result)
    heads = result["heads"]
    objective = objective_of(result)
    what = (f"{result['tokens']} tokens, {result['samples']} sample(s) (seed {result['seed']})"
            if objective == "perplexity" else
            f"RULER answers at {result['tokens']}: {', '.join(result.get('prompts', []))} "
            f"({result['answers']['prompts']})")
    lines = [f"## Head sensitivity: {result['model']}, {what}", "",
             f"objective {objective}: NLL in {UNITS[objective]}, mean over the prompts", "",
             f"BASE {result['base']['path']}, PROBE {result['probe']['path']}; dense threshold "
             f"{result['dense_threshold']}, dense tail {result['dense_tail']}", "",
             f"dense NLL {dense:.4f}, BASE NLL {base:.4f} ({base - dense:+.4f}); {len(heads)} heads probed, "
             f"{result['skipped']} skipped (PROBE = BASE)", "",
             "| rank | layer | head | BASE | PROBE | ΔNLL |", "|---|---|---|---|---|---|"]
    top = sorted(heads, key=lambda e: e["delta"], reverse=True)[:TOP]
    for rank, e in enumerate(top, 1):
        names = [_pattern_name(pattern_from_dict(e[k])) for k in ("base", "probe")]
        names = ["dense" if n == "dense-pattern" else n for n in names]
        lines.append(f"| {rank} | {e['layer']} | {e['head']} | {names[0]} | {names[1]} | {e['delta']:+.4f} |")
    lines += ["", f"sum of all {len(heads)} deltas: {sum(e['delta'] for e in heads):+.4f} {UNITS[objective]}"]
    agreement = agreement_text(result)
    if agreement is not None:
        agree, advice = _agree(result), ""
        if agree is False:
            advice = (f"; below {AGREEMENT} within a task the per-head ranking is mostly one prompt's noise: measure "
                      "more prompts")
        elif agree is None and not _has_task_pairs(result):  # (None with such pairs: undefined, said above)
            advice = ("; with one prompt per task the noise cannot be told from heads that one task needs and "
                      "another does not: measure two prompts of a task")
        lines += ["", f"between-prompt rank agreement (Spearman) of the per-head deltas: {agreement}{advice}"]
    return "\n".join(lines)


def _mean_nlls(result: dict) -> tuple[float, float]:
    """Dense's and BASE's NLL of a result, means over its prompts."""
    return (sum(result["dense_nll"]) / len(result["dense_nll"]), sum(result["base_nll"]) / len(result["base_nll"]))


def objective_of(result: dict) -> str:
    """A result's objective; one written before ``--answers`` existed has none: perplexity."""
    return result.get("objective", "perplexity")


def prompt_agreement(result: dict) -> list[tuple[int, int, float]]:
    """How alike a result's prompts rank the heads: ``(i, j, value)`` for each pair of prompts
    ``i < j``, the value the :func:`rank_agreement` of their per-head deltas (``per_prompt``) over
    the heads measured on every prompt; empty for a result of fewer than 2 prompts."""
    n = _prompt_count(result)
    rows = [e["per_prompt"] for e in result["heads"] if len(e.get("per_prompt") or []) == n]
    return [(i, j, rank_agreement([p[i] for p in rows], [p[j] for p in rows]))
            for i in range(n) for j in range(i + 1, n)]


def _prompt_count(result: dict) -> int:
    """The prompts a result measured its heads on (the longest ``per_prompt``; 0 without heads)."""
    return max((len(e.get("per_prompt") or []) for e in result["heads"]), default=0)


#: Rank agreement between two prompts of one task below which the summary and ``move`` say the
#: per-head ranking is mostly one prompt's noise (a rule of thumb, not a test).
AGREEMENT = 0.5


def _same_task(result: dict, i: int, j: int) -> bool:
    """Whether prompts ``i`` and ``j`` are of one task (labels ``task#k``; perplexity prompts, or
    a result without labels: one task)."""
    labels = result.get("prompts") or []
    if len(labels) <= max(i, j):
        return True
    return labels[i].split("#", 1)[0] == labels[j].split("#", 1)[0]


def _has_task_pairs(result: dict) -> bool:
    """Whether a result has two prompts of one task (a pair :func:`_agree` can judge by)."""
    n = _prompt_count(result)
    return any(_same_task(result, i, j) for i in range(n) for j in range(i + 1, n))


def _agree(result: dict) -> bool | None:
    """Whether the pairs of prompts of one task rank the heads alike (each defined pair's agreement
    at least :data:`AGREEMENT`); ``None`` when no such pair is defined (one prompt per task, fewer
    than 3 heads, a prompt's deltas all equal): nothing to judge the noise by. Prompts of different
    tasks may rank heads differently because the tasks need different heads, so they do not count."""
    values = [v for i, j, v in prompt_agreement(result) if _same_task(result, i, j) and not math.isnan(v)]
    return None if not values else all(v >= AGREEMENT for v in values)


def agreement_text(result: dict) -> str | None:
    """:func:`prompt_agreement` in words, pairs of one task and pairs across tasks apart: for one
    pair its value, for more the mean over the pairs and the least pair; ``None`` for a result of
    fewer than 2 prompts."""
    pairs = prompt_agreement(result)
    if not pairs:
        return None
    labels = result.get("prompts") or []
    n = pairs[-1][1] + 1
    label = lambda i: labels[i] if len(labels) == n else f"prompt {i}"  # noqa: E731
    parts = []
    for same, name in ((True, "one task"), (False, "across tasks")):
        group = [(i, j, v) for i, j, v in pairs if _same_task(result, i, j) is same]
        defined = [(i, j, v) for i, j, v in group if not math.isnan(v)]
        if not group:
            continue
        if not defined:
            parts.append(f"{name}: undefined (fewer than 3 heads, or one prompt's deltas all equal)")
            continue
        i, j, least = min(defined, key=lambda p: p[2])
        undefined = "" if len(defined) == len(group) else f" ({len(group) - len(defined)} undefined)"
        if len(group) == 1:
            parts.append(f"{name}: {least:+.2f} ({label(i)} vs {label(j)})")
        else:
            mean = sum(v for _, _, v in defined) / len(defined)
            parts.append(f"{name}: mean {mean:+.2f} over {len(group)} pairs{undefined}, least {least:+.2f} "
                         f"({label(i)} vs {label(j)})")
    return "; ".join(parts)


def read_result(path: str | Path) -> dict:
    """A result JSON of this script; ``ValueError`` (one line) for anything else."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from None
    if not isinstance(result, dict) or result.get("format") != FORMAT or result.get("version") != VERSION:
        raise ValueError(f"{path} is not a {FORMAT} v{VERSION} result")
    if objective_of(result) not in OBJECTIVES:
        raise ValueError(f"{path} has an unknown objective {result['objective']!r} (known: {', '.join(OBJECTIVES)})")
    for i, e in enumerate(result.get("heads", [])):
        missing = {"layer", "head", "base", "probe", "delta"} - set(e)
        if missing:
            raise ValueError(f"{path}: heads[{i}] lacks {', '.join(sorted(missing))}")
        if not isinstance(e["delta"], (int, float)) or not math.isfinite(e["delta"]):
            raise ValueError(f"{path}: layer {e['layer']}, head {e['head']} has a non-finite NLL change "
                             f"({e['delta']}): measure it again")
    return result


def _share(delta: float, budget: float) -> float:
    """A head's share of one result's budget: its delta counted at least 0, over the budget."""
    cost = max(delta, 0.0)
    if cost == 0.0:
        return 0.0
    return math.inf if budget == 0 else cost / budget


def modelled_savings(base, results: Sequence[dict], measurements: str, cost_table: str):
    """``({(layer, head): ms saved}, BASE's ms)``: the modelled attention + index time (the cost
    table's model at the measurements' length, :func:`minference.app.frontier.head_options`) that
    moving each head the results measured from BASE's pattern to PROBE's saves, and BASE's whole
    modelled time. ``ValueError`` (one line) when the measurements are of another shape or lack a
    pattern as a candidate."""
    from minference.app.frontier import CostModel, _rule_choice, head_options
    from minference.app.search import SearchResult

    options = head_options(SearchResult.load(measurements), CostModel.load(cost_table))
    if options.unit != "ms":
        raise ValueError(f"{cost_table} is not a calibrated cost table (unit {options.unit!r}, not ms)")
    shape = [len(row) for row in base.layers]
    if list(options.cost.shape[:2]) != [len(shape), max(shape)]:
        raise ValueError(f"{measurements} has {options.cost.shape[0]} layers of {options.cost.shape[1]} heads, BASE "
                         f"{len(shape)} of {max(shape)}")

    def column(pattern, l: int, h: int, what: str) -> int:
        if pattern not in options.candidates:
            raise ValueError(f"layer {l}, head {h}: {what}'s pattern {_pattern_name(pattern)} is not a candidate of "
                             f"{measurements}: no modelled cost")
        return options.candidates.index(pattern)

    for l, row in enumerate(base.layers):  # one line naming the head, before _rule_choice's bare lookup
        for h, pattern in enumerate(row):
            column(pattern, l, h, "BASE")
    choice = _rule_choice(options, base)
    base_ms = options.totals(choice)[0]  # the cost minference search predicts for BASE
    saved = {}
    for result in results:
        for e in result["heads"]:
            l, h = e["layer"], e["head"]
            probe = column(pattern_from_dict(e["probe"]), l, h, "PROBE")
            saved[(l, h)] = float(options.cost[l, h, choice[l, h]] - options.cost[l, h, probe])
    return saved, base_ms


def move_heads(base, results: Sequence[dict], budgets: Sequence[float], saved: dict | None = None):
    """``(config, moved heads, predicted deltas)``: ``base`` with heads moved to their PROBE
    pattern, one budget per result (``budgets[i]`` bounds the sum of ``results[i]``'s deltas of
    the moved heads, each counted at least 0; the predicted deltas are those sums). Only heads
    every result measured can move; they are taken in order of their largest share of a budget
    (least first) and move when every sum stays within its budget. With one result that is its
    heads in order of delta until the next would pass the budget. With ``saved`` (modelled ms a
    head's move saves, :func:`modelled_savings`) the share is divided by it (most time per unit of
    damage first) and a head that saves nothing stays. Raises ``ValueError`` (one line)
    when a result was measured against another BASE (a head's recorded BASE pattern differs), two
    results probe a head with different patterns, or a budget is negative or not finite."""
    if len(results) != len(budgets) or not results:
        raise ValueError(f"one budget per result: {len(results)} result(s), {len(budgets)} budget(s)")
    for budget in budgets:
        if not 0 <= budget < math.inf:
            raise ValueError(f"--budget must be finite and >= 0, got {budget}")
    shape = [len(row) for row in base.layers]
    measured: list[dict[tuple[int, int], dict]] = []
    for i, result in enumerate(results):
        which = "the result" if len(results) == 1 else f"result {i + 1} (of {len(results)})"
        entries = {}
        for e in result["heads"]:
            l, h = e["layer"], e["head"]
            if not (0 <= l < len(shape) and 0 <= h < shape[l]):
                raise ValueError(f"{which} has layer {l}, head {h}; BASE has {len(shape)} layers of "
                                 f"{max(shape)} heads")
            if e["base"] != pattern_to_dict(base.layers[l][h]):
                here = json.dumps(pattern_to_dict(base.layers[l][h]))
                raise ValueError(f"{which} was measured against another BASE: layer {l}, head {h} is "
                                 f"{json.dumps(e['base'])} there, {here} here")
            entries[(l, h)] = e
        measured.append(entries)
    common = sorted(set.intersection(*(set(m) for m in measured)))
    for l, h in common:
        if any(m[(l, h)]["probe"] != measured[0][(l, h)]["probe"] for m in measured[1:]):
            raise ValueError(f"the results probe layer {l}, head {h} with different patterns: measure them "
                             f"against the same PROBE")
    only_some = len(set.union(*(set(m) for m in measured))) - len(common)

    def rank(lh):
        share = max(_share(m[lh]["delta"], b) for m, b in zip(measured, budgets))
        if saved is None:
            return (share, tuple(m[lh]["delta"] for m in measured), lh)
        return (share / saved[lh] if share else 0.0, -saved[lh], lh)

    movable = common if saved is None else [lh for lh in common if saved[lh] > 0]
    layers = [list(row) for row in base.layers]
    moved, totals = [], [0.0] * len(results)
    for lh in sorted(movable, key=rank):
        after = [t + max(m[lh]["delta"], 0.0) for t, m in zip(totals, measured)]
        if any(t > b + 1e-12 for t, b in zip(after, budgets)):  # a sum of decimal deltas equal to a budget fits
            continue
        layers[lh[0]][lh[1]] = pattern_from_dict(measured[0][lh]["probe"])
        moved.append(lh)
        totals = after
    objectives = [objective_of(r) for r in results]
    parts = [f"{o} ({r['model']}, {r['tokens']} tokens, "
             + (f"{r['samples']} sample(s), seed {r['seed']}" if o == "perplexity" else ", ".join(r.get("prompts", [])))
             + f"; PROBE {r['probe']['path']}): budget {b:g}, predicted {t:+.4f} {UNITS[o]}"
             for r, o, b, t in zip(results, objectives, budgets, totals)]
    order = "least share of a budget first" if saved is None else (
        f"least share of a budget per modelled ms saved first ({len(common) - len(movable)} heads save none and "
        f"stay; {sum(saved[lh] for lh in moved):.1f} ms saved in all)")
    note = (f"head moves: {len(moved)} of the {len(common)} heads measured by {FORMAT} moved to PROBE's pattern, "
            f"{order}, each sum of the moved heads' changes (each at least 0) within its budget; predicted change "
            f"against BASE: {'; '.join(parts)}"
            + (f"; {only_some} heads measured by only some of the results stay" if only_some else ""))
    return _with_layers(base, layers, note), sorted(moved), totals


def against_dense(result: dict, moved: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """``(BASE, moved)``: on the result's own prompts, BASE's NLL change against dense, and the
    moved config's if the moved heads' changes added up with their signs (negative ones
    included, unlike the budget). The ship rule's NLL clause is against dense; in sessions 33–35 the
    measured change on held-out prompts came out 0.002–0.016 nats above this signed sum (the
    negative changes arrive only in part) and below the budget's bound."""
    dense, base = _mean_nlls(result)
    deltas = {(e["layer"], e["head"]): e["delta"] for e in result["heads"]}
    return base - dense, base - dense + sum(deltas[lh] for lh in moved)


def parse_budget(text: str, n_results: int) -> tuple[float, ...]:
    """One ``--budget`` item: ``n_results`` numbers joined by commas; ``ValueError`` (one line)."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--budget takes numbers (one per result, joined by commas), got {text!r}") from None
    if len(values) != n_results:
        raise ValueError(f"--budget {text}: {len(values)} number(s) for {n_results} result(s); give one per result, "
                         "joined by commas")
    return values


def move_main(argv: list[str]) -> int:
    parser = _Parser(prog="head_sensitivity.py move", description="configs from results: the least damaging "
                     "heads moved to their PROBE pattern within each budget")
    parser.add_argument("base", metavar="BASE", help="the BASE config the results were measured against")
    parser.add_argument("results", metavar="RESULT", nargs="+", help="this script's result JSON(s)")
    parser.add_argument("--budget", nargs="+", required=True,
                        help="sums of the moved heads' measured changes, one config each; with several results "
                             "one number per result joined by commas (e.g. 0.012,0.5)")
    parser.add_argument("--out", required=True, help="output path; '{budget}' is replaced by each budget")
    parser.add_argument("--from-measurements", default=None, metavar="FILE",
                        help="a search's saved measurements: rank heads by damage per modelled ms saved (with "
                             "--cost-table)")
    parser.add_argument("--cost-table", default=None, metavar="FILE", help="the GPU cost table for the modelled time")
    args = parser.parse_args(argv)
    try:
        if (args.from_measurements is None) != (args.cost_table is None):
            raise ValueError("--from-measurements and --cost-table go together (the modelled time needs both)")
        budgets = [parse_budget(b, len(args.results)) for b in args.budget]
        labels = ["_".join(f"{x:g}" for x in b) for b in budgets]
        if len(budgets) > 1 and "{budget}" not in args.out:
            raise ValueError(f"--out must contain '{{budget}}' for {len(budgets)} budgets, got {args.out!r}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"--budget gives one budget twice ({', '.join(args.budget)}): one file would overwrite "
                             "the other")
        inputs = [p for p in (args.base, *args.results, args.from_measurements, args.cost_table) if p is not None]
        for label in labels:
            path = check_output_file(args.out.replace("{budget}", label))  # the CLI's check of a file to write
            _not_an_input(path, *inputs)
        base, results = _load_file_config(args.base), [read_result(r) for r in args.results]
        models = sorted({r["model"] for r in results})
        if len(models) > 1:
            raise ValueError(f"the results were measured on different models ({', '.join(models)})")
        saved, base_ms = (None, 0.0) if args.cost_table is None else modelled_savings(
            base, results, args.from_measurements, args.cost_table)
        configs = [move_heads(base, results, b, saved) for b in budgets]
    except (ConfigError, OSError, ValueError) as err:
        print(f"head_sensitivity: {_one_line(str(err))}", file=sys.stderr)
        return 2
    incomplete = [(path, r) for path, r in zip(args.results, results) if not r.get("complete", False)]
    for path, r in incomplete:
        print(f"head_sensitivity: note: {path} is incomplete ({len(r['heads'])} heads measured): only those can "
              "move", file=sys.stderr)
    if incomplete:
        why = "; ".join(f"{path} was incomplete: {len(r['heads'])} heads measured" for path, r in incomplete)
        configs = [(_with_layers(c, c.layers, why), m, t) for c, m, t in configs]
    noisy = []  # (path, agreement) of the results whose prompts of one task disagree
    for path, r in zip(args.results, results):
        text = agreement_text(r)
        agree = None if text is None else _agree(r)
        if agree is False:
            noisy.append((path, text))
            print(f"head_sensitivity: note: {path}'s prompts rank the heads differently (rank agreement {text}; "
                  f"below {AGREEMENT} within a task): its ranking is mostly one prompt's noise; measure more prompts",
                  file=sys.stderr)
        elif text is not None and agree is None:
            why = ("its prompts of one task give no defined agreement" if _has_task_pairs(r) else
                   "it has no two prompts of one task")
            print(f"head_sensitivity: note: {path}: {why}: how much of its ranking is noise cannot be judged",
                  file=sys.stderr)
    if noisy:
        why = "; ".join(f"{path}'s prompts disagreed (rank agreement {text})" for path, text in noisy)
        configs = [(_with_layers(c, c.layers, why), m, t) for c, m, t in configs]
    for label, (config, moved, totals) in zip(labels, configs):
        path = Path(args.out.replace("{budget}", label))
        predicted = ", ".join(f"{t:+.4f} {UNITS[objective_of(r)]}" for t, r in zip(totals, results))
        estimates = [(*against_dense(r, moved), UNITS[objective_of(r)]) for r in results]
        dense = ("against dense on the measured prompts: "
                 + "; ".join(f"BASE {b:+.4f}, moved {m:+.4f} {unit}" for b, m, unit in estimates)
                 + " (moved: BASE plus every moved head's change with its sign, so far a low estimate)")
        modelled = "" if saved is None else (
            f"; modelled attention + index {base_ms - sum(saved[lh] for lh in moved):.1f} ms (BASE {base_ms:.1f})")
        config = _with_layers(config, config.layers, f"{dense}{modelled}")
        config.save(path)
        print(f"wrote {path}: {len(moved)} heads moved, predicted {predicted} against BASE; {dense}{modelled}")
    return 0


#: Heads named in the ``--against`` scatter.
ANNOTATED = 5


def common_deltas(result: dict, other: dict) -> list[tuple[int, int, float, float]]:
    """``(layer, head, other's delta, result's delta)`` for the heads both results measured, in
    layer order; ``ValueError`` (one line) when they share no head or were measured on different
    models (different objectives are fine: comparing them is the point)."""
    if result["model"] != other["model"]:
        raise ValueError(f"--against: the results were measured on different models ({result['model']} and "
                         f"{other['model']})")
    theirs = {(e["layer"], e["head"]): e["delta"] for e in other["heads"]}
    common = [(e["layer"], e["head"], theirs[(e["layer"], e["head"])], e["delta"]) for e in result["heads"]
              if (e["layer"], e["head"]) in theirs]
    if not common:
        raise ValueError(f"--against: no heads in common (this result measured {len(result['heads'])}, the other "
                         f"{len(other['heads'])})")
    return sorted(common)


def _symlog(bound: float) -> float:
    """The linear range around 0 of a symmetric log scale for values up to ``bound``."""
    return max(bound * 1e-3, 1e-6)


def plot_result(result: dict, path: str | os.PathLike, against: dict | None = None,
                against_name: str = "OTHER") -> Path:
    """Draw a result: each measured head's change as a layers x heads map (symmetric log colour
    scale: the few large deltas and the many near 0 both readable; unmeasured heads grey), and the
    share of the summed positive damage carried by the most damaging k heads against k; with 2 or
    more prompts the title gives their rank agreement (:func:`agreement_text`). With ``against``
    (another result, ``against_name`` its label) a third panel: this result's delta against the
    other's for each head both measured (:func:`common_deltas`), symmetric log axes, their
    :func:`rank_agreement` in the title and the :data:`ANNOTATED` heads whose delta is largest on
    either axis (each axis' deltas over its largest magnitude) named. Returns ``path``."""
    from minference.app.plots import _check_path, _matplotlib

    out = _check_path(path)
    heads = result["heads"]
    if not heads:
        raise ValueError("the result has no measured heads to draw")
    common = None if against is None else common_deltas(result, against)
    Figure, colors, _ = _matplotlib()
    n_layers = max(e["layer"] for e in heads) + 1
    n_heads = max(e["head"] for e in heads) + 1
    grid = torch.full((n_layers, n_heads), float("nan"))
    for e in heads:
        grid[e["layer"], e["head"]] = e["delta"]
    units = UNITS[objective_of(result)]
    if common is None:
        fig = Figure(figsize=(11, 4.8), dpi=120, layout="constrained")
        left, right = fig.subplots(1, 2, width_ratios=[1.3, 1])
    else:
        fig = Figure(figsize=(16, 4.8), dpi=120, layout="constrained")
        left, right, scatter = fig.subplots(1, 3, width_ratios=[1.3, 1, 1])
    bound = float(grid.nan_to_num(0).abs().max()) or 1.0
    norm = colors.SymLogNorm(linthresh=_symlog(bound), vmin=-bound, vmax=bound)
    import matplotlib

    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="#999999")  # unmeasured: grey, apart from near-0 white
    image = left.imshow(grid.T.numpy(), cmap=cmap, norm=norm, aspect="auto", origin="lower", interpolation="nearest")
    fig.colorbar(image, ax=left, label=f"change against BASE ({units})")
    left.set_xlabel("layer")
    left.set_ylabel("head")
    left.set_title(f"{len(heads)} heads moved alone to PROBE's pattern (grey: not measured)", fontsize=9)
    damage = sorted((max(e["delta"], 0.0) for e in heads), reverse=True)
    total = sum(damage)
    cumulative = torch.tensor(damage, dtype=torch.float64).cumsum(0) / (total if total > 0 else 1.0)
    shares = [0.0] + [float(x) for x in cumulative]
    right.plot(range(len(shares)), shares, color="#0072B2")
    right.set_xlabel("the k most damaging heads")
    right.set_ylabel("share of the summed positive change")
    right.set_ylim(0, 1.02)
    right.grid(alpha=0.3)
    right.set_title(f"sum of positive changes {total:+.4f} {units}", fontsize=9)
    if common is not None and against is not None:
        xs, ys = [c[2] for c in common], [c[3] for c in common]
        scatter.scatter(xs, ys, s=10, color="#0072B2", alpha=0.7)
        xb, yb = max(abs(x) for x in xs) or 1.0, max(abs(y) for y in ys) or 1.0
        scatter.set_xscale("symlog", linthresh=_symlog(xb))
        scatter.set_yscale("symlog", linthresh=_symlog(yb))
        scatter.axhline(0, color="#999999", lw=0.5)
        scatter.axvline(0, color="#999999", lw=0.5)
        scatter.set_xlabel(f"{objective_of(against)} change ({UNITS[objective_of(against)]})\n{against_name}")
        scatter.set_ylabel(f"this result: {objective_of(result)} change ({units})")
        rho = rank_agreement(xs, ys)
        scatter.set_title(f"{len(common)} heads both measured; Spearman rank agreement "
                          + ("undefined" if math.isnan(rho) else f"{rho:+.2f}"), fontsize=9)
        for l, h, x, y in sorted(common, key=lambda c: max(c[2] / xb, c[3] / yb), reverse=True)[:ANNOTATED]:
            scatter.annotate(f"L{l}H{h}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        scatter.grid(alpha=0.3)
    agreement = agreement_text(result)
    fig.suptitle(f"Head sensitivity: {result['model']}, {objective_of(result)} at {result['tokens']} tokens; "
                 f"BASE {result['base']['path']}, PROBE {result['probe']['path']}"
                 + ("" if agreement is None else f"\nbetween-prompt rank agreement of the deltas: {agreement}"),
                 fontsize=9)
    fig.savefig(out)
    return out


def proxy_changes(result: dict, searched, measurements: str) -> dict[str, list[float]]:
    """Per error proxy the search measurements ``searched`` hold (a loaded
    :class:`minference.app.search.SearchResult`, read from ``measurements``;
    :data:`minference.app.frontier.PROXIES`: the missed mass always, the output error when
    measured), each of ``result``'s heads' proxy change for its move: PROBE's candidate's error
    minus BASE's, mean over the calibration prompts (dense: 0), in the order of
    ``result["heads"]``. The proxies the frontier allocates on, set against what the heads
    measured. ``ValueError`` (one line) for measurements of another model or without the worst
    prompt's masses, a pattern that is no candidate, or a head outside the measurements."""
    from minference.app.frontier import FrontierError, _proxy_errors
    from minference.patterns import Dense

    check_config_model(searched.config, result["model"], hint=None)  # measurements of the result's model
    if searched.worst_mass is None:
        raise ValueError(f"{measurements} lacks the worst prompt's masses (a search older than the frontier): "
                         "search again with --save-measurements")
    L, H = searched.mass.shape[:2]

    def column(e: dict, which: str) -> int | None:  # None: dense, no candidate needed
        pattern = pattern_from_dict(e[which])
        if pattern in searched.candidates:
            return searched.candidates.index(pattern)
        if pattern == Dense():
            return None
        raise ValueError(f"layer {e['layer']}, head {e['head']}: the {which.upper()} pattern "
                         f"{_pattern_name(pattern)} is not a candidate of {measurements}")

    out = {}
    for proxy in PROXIES:
        try:
            error = _proxy_errors(searched, proxy)[0]
        except FrontierError:  # the output error, not measured by this search
            continue
        changes = []
        for e in result["heads"]:
            l, h = e["layer"], e["head"]
            if not (0 <= l < L and 0 <= h < H):
                raise ValueError(f"layer {l}, head {h} is outside {measurements} ({L} layers of {H} heads)")
            probe, base = column(e, "probe"), column(e, "base")
            changes.append((0.0 if probe is None else float(error[l, h, probe]))
                           - (0.0 if base is None else float(error[l, h, base])))
        out[proxy] = changes
    return out


def proxies_main(argv: list[str]) -> int:
    parser = _Parser(prog="head_sensitivity.py proxies", description="how well the search's error proxies rank "
                     "the heads a result measured: rank agreement, and where the most damaging heads rank")
    parser.add_argument("result", metavar="RESULT", help="this script's result JSON")
    parser.add_argument("--from-measurements", dest="measurements", required=True, metavar="M",
                        help="minference search's measurements at the same length (search --save-measurements)")
    args = parser.parse_args(argv)
    from minference.app.search import SearchResult

    try:
        result = read_result(args.result)
        searched = SearchResult.load(args.measurements)
        changes = proxy_changes(result, searched, args.measurements)
    except (OSError, ValueError) as err:
        print(f"head_sensitivity: {_one_line(str(err))}", file=sys.stderr)
        return 2
    if searched.n_tokens != result["tokens"]:
        print(f"head_sensitivity: note: the measurements are at {searched.n_tokens} tokens, {args.result} at "
              f"{result['tokens']}", file=sys.stderr)
    missing = sorted(set(PROXIES) - set(changes))
    if missing:
        print(f"head_sensitivity: note: {args.measurements} has no {', '.join(missing)} error (not measured by its "
              "search)", file=sys.stderr)
    heads = result["heads"]
    measured = [e["delta"] for e in heads]
    by_damage = sorted(range(len(heads)), key=lambda i: -measured[i])
    top, k = by_damage[:ANNOTATED], min(TOP, len(heads))
    print(f"## Error proxies against {args.result}: {len(heads)} heads, {objective_of(result)}\n")
    print(f"| proxy | rank agreement with the measured change | of the {k} most damaging heads, in the proxy's "
          f"{k} largest changes | the {len(top)} most damaging heads' ranks by proxy change (1 = largest) |")
    print("|---|---|---|---|")
    for proxy, xs in changes.items():
        order = sorted(range(len(xs)), key=lambda i: -xs[i])
        where = {i: r + 1 for r, i in enumerate(order)}
        rho = rank_agreement(xs, measured)
        ranks = ", ".join(f"L{heads[i]['layer']}H{heads[i]['head']} {where[i]}" for i in top)
        both = len(set(by_damage[:k]) & set(order[:k]))
        print(f"| {proxy} | {'undefined' if math.isnan(rho) else f'{rho:+.2f}'} | {both} | {ranks} |")
    return 0


def plot_main(argv: list[str]) -> int:
    parser = _Parser(prog="head_sensitivity.py plot", description="draw a result: the per-head map and how "
                     "concentrated the damage is; with --against, its deltas against another result's")
    parser.add_argument("result", metavar="RESULT", help="this script's result JSON")
    parser.add_argument("--out", required=True, help="image file to write (.png, .svg, ...)")
    parser.add_argument("--against", default=None, metavar="OTHER",
                        help="another result of the same model (any objective): a third panel, this result's "
                             "deltas against OTHER's for the heads both measured, with their rank agreement")
    args = parser.parse_args(argv)
    try:
        against = None if args.against is None else read_result(args.against)
        path = plot_result(read_result(args.result), args.out, against, Path(args.against or "OTHER").name)
    except (ImportError, OSError, ValueError) as err:
        print(f"head_sensitivity: {_one_line(str(err))}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["move"]:
        return move_main(argv[1:])
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    if argv[:1] == ["proxies"]:
        return proxies_main(argv[1:])
    start = time.perf_counter()
    parser = _Parser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("base", metavar="BASE", help="the PatternConfig every probe starts from")
    parser.add_argument("probe", metavar="PROBE", help="a PatternConfig giving each head's pattern to try")
    parser.add_argument("--model", required=True, choices=MODEL_CHOICES)
    parser.add_argument("--model-path", default=None, help="the Qwen GGUF file")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--tokens", type=int, required=True, help="prompt length (with --answers: the RULER length)")
    parser.add_argument("--samples", type=int, default=1,
                        help="perplexity prompts, or with --answers prompts per task (default 1)")
    parser.add_argument("--seed", type=int, default=None,
                        help="the perplexity prompts' seed (eval's --seed; default 0; not with --answers)")
    parser.add_argument("--heads", default="all", help="'all' (default) or layer:head pairs, e.g. 9:8,11:3")
    parser.add_argument("--dense-threshold", type=int, default=None,
                        help="prompts shorter than this run dense (default: the dispatcher's)")
    parser.add_argument("--dense-tail", type=int, default=0, help="last prompt tokens attending densely (default 0)")
    parser.add_argument("--answers", default=None, metavar="DIR",
                        help="measure the summed NLL of RULER reference answers from this prompt set instead")
    parser.add_argument("--tasks", default=None,
                        help=f"--answers' RULER tasks, comma-separated (default {ANSWER_TASKS})")
    parser.add_argument("--continue", dest="continue_from", default=None, metavar="RESULT",
                        help="a cut run's result of the same settings, BASE and PROBE: measure only the heads it "
                             "lacks (its dense and BASE values kept); --out may be the same file")
    parser.add_argument("--out", required=True, help="the result JSON (rewritten after every config)")
    args = parser.parse_args(argv)
    try:
        name, device, base, probe, probed, skipped, answers = _check(parser, args)
        previous = None if args.continue_from is None else _check_continue(args, name, base, probe, answers)
    except (ConfigError, OSError, ValueError) as err:
        print(f"head_sensitivity: {_one_line(str(err))}", file=sys.stderr)
        return 2
    if previous is not None:
        done = {(e["layer"], e["head"]) for e in previous["heads"]}
        probed = [lh for lh in probed if lh not in done]
    objective = "perplexity" if answers is None else "answers"
    n_prompts = args.samples * (1 if answers is None else len(answers[1]))
    forwards = n_prompts * ((2 if previous is None else 1) + len(probed))
    what = (f"{args.samples} sample(s) of {args.tokens} tokens" if answers is None else
            f"{args.samples} RULER prompt(s) per task of {', '.join(answers[1])} at {args.tokens}")
    kept = "" if previous is None else f", {len(previous['heads'])} kept from {args.continue_from}"
    print(f"head_sensitivity: {len(probed)} heads to probe, {skipped} skipped (PROBE = BASE){kept}, {what}: {forwards} "
          f"forwards ({'dense + ' if previous is None else ''}BASE + one per probed head from its layer on, per "
          "prompt)", file=sys.stderr)

    from tqdm.auto import tqdm

    model, tokenizer = load_model(name, path=args.model_path, device=device)
    device = next(model.parameters()).device
    try:  # the weights fingerprint too, once (as eval's resolve_config)
        base.check(model_signature(model))
    except ValueError as err:  # ConfigMismatchError
        print(f"head_sensitivity: BASE {args.base} was made for another model: {_one_line(str(err))}",
              file=sys.stderr)
        return 2
    dense_tail = args.dense_tail
    if answers is None:  # (ids, scored positions: None = all)
        seed = 0 if args.seed is None else args.seed
        prompts = [(perplexity_ids(tokenizer, args.tokens, i, seed=seed), None) for i in range(args.samples)]
        labels = [f"perplexity#{i}" for i in range(args.samples)]
    else:
        prompt_set, tasks, samples = answers
        seed = prompt_set.manifest.get("seed")
        try:
            prompt_set.check_tokenizer(tokenizer)
        except RulerError as err:
            print(f"head_sensitivity: --answers: {_one_line(str(err))}", file=sys.stderr)
            return 2
        prompts, labels = [], []
        for x in samples:
            target = torch.tensor(tokenizer(answer_text(x.metric, x.answers), add_special_tokens=False)["input_ids"],
                                  dtype=torch.long)
            if target.numel() == 0:
                print(f"head_sensitivity: {x.task}#{x.index}: its answer text has no tokens", file=sys.stderr)
                return 2
            prompts.append((torch.cat([x.ids, target]), int(target.numel())))
            labels.append(f"{x.task}#{x.index}")
        # decoding reads the answer densely, after the prompt's own dense tail: the tail grows by the longest answer
        dense_tail += max(scored for _, scored in prompts)
    result = {
        "format": FORMAT, "version": VERSION, "objective": objective, "units": UNITS[objective], "model": name,
        "device": str(device), "tokens": args.tokens, "samples": args.samples, "seed": seed,
        "answers": None if answers is None else {"prompts": str(args.answers), "tasks": answers[1]},
        "prompts": labels, "dense_threshold": args.dense_threshold, "dense_tail": dense_tail,
        "dense_tail_option": args.dense_tail,
        "prompt_sha256": [data_fingerprint([(ids if scored is None else ids[:-scored]).tolist()])
                          for ids, scored in prompts],
        "base_layout_sha256": layout_sha256(base),
        "base": {"path": str(args.base), "notes": base.provenance.notes},
        "probe": {"path": str(args.probe), "notes": probe.provenance.notes},
        "dense_nll": [], "base_nll": [], "heads": [], "skipped": skipped, "wall_s": 0.0, "complete": False,
    }
    if previous is not None:
        if previous["prompt_sha256"] != result["prompt_sha256"] or previous["dense_tail"] != dense_tail:
            print(f"head_sensitivity: --continue {args.continue_from} measured other prompts or another dense tail "
                  f"({previous['dense_tail']}, here {dense_tail})", file=sys.stderr)
            return 2
        result.update(dense_nll=previous["dense_nll"], base_nll=previous["base_nll"], heads=list(previous["heads"]))
        start -= previous.get("wall_s", 0.0)  # wall_s counts both runs
    out = Path(args.out)

    def save() -> None:
        result["wall_s"] = round(time.perf_counter() - start, 3)
        part = out.with_name(out.name + ".part")
        part.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        os.replace(part, out)  # a call killed mid-write leaves the previous complete file

    bar = tqdm(total=forwards, desc="head_sensitivity", unit="forward")

    decoder = model.get_decoder()
    skip = skip_ahead_works(decoder)
    result["layers_skipped"] = skip  # a head's forward starts at its layer, from BASE's recorded input there
    inputs: list[list[torch.Tensor]] = [[] for _ in prompts]  # [prompt][layer]: BASE's layer inputs

    def nll(config, label: str, first: int = 0, record: bool = False) -> list[float]:
        """Per prompt of ``config`` (``None``: the unpatched model): the mean NLL (perplexity), or
        the summed NLL of the answer tokens (``--answers``); ``record``: keep each layer's input;
        ``first``: run layers ``first..`` only, from the recorded input of that layer."""
        _apply(model, config, args.dense_threshold, "auto", False, dense_tail, guard=GUARD_OFF)  # eval's patching
        bar.set_postfix_str(label)
        values = []
        for p, (ids, scored) in enumerate(prompts):
            with contextlib.ExitStack() as stack:
                if record and skip:
                    stack.enter_context(record_layer_inputs(decoder, inputs[p]))
                if first and skip:
                    stack.enter_context(from_layer(decoder, first, inputs[p][first]))
                per_token = sequence_nll(model, ids.to(device), last=scored)  # answers: their tokens only
            values.append(float(per_token.mean() if scored is None else per_token.sum()))
            bar.update(1)
        return values

    # eval's rotary embedding for this length (YaRN beyond native); an answer may end past --tokens
    set_context_length(model, max(args.tokens, max(int(ids.numel()) for ids, _ in prompts)))
    try:
        if previous is None:
            result["dense_nll"] = nll(None, "dense")
        base_now = nll(base, "BASE", record=True)  # continued: again, for the layer inputs and this call's deltas
        if previous is None:
            result["base_nll"] = base_now
        save()
        for layer, head in probed:
            values = nll(set_head(base, layer, head, probe.layers[layer][head]), f"L{layer}H{head}", first=layer)
            deltas = [v - b for v, b in zip(values, base_now)]
            result["heads"].append({"layer": layer, "head": head, "base": pattern_to_dict(base.layers[layer][head]),
                                    "probe": pattern_to_dict(probe.layers[layer][head]),
                                    "delta": sum(deltas) / len(deltas), "per_prompt": deltas})
            result["heads"].sort(key=lambda e: (e["layer"], e["head"]))  # a continued run's heads in layer order too
            save()
    finally:
        bar.close()
        if is_patched(model):
            unpatch(model)
        set_context_length(model, 1)  # the model's own rotary embedding again
    result["complete"] = True
    save()
    print(summary(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
