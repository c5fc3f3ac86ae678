"""The quality guard in the application (docs/guard.md): the ``--guard*`` options of
``minference eval`` and ``minference run``, the guard each sparse config runs with, and the
summary the commands print. The guard itself is :mod:`minference.guard` (library)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from minference.config import GUARD_MODES, GuardSettings, PatternConfig
from minference.guard import QualityGuard, format_summary

__all__ = ["GuardOptions", "OFF", "add_arguments", "from_args", "format_summaries", "set_prompt"]

#: What a run without a guard passes to ``patch`` (so that a config's own runtime settings, already
#: merged into :meth:`GuardOptions.make`, do not make a second guard at each patch).
OFF = GuardSettings(mode="off")
#: Command-line option -> GuardSettings field.
_OPTIONS = {"guard": "mode", "guard_rate": "sample_rate", "guard_min_mass": "min_mass"}
#: GuardSettings field -> its option's flag (the messages name the flags the user gave).
_FLAGS = {"sample_rate": "--guard-rate", "min_mass": "--guard-min-mass"}


@dataclass(frozen=True)
class GuardOptions:
    """What the command line changes in a config's ``runtime.guard`` settings.

    Attributes:
        settings: GuardSettings fields to override (the rest come from each config's file).
        jsonl: file to append one JSON line per checked call to (every config's guard), or ``None``.
        prog: the command, for the note of :meth:`make`.
    """

    settings: dict[str, Any] = field(default_factory=dict)
    jsonl: str | None = None
    prog: str = field(default="minference", compare=False)
    _noted: list[bool] = field(default_factory=lambda: [False], init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        GuardSettings(**{"mode": "observe", **self.settings})  # a bad value fails here, before any model loads
        if self.settings.get("mode") == "off" and self._tuning():
            raise ValueError(f"argument --guard: off runs no guard, so {', '.join(self._tuning())} would do nothing "
                             "(drop them, or choose --guard observe or enforce)")

    def _tuning(self) -> list[str]:
        """The options given that configure a guard (all but the mode)."""
        return [_FLAGS[k] for k in self.settings if k in _FLAGS] + (["--guard-log"] if self.jsonl else [])

    def make(self, config: PatternConfig, name: str) -> QualityGuard | None:
        """The guard ``config`` runs with: its ``runtime.guard`` with these overrides; ``None`` when
        the mode is ``"off"``. Options that configure a guard while the mode resolves to off (the
        config's own mode is off and no ``--guard`` was given) would do nothing: a note on stderr
        says so, once (the mode is only known per config, after the model loads, and another
        config of the run may have its guard on: a note, not an error)."""
        settings = dataclasses.replace(config.runtime.guard, **self.settings)
        if settings.mode != "off":
            return QualityGuard(settings, jsonl=self.jsonl, name=name)
        if self._tuning() and not self._noted[0]:
            self._noted[0] = True
            print(f"{self.prog}: note: {', '.join(self._tuning())} given, but config {name!r} runs no quality guard "
                  "(its runtime.guard mode is off and no --guard was given): add --guard observe or --guard enforce",
                  file=sys.stderr)
        return None


def _unit(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--guard``, ``--guard-rate``, ``--guard-min-mass`` and ``--guard-log`` options."""
    group = parser.add_argument_group("quality guard (docs/guard.md)")
    group.add_argument("--guard", choices=GUARD_MODES, default=None,
                       help="check sampled prefill calls against dense attention: observe reports, enforce also "
                            "recomputes heads below the floor densely (default: the config's runtime.guard, off)")
    group.add_argument("--guard-rate", type=_unit, default=None, metavar="R",
                       help="fraction of prefill calls checked (default: the config's, 1/16)")
    group.add_argument("--guard-min-mass", type=_unit, default=None, metavar="M",
                       help="floor on a head's captured attention mass (default: the config's, 0.5)")
    group.add_argument("--guard-log", default=None, metavar="FILE", help="append one JSON line per checked call")


def from_args(args: argparse.Namespace) -> GuardOptions:
    """:class:`GuardOptions` from the parsed options (a ``ValueError`` names a bad value, or
    ``--guard off`` with options that configure a guard)."""
    given = {name: getattr(args, opt) for opt, name in _OPTIONS.items() if getattr(args, opt, None) is not None}
    return GuardOptions(given, getattr(args, "guard_log", None), prog=getattr(args, "cli_prog", "minference"))


def set_prompt(guard: QualityGuard | None, prompt_id: Any) -> None:
    """Name the prompt(s) of the next prefill in the guard's records (no-op without a guard)."""
    if guard is not None:
        guard.prompt_id = prompt_id


def format_summaries(summaries: dict[str, dict]) -> str:
    """The guard summaries of a run, one block per label (``""`` when there are none)."""
    return "\n".join(format_summary(dict(s, name=label)) for label, s in summaries.items() if s)
