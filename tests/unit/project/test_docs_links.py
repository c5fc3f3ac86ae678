"""Every report the docs, the README and the Python tree cite under ``benchmarks/results/`` exists.

A citation is either a path in the working tree (``benchmarks/results/<file>``, a glob or
``{a,b}`` alternatives allowed, each of which must match a file here) or the archive form
``results-archive:benchmarks/results/<file>`` (``git show`` reads it from the branch that holds
every report moved out of the tree; ``benchmarks/results/README.md``). A bare report name
(``h200_s16_call3_guard_ab.md``) must be in the tree too. Where git and the branch are at hand,
archive citations must name files the branch holds."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RESULTS = "benchmarks/results/"
ARCHIVE = "results-archive:"
#: The latest commit on main whose tree holds the archive branch's whole tree (a snapshot commit):
#: what a clone of main alone reads the archive from (benchmarks/results/README.md).
ARCHIVE_COMMIT = "ac0e608"
_CHARS = r"[A-Za-z0-9_.{},*<>\-]"
#: a path under benchmarks/results/, optionally in the archive form or relative (../)
PATH = re.compile(r"(results-archive:)?(?:\.\./)*benchmarks/results/(" + _CHARS + r"*)")
#: a bare report name: h100_..., h200_... or cpu_... with a report's extension or a glob
BARE = re.compile(r"(?<![\w/:.\-$])((?:h[12]00|cpu)_" + _CHARS + r"*?(?:\.(?:md|json|log|png|txt)|\.\*|\*))(?!\w)")
_SKIP_DIRS = {".git", ".tox", ".venv", "venv", "build", "dist", "node_modules", "__pycache__"}


def _expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``[abd, acd]``; ``<x>`` placeholders become ``*``."""
    pattern = re.sub(r"<[^>]*>", "*", pattern)
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [q for alt in m.group(1).split(",") for q in _expand(pattern[: m.start()] + alt + pattern[m.end():])]


def citations(text: str) -> list[tuple[bool, str]]:
    """``(archived, name)`` for every results citation in ``text`` (name relative to the folder)."""
    found = []
    for m in PATH.finditer(text):
        name = m.group(2).rstrip(".,")
        if name:
            found.append((m.start(), bool(m.group(1)), name))
    for m in BARE.finditer(text):
        found.append((m.start(), False, m.group(1)))
    return [(archived, name) for _, archived, name in sorted(found)]


def dangling(text: str, present: set[str], archived: set[str] | None = None) -> list[str]:
    """The citations in ``text`` that resolve to nothing: a tree citation with an alternative that
    matches no name in ``present``; an archive citation that matches nothing in ``archived`` (not
    checked when ``archived`` is None)."""
    bad = []
    for is_archive, name in citations(text):
        pool = archived if is_archive else present
        if pool is None:
            continue
        if not all(any(fnmatch.fnmatch(f, p) for f in pool) for p in _expand(name)):
            bad.append((ARCHIVE if is_archive else "") + RESULTS + name)
    return bad


def _cited_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames
                       if d not in _SKIP_DIRS and not d.startswith(".") and not d.endswith(".egg-info")]
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return [f for f in files if f.is_file() and f.resolve() != Path(__file__).resolve()]


def _present() -> set[str]:
    folder = ROOT / RESULTS
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def _files_at(ref: str) -> set[str] | None:
    """The names under benchmarks/results/ in ``ref``'s tree; None where git or the ref is missing."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", f"{ref}:{RESULTS}"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(out.stdout.split()) if out.returncode == 0 else None


def _archived() -> set[str] | None:
    """The archive's file names (the branch, a clone's remote one, or main's snapshot commit), None
    without git."""
    for ref in ("results-archive", "origin/results-archive", ARCHIVE_COMMIT):
        names = _files_at(ref)
        if names is not None:
            return names
    return None


def test_main_alone_reads_every_file_of_the_archive_branch():
    """A clone of main only (CI's) reads the archive from ARCHIVE_COMMIT: that snapshot must hold
    everything the branch holds, or a citation checked here against the branch fails there."""
    branch = _files_at("results-archive") or _files_at("origin/results-archive")
    if branch is None:
        pytest.skip("no results-archive branch in this clone")
    snapshot = _files_at(ARCHIVE_COMMIT)
    assert snapshot is not None, f"ARCHIVE_COMMIT {ARCHIVE_COMMIT} is not in this clone's history"
    missing = sorted(branch - snapshot)
    assert not missing, (f"{len(missing)} archived files main's snapshot {ARCHIVE_COMMIT} lacks (make a new "
                         "snapshot, benchmarks/results/README.md): " + ", ".join(missing[:5]))


def test_every_cited_report_is_in_the_tree_or_cited_in_the_archive_form():
    present = _present()
    bad = []
    for f in _cited_files():
        for ref in dangling(f.read_text(encoding="utf-8", errors="replace"), present):
            bad.append(f"{f.relative_to(ROOT)}: {ref}")
    hint = "keep the file or cite " + ARCHIVE + RESULTS + "<file>"
    assert not bad, f"dangling results links ({hint}):\n" + "\n".join(bad)


def test_every_archive_citation_names_a_file_of_the_archive_branch():
    archived = _archived()
    if archived is None:
        pytest.skip("no git checkout with the results-archive branch here")
    bad = []
    for f in _cited_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        bad += [f"{f.relative_to(ROOT)}: {ref}" for ref in dangling(text, set(), archived) if ref.startswith(ARCHIVE)]
    assert not bad, "archive citations the branch does not hold:\n" + "\n".join(bad)


def test_the_check_fails_on_a_dangling_link():
    present = {"kept.md", "run_a.json", "run_b.json"}
    archived = {"old.md", "kept.md"}
    text = ("see `benchmarks/results/kept.md` and benchmarks/results/run_{a,b}.json, "
            "`results-archive:benchmarks/results/old.md`, ![plot](../benchmarks/results/gone.png), "
            "`benchmarks/results/run_{a,c}.json`, `h200_s9_gone.md`, `results-archive:benchmarks/results/never.md`.")
    assert dangling(text, present) == ["benchmarks/results/gone.png", "benchmarks/results/run_{a,c}.json",
                                       "benchmarks/results/h200_s9_gone.md"]
    assert dangling(text, present, archived) == ["benchmarks/results/gone.png", "benchmarks/results/run_{a,c}.json",
                                                 "benchmarks/results/h200_s9_gone.md",
                                                 "results-archive:benchmarks/results/never.md"]
    assert dangling("`benchmarks/results/` holds the current reports; $OUT/h200_costs.json", present) == []
