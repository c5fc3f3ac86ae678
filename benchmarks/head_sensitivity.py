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
keeps the heads it measured, and ``move`` can use those.

Cost: one forward per probed head per sample, plus a dense and a BASE forward per sample (all 336
heads of the 0.5B at 130K, one sample: 338 forwards).

``move`` turns a result into configs, no model needed: BASE with the measured heads moved to their
PROBE pattern, least damage first, while the sum of the moved heads' deltas (a negative one counted
as 0) stays within each ``--budget`` (nats against BASE, the prediction an NLL run then checks):

    python benchmarks/head_sensitivity.py move fixtures/configs/qwen2.5-coder-0.5b.json .stage/q05_heads.json \
      --budget 0.002 0.005 0.01 --out 'moved_{budget}.json'
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
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
from minference.app.models import (  # noqa: E402
    MODEL_CHOICES,
    canonical_model,
    check_config_model,
    is_qwen,
    load_model,
    native_context,
    set_context_length,
)
from minference.config import ConfigError, GuardSettings, model_signature  # noqa: E402
from minference.integration import is_patched, unpatch  # noqa: E402
from minference.patterns import pattern_from_dict, pattern_to_dict  # noqa: E402

FORMAT = "minference.head_sensitivity"
VERSION = 1
#: Heads listed in the markdown summary.
TOP = 20
#: What patch runs without a quality guard (a config's own guard would repair what is measured).
GUARD_OFF = GuardSettings(mode="off")
_PAIR = re.compile(r"^(\d+):(\d+)$")


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


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Everything checkable before the model loads: ``(model name, device, base, probe, probed
    heads, skipped count)``; raises :class:`Refused` / ``ValueError`` (one line). The options the
    ``minference`` commands share (``--tokens``, ``--seed``, ``--device``, ``--out``, ...) get
    their checks (:func:`minference.app.cli.check_arguments`)."""
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
    return name, device, base, probe, probed, len(heads) - len(probed)


def summary(result: dict) -> str:
    """The markdown summary of a result: dense and BASE NLL, the :data:`TOP` largest deltas, the sum."""
    dense = sum(result["dense_nll"]) / len(result["dense_nll"])
    base = sum(result["base_nll"]) / len(result["base_nll"])
    heads = result["heads"]
    lines = [f"## Head sensitivity: {result['model']}, {result['tokens']} tokens, {result['samples']} sample(s) "
             f"(seed {result['seed']})", "",
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
    lines += ["", f"sum of all {len(heads)} deltas: {sum(e['delta'] for e in heads):+.4f} nats"]
    return "\n".join(lines)


def read_result(path: str | Path) -> dict:
    """A result JSON of this script; ``ValueError`` (one line) for anything else."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from None
    if not isinstance(result, dict) or result.get("format") != FORMAT or result.get("version") != VERSION:
        raise ValueError(f"{path} is not a {FORMAT} v{VERSION} result")
    for i, e in enumerate(result.get("heads", [])):
        missing = {"layer", "head", "base", "probe", "delta"} - set(e)
        if missing:
            raise ValueError(f"{path}: heads[{i}] lacks {', '.join(sorted(missing))}")
        if not isinstance(e["delta"], (int, float)) or not math.isfinite(e["delta"]):
            raise ValueError(f"{path}: layer {e['layer']}, head {e['head']} has a non-finite NLL change "
                             f"({e['delta']}): measure it again")
    return result


def move_heads(base, result: dict, budget: float):
    """``(config, moved heads, predicted delta)``: ``base`` with the heads of ``result`` moved to
    their PROBE pattern in order of measured delta (least first), while the sum of the moved heads'
    deltas, each counted at least 0, stays ``<= budget``. Raises ``ValueError`` (one line) when
    ``result`` was measured against another BASE (a head's recorded BASE pattern differs)."""
    if not 0 <= budget < math.inf:
        raise ValueError(f"--budget must be finite and >= 0, got {budget}")
    shape = [len(row) for row in base.layers]
    for e in result["heads"]:
        l, h = e["layer"], e["head"]
        if not (0 <= l < len(shape) and 0 <= h < shape[l]):
            raise ValueError(f"the result has layer {l}, head {h}; BASE has {len(shape)} layers of {max(shape)} heads")
        if e["base"] != pattern_to_dict(base.layers[l][h]):
            raise ValueError(f"the result was measured against another BASE: layer {l}, head {h} is "
                             f"{json.dumps(e['base'])} there, {json.dumps(pattern_to_dict(base.layers[l][h]))} here")
    layers = [list(row) for row in base.layers]
    moved, total = [], 0.0
    for e in sorted(result["heads"], key=lambda e: (e["delta"], e["layer"], e["head"])):
        cost = max(e["delta"], 0.0)
        if total + cost > budget + 1e-12:  # a sum of decimal deltas that equals the budget still fits
            break
        layers[e["layer"]][e["head"]] = pattern_from_dict(e["probe"])
        moved.append((e["layer"], e["head"]))
        total += cost
    note = (f"head moves: {len(moved)} of the {len(result['heads'])} heads measured by {FORMAT} "
            f"({result['model']}, {result['tokens']} tokens, {result['samples']} sample(s), seed {result['seed']}; "
            f"PROBE {result['probe']['path']}) moved to PROBE's pattern, least measured NLL change first, within "
            f"budget {budget:g} nats; predicted change against BASE {total:+.4f} (the sum of the moved heads' "
            f"changes, each at least 0)")
    return _with_layers(base, layers, note), sorted(moved), total


def move_main(argv: list[str]) -> int:
    parser = _Parser(prog="head_sensitivity.py move", description="configs from a result: the least damaging "
                     "heads moved to their PROBE pattern within each budget")
    parser.add_argument("base", metavar="BASE", help="the BASE config the result was measured against")
    parser.add_argument("result", metavar="RESULT", help="this script's result JSON")
    parser.add_argument("--budget", type=float, nargs="+", required=True,
                        help="sums of the moved heads' measured NLL changes, in nats (one config each)")
    parser.add_argument("--out", required=True, help="output path; '{budget}' is replaced by each budget")
    args = parser.parse_args(argv)
    try:
        if len(args.budget) > 1 and "{budget}" not in args.out:
            raise ValueError(f"--out must contain '{{budget}}' for {len(args.budget)} budgets, got {args.out!r}")
        for b in args.budget:
            path = check_output_file(args.out.replace("{budget}", f"{b:g}"))  # the CLI's check of a file to write
            _not_an_input(path, args.base, args.result)
        base, result = _load_file_config(args.base), read_result(args.result)
        configs = [move_heads(base, result, b) for b in args.budget]
    except (ConfigError, OSError, ValueError) as err:
        print(f"head_sensitivity: {_one_line(str(err))}", file=sys.stderr)
        return 2
    if not result.get("complete", False):
        print(f"head_sensitivity: note: {args.result} is incomplete ({len(result['heads'])} heads measured): "
              "only those can move", file=sys.stderr)
        configs = [(_with_layers(c, c.layers, f"the result was incomplete: {len(result['heads'])} heads measured"),
                    m, t) for c, m, t in configs]
    for budget, (config, moved, total) in zip(args.budget, configs):
        path = Path(args.out.replace("{budget}", f"{budget:g}"))
        config.save(path)
        print(f"wrote {path}: {len(moved)} heads moved, predicted {total:+.4f} nats against BASE")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["move"]:
        return move_main(argv[1:])
    start = time.perf_counter()
    parser = _Parser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("base", metavar="BASE", help="the PatternConfig every probe starts from")
    parser.add_argument("probe", metavar="PROBE", help="a PatternConfig giving each head's pattern to try")
    parser.add_argument("--model", required=True, choices=MODEL_CHOICES)
    parser.add_argument("--model-path", default=None, help="the Qwen GGUF file")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--tokens", type=int, required=True, help="prompt length")
    parser.add_argument("--samples", type=int, default=1, help="perplexity prompts (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed (eval's --seed; default 0)")
    parser.add_argument("--heads", default="all", help="'all' (default) or layer:head pairs, e.g. 9:8,11:3")
    parser.add_argument("--dense-threshold", type=int, default=None,
                        help="prompts shorter than this run dense (default: the dispatcher's)")
    parser.add_argument("--dense-tail", type=int, default=0, help="last prompt tokens attending densely (default 0)")
    parser.add_argument("--out", required=True, help="the result JSON (rewritten after every config)")
    args = parser.parse_args(argv)
    try:
        name, device, base, probe, probed, skipped = _check(parser, args)
    except (ConfigError, OSError, ValueError) as err:
        print(f"head_sensitivity: {_one_line(str(err))}", file=sys.stderr)
        return 2
    forwards = args.samples * (2 + len(probed))
    print(f"head_sensitivity: {len(probed)} heads to probe, {skipped} skipped (PROBE = BASE), {args.samples} "
          f"sample(s) of {args.tokens} tokens: {forwards} forwards (dense + BASE + one per probed head, per sample)",
          file=sys.stderr)

    from tqdm.auto import tqdm

    model, tokenizer = load_model(name, path=args.model_path, device=device)
    device = next(model.parameters()).device
    try:  # the weights fingerprint too, once (as eval's resolve_config)
        base.check(model_signature(model))
    except ValueError as err:  # ConfigMismatchError
        print(f"head_sensitivity: BASE {args.base} was made for another model: {_one_line(str(err))}",
              file=sys.stderr)
        return 2
    prompts = [perplexity_ids(tokenizer, args.tokens, i, seed=args.seed) for i in range(args.samples)]
    result = {
        "format": FORMAT, "version": VERSION, "model": name, "device": str(device), "tokens": args.tokens,
        "samples": args.samples, "seed": args.seed, "dense_threshold": args.dense_threshold,
        "dense_tail": args.dense_tail,
        "base": {"path": str(args.base), "notes": base.provenance.notes},
        "probe": {"path": str(args.probe), "notes": probe.provenance.notes},
        "dense_nll": [], "base_nll": [], "heads": [], "skipped": skipped, "wall_s": 0.0, "complete": False,
    }
    out = Path(args.out)

    def save() -> None:
        result["wall_s"] = round(time.perf_counter() - start, 3)
        part = out.with_name(out.name + ".part")
        part.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        os.replace(part, out)  # a call killed mid-write leaves the previous complete file

    bar = tqdm(total=forwards, desc="head_sensitivity", unit="forward")

    def nll(config, label: str) -> list[float]:
        """Mean NLL per prompt of ``config`` (``None``: the unpatched model)."""
        _apply(model, config, args.dense_threshold, "auto", False, args.dense_tail, guard=GUARD_OFF)  # eval's patching
        bar.set_postfix_str(label)
        values = []
        for ids in prompts:
            values.append(float(sequence_nll(model, ids.to(device)).mean()))
            bar.update(1)
        return values

    set_context_length(model, args.tokens)  # eval's rotary embedding for this length (YaRN beyond native)
    try:
        result["dense_nll"] = nll(None, "dense")
        result["base_nll"] = nll(base, "BASE")
        save()
        for layer, head in probed:
            values = nll(set_head(base, layer, head, probe.layers[layer][head]), f"L{layer}H{head}")
            deltas = [v - b for v, b in zip(values, result["base_nll"])]
            result["heads"].append({"layer": layer, "head": head, "base": pattern_to_dict(base.layers[layer][head]),
                                    "probe": pattern_to_dict(probe.layers[layer][head]),
                                    "delta": sum(deltas) / len(deltas), "per_prompt": deltas})
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
