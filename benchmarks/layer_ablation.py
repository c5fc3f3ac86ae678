"""Layer-group ablations of a searched config: where does its NLL damage come from?

The frontier's error proxy weights every head alike (docs/search.md). On the 1.5B at 130K the
family's missed mass is spread evenly over the layers except the last two, which take the most at
large budgets; whether the late layers (nothing after them corrects an error) cost the NLL is a
measurement, not a guess. This script writes, for each of ``--groups`` contiguous groups of
layers, the config restricted to that group (its searched patterns there, every other layer
dense), so one NLL run measures each group's share:

    python benchmarks/layer_ablation.py q15_0.2.json --groups 4 --out .stage/cfg/ablate
    minference eval --model qwen1.5b --device cuda --lengths 130000 --tasks perplexity --samples 3 \\
      --dense-tail 128 --no-coverage --no-profile --config dense <the specs it prints>

Each file's provenance notes say which layers kept the searched patterns. If the groups' ΔNLL add
up to the whole config's, the damage is additive over layers and a per-layer weight in the proxy
is the next step; if they do not, the layers interact.

``--set-head LAYER HEAD PATTERN`` instead writes one config with that head's pattern replaced
(``PATTERN`` a pattern's JSON, as ``minference eval --config`` takes it, or ``dense``): the test of a
single head's share, e.g. whether one head explains a config's damage (docs/search.md, "The 0.5B at
130K"):

    python benchmarks/layer_ablation.py fixtures/configs/qwen2.5-coder-0.5b.json --out .stage/cfg/ablate \
      --set-head 9 8 '{"kind": "a_shape", "sink": 128, "window": 16384}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from minference.app.evaluate import _parse_pattern
from minference.config import ConfigError, PatternConfig, load_config
from minference.patterns import Dense, Pattern, pattern_to_dict


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` contiguous ``(first, last)`` layer ranges covering ``0 .. num_layers - 1``, as
    even as integer division allows (earlier groups one layer longer)."""
    if not 1 <= groups <= num_layers:
        raise ValueError(f"groups must lie in [1, {num_layers}] for {num_layers} layers, got {groups}")
    size, extra = divmod(num_layers, groups)
    out, start = [], 0
    for g in range(groups):
        stop = start + size + (1 if g < extra else 0)
        out.append((start, stop - 1))
        start = stop
    return out


def _with_layers(config: PatternConfig, layers: list, note: str) -> PatternConfig:
    """``config`` with ``layers`` instead of its own, ``note`` appended to its provenance notes."""
    notes = f"{config.provenance.notes}; {note}" if config.provenance.notes else note
    return dataclasses.replace(config, layers=layers, provenance=dataclasses.replace(config.provenance, notes=notes))


def restrict(config: PatternConfig, first: int, last: int) -> PatternConfig:
    """``config`` with its patterns kept in layers ``first .. last`` and :class:`Dense` elsewhere."""
    layers = [list(row) if first <= l <= last else [Dense()] * len(row) for l, row in enumerate(config.layers)]
    return _with_layers(config, layers, f"layer ablation: layers {first}-{last} as searched, every other layer dense")


def set_head(config: PatternConfig, layer: int, head: int, pattern: Pattern) -> PatternConfig:
    """``config`` with head ``head`` of layer ``layer`` replaced by ``pattern`` (a note says so)."""
    if not (0 <= layer < len(config.layers) and 0 <= head < len(config.layers[layer])):
        raise ValueError(f"no head {head} in layer {layer}: the config has {len(config.layers)} layers of "
                         f"{len(config.layers[0])} heads")
    layers = [list(row) for row in config.layers]
    was = layers[layer][head]
    layers[layer][head] = pattern
    return _with_layers(config, layers, f"head ablation: layer {layer}, head {head} set to "
                        f"{json.dumps(pattern_to_dict(pattern))} (was {json.dumps(pattern_to_dict(was))})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("config", help="a PatternConfig JSON (e.g. a frontier point)")
    parser.add_argument("--groups", type=int, default=4, help="contiguous layer groups (default 4)")
    parser.add_argument("--out", required=True, help="folder for the restricted configs")
    parser.add_argument("--set-head", nargs=3, default=None, metavar=("LAYER", "HEAD", "PATTERN"),
                        help="write one config with this head's pattern replaced (PATTERN: JSON or 'dense')")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if args.set_head is not None:
            if not all(x.lstrip("-").isdigit() for x in args.set_head[:2]):
                raise ValueError(f"--set-head LAYER HEAD must be integers, got {' '.join(args.set_head[:2])}")
            layer, head = (int(x) for x in args.set_head[:2])
            text = args.set_head[2]  # eval --config's pattern JSON (its parser), or dense
            changed = set_head(config, layer, head, Dense() if text == "dense" else _parse_pattern(text))
        else:
            groups = layer_groups(len(config.layers), args.groups)
    except (OSError, ConfigError, ValueError) as err:
        print(f"layer_ablation: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.set_head is not None:
        path = out / f"{Path(args.config).stem}_L{layer}H{head}.json"
        changed.save(path)
        print(f"L{layer}H{head}={path}")
        return 0
    specs = []
    for first, last in groups:
        path = out / f"{Path(args.config).stem}_L{first}-{last}.json"
        restrict(config, first, last).save(path)
        specs.append(f"L{first}-{last}={path}")
    print(" ".join(specs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
