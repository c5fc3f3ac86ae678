"""The quality guard in the application (docs/guard.md): the ``--guard*`` options of
``minference eval`` and ``minference run``, the guard each sparse config runs with, and the
summary the commands print. The guard itself is :mod:`minference.guard` (library)."""

from __future__ import annotations

import argparse
import dataclasses
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


@dataclass(frozen=True)
class GuardOptions:
    """What the command line changes in a config's ``runtime.guard`` settings.

    Attributes:
        settings: GuardSettings fields to override (the rest come from each config's file).
        jsonl: file to append one JSON line per checked call to (every config's guard), or ``None``.
    """

    settings: dict[str, Any] = field(default_factory=dict)
    jsonl: str | None = None

    def __post_init__(self) -> None:
        GuardSettings(**{"mode": "observe", **self.settings})  # a bad value fails here, before any model loads

    def make(self, config: PatternConfig, name: str) -> QualityGuard | None:
        """The guard ``config`` runs with: its ``runtime.guard`` with these overrides; ``None`` when
        the mode is ``"off"``."""
        settings = dataclasses.replace(config.runtime.guard, **self.settings)
        return None if settings.mode == "off" else QualityGuard(settings, jsonl=self.jsonl, name=name)


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
    """:class:`GuardOptions` from the parsed options (a ``ValueError`` names a bad value)."""
    given = {name: getattr(args, opt) for opt, name in _OPTIONS.items() if getattr(args, opt, None) is not None}
    return GuardOptions(given, getattr(args, "guard_log", None))


def set_prompt(guard: QualityGuard | None, prompt_id: Any) -> None:
    """Name the prompt(s) of the next prefill in the guard's records (no-op without a guard)."""
    if guard is not None:
        guard.prompt_id = prompt_id


def format_summaries(summaries: dict[str, dict]) -> str:
    """The guard summaries of a run, one block per label (``""`` when there are none)."""
    return "\n".join(format_summary(dict(s, name=label)) for label, s in summaries.items() if s)
