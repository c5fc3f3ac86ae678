"""The ``minference`` command line.

One function per subcommand, registered on one ``argparse`` parser. This module owns ``demo``;
other modules add theirs through an ``add_cli(subparsers)`` function listed in
:data:`SUBCOMMAND_MODULES` (each parser sets ``func=handler(args) -> int``).

The error contract (docs/integration.md, "The command line"): every argument is checked before
anything slow runs (a model load, a search, a plot), and a bad one ends the command with one
line on stderr, ``minference CMD: error: ...``, and exit status 2, never a traceback (``--debug``,
accepted by every subcommand, shows it). The checks run in :func:`main`, in this order:

1. argparse's own (types, choices, required options), its errors made one line by
   :class:`Parser`;
2. :data:`OPTION_CHECKS`: options that mean the same in every subcommand (``--device``,
   ``--tokens``, ``--depth``, ``--config``, ``--min-mass``, ``--out``, ...), checked by their
   argparse ``dest`` wherever a subcommand has them (a new subcommand gets them for free; a new
   shared option is one entry there);
3. the subcommand's own cross-argument check, if its parser sets ``check=fn(args)`` (raising
   ``ValueError`` or ``ImportError`` with the message for the user);
4. the command itself: an error of :func:`user_errors` it raises (a config made for another
   model, a missing model file) is printed the same way.

``minference demo`` runs every pattern on a bundled synthetic example — deterministic ``q, k,
v`` with the structure real heads show (an attention sink, a local band, a few heavy key
columns, and one diffuse head) — and prints, per pattern, the density of the logical index,
the dense probability mass it captures (overall and in the start / middle / end thirds of the
queries), the relative error and cosine of the sparse output against dense attention, and,
when the fast path is available, how far ``sparse_prefill`` lands from the float64 reference on
the same index.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, TextIO

import torch

from minference.dispatch import FILL_GAPS

if TYPE_CHECKING:
    from minference.patterns import Pattern

__all__ = ["SUBCOMMAND_MODULES", "OPTION_CHECKS", "user_errors", "check_arguments", "Parser",
           "HelpFormatter", "check_device", "check_config_file", "check_output_file", "check_output_folder",
           "build_parser", "main", "demo_qkv", "demo_patterns", "run_demo"]

#: Modules whose ``add_cli(subparsers)`` adds subcommands (imported when the parser is built).
SUBCOMMAND_MODULES = ("minference.app.main_job", "minference.app.plots", "minference.app.evaluate",
                      "minference.app.ruler")

#: Demo problem size: small enough for the Triton interpreter on a laptop CPU.
DEMO_TOKENS = 256
DEMO_HEADS = 4
DEMO_KV_HEADS = 2
DEMO_HEAD_DIM = 32
#: Key positions that every "column" head attends to strongly (fractions of the length).
DEMO_HEAVY_COLUMNS = (0.15, 0.4, 0.7)
#: Logit strengths of the synthetic structure: sink, heavy column, local band peak, content noise.
DEMO_SINK_LOGIT = 8.0
DEMO_COLUMN_LOGIT = 7.0
DEMO_LOCAL_LOGIT = 9.0
DEMO_NOISE = 0.3
#: Positional features making the local band: harmonics ``m = 1..H`` of a period of
#: ``DEMO_PERIOD * n`` tokens (longer than the sequence, so the band never comes back), weighted
#: ``exp(-DEMO_HARMONIC_DECAY * (m / H)^2)``: a smooth bump around ``i = j`` about ``n / 16`` wide.
DEMO_HARMONICS = 12
DEMO_PERIOD = 1.5
DEMO_HARMONIC_DECAY = 1.0
#: Per-head mix of (sink, column, local) strengths, cycled over query heads.
DEMO_HEAD_MIX = ((1.0, 0.0, 1.0), (0.6, 1.0, 0.8), (0.3, 0.2, 0.3), (1.0, 0.6, 0.5))
#: ``minference demo --help``'s description.
DEMO_DESCRIPTION = (
    "Run every pattern on a bundled synthetic example (an attention sink, a local band, heavy key columns and "
    "a diffuse head) and print, per pattern, its density, the dense attention mass it captures and its error "
    "against dense attention, and how far the fast path lands from the float64 reference."
)
#: Triton kernels run when importable; the Triton interpreter needs this on CPU.
_INTERPRET = "TRITON_INTERPRET"


def demo_qkv(
    n: int = DEMO_TOKENS,
    heads: int = DEMO_HEADS,
    kv_heads: int = DEMO_KV_HEADS,
    head_dim: int = DEMO_HEAD_DIM,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic structured ``q [1, heads, n, head_dim]``, ``k, v [1, kv_heads, n, head_dim]``.

    Feature 0 of the keys marks the sink (position 0), feature 1 the heavy columns
    (:data:`DEMO_HEAVY_COLUMNS`), the next ``2 * DEMO_HARMONICS`` are positional harmonics whose
    weighted dot product is a bump around ``i = j`` (the local band); the rest is random content.
    Query head ``h`` weighs the three with ``DEMO_HEAD_MIX[h % 4]``. Logits
    are exact at the default scale ``head_dim ** -0.5``.
    """
    n_pos = 2 * DEMO_HARMONICS
    if head_dim < 2 + n_pos + 1:
        raise ValueError(f"head_dim must be >= {3 + n_pos} for the demo features, got {head_dim}")
    if n < 1 or heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"need n >= 1 and heads a multiple of kv_heads, got n={n}, heads={heads}, "
                         f"kv_heads={kv_heads}")
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    k = torch.randn(1, kv_heads, n, head_dim, generator=g, dtype=f64) * DEMO_NOISE
    q = torch.randn(1, heads, n, head_dim, generator=g, dtype=f64) * DEMO_NOISE
    v = torch.randn(1, kv_heads, n, head_dim, generator=g, dtype=f64)
    k[..., :2] = 0.0
    k[..., 0, 0] = 1.0
    for frac in DEMO_HEAVY_COLUMNS:
        k[..., int(frac * n), 1] = 1.0
    pos = torch.arange(n, dtype=f64)[:, None]
    m = torch.arange(1, DEMO_HARMONICS + 1, dtype=f64)
    weight = torch.exp(-DEMO_HARMONIC_DECAY * (m / DEMO_HARMONICS) ** 2)
    weight = weight / weight.sum()  # the bump peaks at exactly 1
    angle = 2 * math.pi * pos * m / (DEMO_PERIOD * n)  # [n, H]
    kpos = torch.cat([torch.cos(angle), torch.sin(angle)], -1)  # [n, 2H]
    qpos = kpos * torch.cat([weight, weight])
    k[..., 2 : 2 + n_pos] = kpos
    scale_back = math.sqrt(head_dim)  # cancels the default softmax scale
    for h in range(heads):
        sink, column, local = DEMO_HEAD_MIX[h % len(DEMO_HEAD_MIX)]
        q[0, h, :, 0] = sink * DEMO_SINK_LOGIT
        q[0, h, :, 1] = column * DEMO_COLUMN_LOGIT
        q[0, h, :, 2 : 2 + n_pos] = qpos * local * DEMO_LOCAL_LOGIT
    q = q * scale_back
    return q.to(dtype), k.to(dtype), v.to(dtype)


def demo_patterns(n: int = DEMO_TOKENS) -> dict[str, Pattern]:
    """The demo's pattern per name, budgets scaled to ``n`` tokens (about an eighth of the pairs)."""
    from minference.patterns import AShape, BlockSparse, Dense, VerticalSlash

    eighth = max(1, n // 8)
    block = 32 if n >= 128 else 16
    return {
        "dense": Dense(),
        "a_shape": AShape(sink=4, window=eighth),
        "vertical_slash": VerticalSlash(vertical=max(1, n // 16), slash=max(1, n // 16), last_q=min(64, n),
                                        sink_columns=1, local_diagonals=max(1, n // 32)),
        "block_sparse": BlockSparse(top_k=max(1, n // (8 * block)) + 1, block=block, sink_blocks=1),
    }


def _reference_run(pattern, q, k, v):
    """``(mask [1, H, N, N], out64 [1, H, N, D])`` for a pattern, indices from the naive estimators."""
    from minference.reference import attention as A
    from minference.reference import estimators as E
    from minference.reference import masks as M

    _, H, N, _ = q.shape
    kind = pattern.kind
    if kind == "dense":
        return M.causal_mask(N).expand(1, H, N, N), A.dense_attention(q, k, v)
    if kind == "a_shape":
        return (M.ashape_mask(N, pattern.sink, pattern.window).expand(1, H, N, N),
                A.ashape_attention(q, k, v, pattern.sink, pattern.window))
    if kind == "vertical_slash":
        vertical, slash = E.vertical_slash_index(
            q, k, pattern.vertical, pattern.slash, last_q=pattern.last_q, sink_columns=pattern.sink_columns,
            local_diagonals=pattern.local_diagonals, aggregation=pattern.aggregation, extra_rows=pattern.extra_rows)
        return (M.vertical_slash_mask(N, vertical, slash, FILL_GAPS),
                A.vertical_slash_attention(q, k, v, vertical, slash, fill_gaps=FILL_GAPS))
    blocks = E.block_sparse_index(q, k, pattern.top_k, block=pattern.block, sink_blocks=pattern.sink_blocks,
                                  force_diagonal=pattern.force_diagonal)
    return (M.block_sparse_mask(N, blocks, pattern.block),
            A.block_sparse_attention(q, k, v, blocks, block=pattern.block))


def _fast_backend(requested: str, device: torch.device) -> str | None:
    """The dispatcher backend to compare with the reference, or ``None`` to skip."""
    if requested == "none":
        return None
    if requested in ("auto", "triton") and device.type == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault(_INTERPRET, "1")  # before triton's first import
    if requested == "auto":
        try:
            importlib.import_module("triton")
            importlib.import_module("minference.kernels")
        except ImportError:
            return "torch"
        return "triton"
    return requested


def run_demo(
    *,
    n: int = DEMO_TOKENS,
    seed: int = 0,
    backend: str = "auto",
    device: str = "cpu",
    out: TextIO | None = None,
) -> list[dict[str, float | str]]:
    """Run the demo and print its table to ``out`` (default stdout); return one dict per pattern."""
    from minference.reference import metrics as R
    from minference.reference.attention import dense_attention, dense_attention_probs, masked_attention
    from minference.testing.tolerance import assert_close_to_reference

    out = out or sys.stdout
    dev = torch.device(device)
    fast = _fast_backend(backend, dev)
    dtype = torch.float32
    q, k, v = demo_qkv(n, seed=seed, dtype=dtype)
    dense = dense_attention(q, k, v)
    probs = dense_attention_probs(q, k)
    rows = []
    for name, pattern in demo_patterns(n).items():
        mask, ref = _reference_run(pattern, q, k, v)
        regions = R.captured_mass_by_region(probs, mask)
        row: dict[str, float | str] = {
            "pattern": name,
            "density": float(R.density(mask).mean()),
            "mass": float(R.captured_mass(probs, mask).mean()),
            **{f"mass_{r}": float(regions[r].mean()) for r in R.REGION_NAMES},
            "min_head_mass": float(R.captured_mass(probs, mask).min()),
            "rel_err": float(R.relative_error(ref, dense, reduce="all")),
            "cosine": float(R.cosine_similarity(ref, dense).mean()),
        }
        if fast is not None:
            from minference.dispatch import sparse_prefill

            got = sparse_prefill(q.to(dev), k.to(dev), v.to(dev), [pattern] * q.shape[1], dense_threshold=0,
                                 backend=fast)
            row["fast_max_abs_diff"] = float((got.double().cpu() - ref).abs().max())
            same, _ = masked_attention(q, k, v, mask, compute_dtype=dtype)
            try:
                assert_close_to_reference(got.cpu(), ref, same.to(dtype))
                row["fast_ok"] = "yes"
            except AssertionError:
                row["fast_ok"] = "NO"
        rows.append(row)
    _print_table(rows, n, fast, out)
    return rows


def _print_table(rows, n: int, fast: str | None, out: TextIO) -> None:
    cols = [("pattern", "pattern", 15, "<"), ("density", "density", 8, ">.3f"), ("mass", "mass", 7, ">.3f"),
            ("mass_start", "start", 7, ">.3f"), ("mass_middle", "middle", 7, ">.3f"), ("mass_end", "end", 7, ">.3f"),
            ("min_head_mass", "min/head", 9, ">.3f"), ("rel_err", "rel.err", 9, ">.2e"),
            ("cosine", "cosine", 9, ">.6f")]
    if fast is not None:
        cols += [("fast_max_abs_diff", f"{fast}|d|", 11, ">.2e"), ("fast_ok", "rule", 5, ">")]
    print(f"minference demo: synthetic heads (sink, local band, heavy columns), N={n}, "
          f"{DEMO_HEADS} query / {DEMO_KV_HEADS} kv heads, D={DEMO_HEAD_DIM}", file=out)
    print("mass: dense probability mass kept by the index (mean over queries and heads; start/middle/end: "
          "thirds of the queries; min/head: worst head); rel.err, cosine: sparse output vs dense", file=out)
    if fast is not None:
        print(f"{fast}|d|: max |sparse_prefill(backend={fast}) - float64 reference on the same index|; "
              "rule: within the tolerance rule (2 x float32 reference error + floor)", file=out)
    print(" ".join(f"{title:{spec[0]}{width}}" for _, title, width, spec in cols), file=out)
    for row in rows:
        print(" ".join(f"{row[key]:{spec[0]}{width}{spec[1:]}}" for key, _, width, spec in cols), file=out)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# Argument checks shared by every subcommand (the error contract in the module docstring).


def check_device(name: str) -> str:
    """``name`` if it is a torch device this machine has (``cpu``, ``cuda``, ``cuda:N``, ``mps``,
    ...), else a ``ValueError`` saying why: checked before anything loads (a model loaded for
    ~30 s and then moved to a missing GPU ended in ``Torch not compiled with CUDA enabled``)."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return name
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, driver)")
            raise ValueError(f"device {name!r} is not available: {why}; use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {name!r} is not available: this machine has {count} CUDA device(s)")
        return name
    module = torch.backends.mps if dev.type == "mps" else getattr(torch, dev.type, None)
    if not getattr(module, "is_available", lambda: False)():
        raise ValueError(f"device {name!r} is not available on this machine; use cpu or cuda")
    return name


def check_config_file(path: str) -> str:
    """``path`` if it names a PatternConfig that loads (format, schema, limits: everything but the
    model check, which needs the model), else a ``ValueError`` with the loader's message."""
    from minference.config import ConfigError, load_config

    try:
        load_config(path)
    except (ConfigError, OSError) as err:
        raise ValueError(f"config {path}: {err}" if str(path) not in str(err) else str(err)) from None
    return path


def _int_at_least(minimum: int):
    def check(value: int) -> int:
        if value < minimum:
            raise ValueError(f"must be >= {minimum}, got {value}")
        return value

    return check


def _number_in(lo: float, hi: float, *, open_low: bool = False):
    def check(value: float) -> float:
        if not (math.isfinite(value) and (lo < value if open_low else lo <= value) and value <= hi):
            raise ValueError(f"must lie in {'(' if open_low else '['}{lo:g}, {hi:g}], got {value}")
        return value

    return check


def check_output_file(path: str) -> str:
    """``path`` if a file can be written there, else a ``ValueError`` saying why: it is not a
    folder, its folder exists and is writable, and a file already there is writable. What every
    option naming a file to write is checked with (:data:`OPTION_CHECKS`: ``--out``, ``--plot``,
    ``--save-measurements``, ``--guard-log``; ``search`` checks each file its ``--out`` template makes): a folder
    given as ``--out`` ran a whole eval or search and then failed with ``[Errno 21]``."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ValueError(f"{path!r} is a folder; give a file name")
    folder = os.path.dirname(full)
    if not os.path.isdir(folder):
        raise ValueError(f"the folder of {path!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"the folder of {path!r} is not writable")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise ValueError(f"{path!r} exists and is not writable")
    return path


def check_output_folder(path: str) -> str:
    """``path`` if it is a folder to write into, or one that can be made there (its parent exists
    and is writable): the check of the options that name a folder to write (``out_folder``)."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise ValueError(f"{path!r} exists and is not a folder")
    where = full if os.path.isdir(full) else os.path.dirname(full)
    if not os.path.isdir(where):
        raise ValueError(f"the folder of {path!r} does not exist")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(f"{where!r} is not writable")
    return path


def _image_file(path: str) -> str:
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("drawing needs matplotlib: pip install matplotlib (or pip install 'minference[plot]')")
    return check_output_file(path)


#: Checks of the options that mean the same in every subcommand, by argparse ``dest``: each
#: takes the parsed value (never ``None``: an option left at a ``None`` default is not checked;
#: each element of a list) and returns it or raises ``ValueError`` with the message for the
#: user. :func:`main` applies them to every subcommand that has the option, before it runs.
#: A dest means one thing in every subcommand (``eval``'s prompt folder is ``prompt_set``, not
#: ``prompts``, which is ``search``'s count).
#: (``eval`` checks its own ``--lengths``, ``--samples``, ``--tasks`` and ``--config`` specs
#: before it loads the model: ``minference.app.evaluate.run_eval``.)
OPTION_CHECKS = {
    "device": check_device,
    "config": check_config_file,
    "tokens": _int_at_least(2),
    "depth": _number_in(0.0, 1.0),
    "min_mass": _number_in(0.0, 1.0),
    "head_floor": _number_in(0.0, 1.0),
    "target_density": _number_in(0.0, 1.0, open_low=True),
    "prompts": _int_at_least(1),
    "row_stride": _int_at_least(1),
    "dpi": _int_at_least(1),
    "seed": _int_at_least(0),
    "dense_threshold": _int_at_least(0),
    "dense_tail": _int_at_least(0),
    "prefill_chunk": _int_at_least(0),
    "threads": _int_at_least(1),
    "layers": _int_at_least(0),
    "layer": _int_at_least(0),
    "head": _int_at_least(0),
    "out": check_output_file,
    "plot": _image_file,
    "save_measurements": check_output_file,
    "guard_log": check_output_file,
    "out_folder": check_output_folder,
}


def user_errors() -> tuple[type[BaseException], ...]:
    """What a command may raise that is the user's to fix (a bad argument found late, a config
    made for another model, a missing model or package): one line, exit 2. Anything else is a
    bug and keeps its traceback. (A function: the model module is imported only on an error.)"""
    from minference.app.models import ModelNotAvailable

    return (ValueError, OSError, ImportError, ModelNotAvailable)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Steps 2 and 3 of the error contract: :data:`OPTION_CHECKS` on every option ``args`` has,
    then the subcommand's own ``check(args)``. Raises ``ValueError`` naming the option."""
    flags = {a.dest: a.option_strings[-1] for a in _all_actions(parser) if a.option_strings}
    for dest, check in OPTION_CHECKS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        try:
            if isinstance(value, list):
                setattr(args, dest, [check(x) for x in value])
            else:
                setattr(args, dest, check(value))
        except ValueError as err:
            raise ValueError(f"argument {flags.get(dest, '--' + dest.replace('_', '-'))}: {err}") from None
    extra = getattr(args, "check", None)
    if extra is not None:
        extra(args)


def _all_actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_actions(sub)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with ``(default: X)`` after every option whose help does not say its
    default already (``None`` and ``False`` defaults, which mean "off" or "chosen", are left out)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or any(action.default is off for off in (None, False, argparse.SUPPRESS))
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """The parser of ``minference`` and of each subcommand (``add_subparsers`` makes its parsers
    of the parent's class): :class:`HelpFormatter` unless told otherwise, a ``--debug`` option on
    every level, and usage errors on one line (``minference run: error: argument --tokens:
    invalid int value: 'x'``, exit 2)."""

    def __init__(self, *, formatter_class: type[argparse.HelpFormatter] = HelpFormatter, **kwargs) -> None:
        # keywords only (as add_subparsers passes them): a positional formatter_class would be given twice
        super().__init__(formatter_class=formatter_class, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="on an error, show the traceback instead of one line")
        self.set_defaults(cli_prog=self.prog)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _demo_cmd(args: argparse.Namespace) -> int:
    run_demo(n=args.tokens, seed=args.seed, backend=args.backend, device=args.device)
    return 0


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo", help="every pattern on a bundled synthetic example: density, captured mass, error vs dense",
        description=DEMO_DESCRIPTION,
    )
    demo.add_argument("--tokens", type=_positive_int, default=DEMO_TOKENS, help="sequence length")
    demo.add_argument("--seed", type=int, default=0, help="seed of the synthetic content")
    demo.add_argument("--backend", choices=("auto", "triton", "torch", "none"), default="auto",
                      help="fast path compared with the reference (auto: Triton when importable; none: skip)")
    demo.add_argument("--device", default="cpu",
                      help="device of the fast path (cpu: Triton interpreter; checked before anything runs)")
    demo.set_defaults(func=_demo_cmd)


def build_parser() -> argparse.ArgumentParser:
    """The ``minference`` parser with every subcommand."""
    parser = Parser(
        prog="minference",
        description="Training-free dynamic sparse attention for long-context prefill.",
        epilog="Run `minference COMMAND --help` for the options of a command.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    _add_demo(subparsers)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).add_cli(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``minference`` script; returns the exit status (2: a bad argument or
    another error of :func:`user_errors`, printed as one line on stderr; see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse's errors: one line, SystemExit(2)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        check_arguments(parser, args)
        quiet: AbstractContextManager = nullcontext()
        if getattr(args, "no_progress", False):  # transformers' loading bars too
            from minference.app.models import quiet_loading

            quiet = quiet_loading()
        with quiet:
            return int(args.func(args) or 0)
    except Exception as err:
        if getattr(args, "debug", False) or not isinstance(err, user_errors()):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"{args.cli_prog}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
