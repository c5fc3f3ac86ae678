"""pytest plugin (entry point ``minference``): markers, hypothesis profiles, device fixture.

Markers: ``gpu`` (needs CUDA; skipped without it), ``triton`` (runs Triton kernels on the
``device`` fixture's device: CUDA when present, else the interpreter on CPU — the kernel tier
that runs on both), ``interpret`` (runs Triton kernels on CPU tensors under
``TRITON_INTERPRET=1``; skipped when the interpreter is off, as on a GPU runner), ``layer``
(tier 2, real model layers), ``model`` (tier 3, whole model), ``bench`` (pytest-benchmark, GPU
timings).

What changes a run is opt-in, so that an installed minference leaves other projects' test runs
alone: the hypothesis profile, the marker skips and the xdist workers' thread share apply only
where the ini option ``minference_testing = true`` is set (this project's ``pyproject.toml`` sets
it; a project testing with :mod:`minference.testing` sets it to get them). Markers are always
registered; ``--compile-report``, ``--longest-first`` and ``--save-durations`` act whenever they
are given.

Hypothesis profiles: ``ci`` (bounded, CPU, 25 examples, no shrink phase: a failing example is
reported as drawn, in the seconds one interpreted example takes, instead of after minutes of
shrinking), ``ci-shrink`` (``ci`` with shrinking, to minimise a failure locally) and ``gpu`` (400
examples, shrinking on). The profile comes from ``MINFERENCE_HYPOTHESIS_PROFILE``, else ``gpu``
when CUDA is available, else ``ci``.

``--compile-report`` counts Triton JIT compiles (in-process cache misses, served by triton's disk
cache or built) per test, and prints where the session's time went, per test file, test and
kernel (xdist workers included). Under xdist each worker's torch gets its share of the CPU cores
(unless ``OMP_NUM_THREADS`` is set). ``--longest-first FILE`` (a JSON ``{"seconds": {nodeid:
seconds}}``, e.g. from a cold run's ``--durations``) hands the listed tests to xdist's workers
first, longest first, so the longest ones do not start last while the other workers idle (for
xdist's default ``--dist load``; see :func:`schedule_order`); ``--save-durations FILE`` writes
such a file from the session's own test times (every test, setup + call + teardown).

This plugin never imports triton at configure time: ``TRITON_INTERPRET`` must be decided (by the
caller's environment or a ``conftest.py``) before triton's first import.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest

from minference.compiles import CompileCounter

MARKERS = {
    "gpu": "needs a CUDA GPU; skipped when none is present",
    "triton": "runs Triton kernels on the device fixture's device (CUDA, else the CPU interpreter)",
    "interpret": "runs Triton kernels on CPU tensors under TRITON_INTERPRET=1; skipped when it is off",
    "layer": "tier 2: dense vs sparse on real model layers",
    "model": "tier 3: whole-model progressive swap-in",
    "bench": "pytest-benchmark timing on the GPU; skipped when none is present",
}

#: Every phase but shrinking (``explain`` needs a shrunk example, so it goes too).
NO_SHRINK = ("explicit", "reuse", "generate", "target")

#: hypothesis settings by profile name (``phases`` by name; the plugin turns them into ``Phase``).
PROFILES: dict[str, dict[str, Any]] = {
    "ci": dict(max_examples=25, deadline=None, derandomize=True, print_blob=True, phases=NO_SHRINK),
    "ci-shrink": dict(max_examples=25, deadline=None, derandomize=True, print_blob=True),
    "gpu": dict(max_examples=400, deadline=None, print_blob=True),
}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _enabled(config: pytest.Config) -> bool:
    return bool(config.getini("minference_testing"))


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    saved = config.getoption("save_durations", None)
    if saved and not hasattr(config, "workerinput"):  # a file that cannot be written fails before any test runs
        from pathlib import Path

        folder = Path(saved).resolve().parent
        if not folder.is_dir():
            raise pytest.UsageError(f"--save-durations {saved}: no folder {folder}")
    if config.getoption("longest_first", None):  # a bad file fails here, before collection
        config.stash[_LONGEST_FIRST] = load_durations(config.getoption("longest_first"))
        # xdist's load scheduler hands each worker a first chunk of consecutive items (at least
        # two, more with few workers) and refills by its own chunks: one item per refill keeps
        # schedule_order's placement (the controller reads the option when it builds the scheduler).
        if not hasattr(config, "workerinput") and getattr(config.option, "maxschedchunk", 0) is None:
            config.option.maxschedchunk = 1
    if not _enabled(config):
        return
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # the plugin works without the test extra; strategies need it
        return
    from hypothesis import Phase

    # Every profile derives from hypothesis' own defaults, never from the loaded profile (the
    # implicit parent): with a ``CI`` variable set hypothesis loads its built-in ``ci`` profile,
    # registering our ``ci`` over it reloads ours, and ``ci-shrink`` would inherit its phases.
    base = settings.get_profile("default")
    for name, kwargs in PROFILES.items():
        if "phases" in kwargs:
            kwargs = dict(kwargs, phases=tuple(Phase[p] for p in kwargs["phases"]))
        settings.register_profile(
            name, parent=base, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], **kwargs
        )
    profile = os.environ.get("MINFERENCE_HYPOTHESIS_PROFILE") or ("gpu" if _cuda() else "ci")
    if profile not in PROFILES:
        raise pytest.UsageError(f"MINFERENCE_HYPOTHESIS_PROFILE={profile!r}; expected one of {sorted(PROFILES)}")
    settings.load_profile(profile)


#: ``--longest-first``'s durations, read once at configure time.
_LONGEST_FIRST = pytest.StashKey[dict]()


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """``items`` with those named in ``seconds`` (by node id) first, longest first; the others
    after them in their order (the longest-processing-time rule for a pool of workers)."""
    return sorted(items, key=lambda item: -seconds.get(item.nodeid, 0.0))


def schedule_order(items: list, seconds: dict[str, float], workers: int) -> list:
    """The collection order that makes xdist's load scheduler (``--maxschedchunk 1``) start
    ``workers`` workers on the longest tests: :func:`longest_first`, with its first ``2 * workers``
    items paired as ``[L0, L(2w-1), L1, L(2w-2), ...]``. The scheduler gives worker ``i`` items
    ``2i`` and ``2i + 1`` to begin with, run one after the other; plain longest-first would put
    the two longest on one worker back to back (85 + 66 s on the H100's tier, more than the
    157 s run's mean load per worker). Then each worker that finishes a test gets the longest
    item left, queued behind the one it holds."""
    order = longest_first(items, seconds)
    if workers < 2 or len(order) < 2 * workers:
        return order
    head = order[: 2 * workers]
    paired = [x for i in range(workers) for x in (head[i], head[2 * workers - 1 - i])]
    return paired + order[2 * workers:]


def load_durations(path: str) -> dict[str, float]:
    """The ``seconds`` map of a ``--longest-first`` file; a missing or malformed file is a usage error."""
    import json
    from pathlib import Path

    try:
        seconds = json.loads(Path(path).read_text(encoding="utf-8"))["seconds"]
        return {str(k): float(v) for k, v in seconds.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise pytest.UsageError(f"--longest-first {path}: expected a JSON object with 'seconds' "
                                f"{{node id: seconds}} ({err})") from err


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only the order of the xdist workers' collection schedules anything (each worker collects the
    # same sorted list, and the controller hands items out in that order).
    if _LONGEST_FIRST in config.stash and hasattr(config, "workerinput"):
        workers = int(config.workerinput.get("workercount", 1))
        items[:] = schedule_order(items, config.stash[_LONGEST_FIRST], workers)
    if not _enabled(config):
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_interp = pytest.mark.skip(reason="CPU interpreter test; TRITON_INTERPRET is off in this run")
    cuda, interpreting = _cuda(), os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if ("gpu" in item.keywords or "bench" in item.keywords) and not cuda:
            item.add_marker(no_gpu)
        if "interpret" in item.keywords and not interpreting:
            item.add_marker(no_interp)


@pytest.fixture
def device() -> str:
    """``"cuda"`` when a GPU is present, else ``"cpu"`` (Triton then runs interpreted)."""
    return "cuda" if _cuda() else "cpu"


# ---- xdist workers' CPU threads, and --compile-report -----------------------------------------

COMPILE_PROPERTY = "triton_compiles"  # user property: [(kernel name, seconds), ...] of one test


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("minference").addoption(
        "--compile-report", action="store_true", default=False,
        help="count Triton JIT compiles per test; print the compile time per test file, test and kernel")
    parser.getgroup("minference").addoption(
        "--longest-first", default=None, metavar="FILE",
        help="under xdist, hand out the tests FILE lists (JSON {'seconds': {node id: s}}) first, longest first")
    parser.getgroup("minference").addoption(
        "--save-durations", default=None, metavar="FILE",
        help="write every test's seconds (setup + call + teardown) as a --longest-first file")
    parser.addini("minference_testing", type="bool", default=False,
                  help="apply minference's hypothesis profile, marker skips and xdist thread share")


def worker_threads(cores: int, workers: int) -> int:
    """CPU threads for torch in one of ``workers`` xdist workers on ``cores`` cores: their share."""
    return max(1, cores // max(1, workers))


#: The session's compile counter (``--compile-report``), in the pytest config's stash.
_COMPILES = pytest.StashKey[CompileCounter]()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    # Each xdist worker's torch would start a thread per core: 16 workers on 16 cores ran 256 threads
    # for the float64 references the kernel tests compute on the CPU (docs/verification.md).
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None and "OMP_NUM_THREADS" not in os.environ and _enabled(session.config):
        import torch

        torch.set_num_threads(worker_threads(os.cpu_count() or 1, int(workers)))
    # after the conftests chose TRITON_INTERPRET; the interpreter compiles nothing
    if session.config.getoption("compile_report", False):
        session.config.stash[_COMPILES] = CompileCounter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    counter = item.config.stash.get(_COMPILES, None)
    if counter is not None and call.when == "teardown":  # the teardown report carries the whole test's compiles
        item.user_properties.append((COMPILE_PROPERTY, counter.take()))
    yield


@dataclass
class _Tally:
    """One row of the compile report: the tests (per file), their seconds, compiles and compile seconds."""

    ids: set[str] = field(default_factory=set)
    seconds: float = 0.0
    compiles: int = 0
    compile_seconds: float = 0.0


def compile_report(reports, top: int = 20) -> list[str]:
    """Lines of the report: per test file (tests, seconds in setup+call+teardown, compiles, compile
    seconds), the ``top`` longest tests, and per kernel (compiles, seconds), most expensive first."""
    files: defaultdict[str, _Tally] = defaultdict(_Tally)
    kernels: defaultdict[str, _Tally] = defaultdict(_Tally)
    tests: defaultdict[str, _Tally] = defaultdict(_Tally)
    for r in reports:
        f = files[r.nodeid.split("::")[0]]
        f.ids.add(r.nodeid)
        f.seconds += r.duration
        for name, value in r.user_properties:
            if name == COMPILE_PROPERTY:
                for kernel, seconds in value:
                    for t in (f, tests[r.nodeid], kernels[kernel]):
                        t.compiles += 1
                        t.compile_seconds += seconds
    lines = [f"{'test file':<48} {'tests':>5} {'test s':>8} {'compiles':>8} {'compile s':>9}"]
    for path, t in sorted(files.items(), key=lambda kv: -kv[1].seconds):
        lines.append(f"{path:<48} {len(t.ids):>5} {t.seconds:>8.1f} {t.compiles:>8} {t.compile_seconds:>9.1f}")
    lines.append(f"{'all':<48} {sum(len(t.ids) for t in files.values()):>5} "
                 f"{sum(t.seconds for t in files.values()):>8.1f} {sum(t.compiles for t in files.values()):>8} "
                 f"{sum(t.compile_seconds for t in files.values()):>9.1f}")
    for nodeid, seconds in seconds_per_test(reports).items():
        tests[nodeid].seconds = seconds
    lines.append(f"{f'test (the {top} longest)':<48} {'':>5} {'test s':>8} {'compiles':>8} {'compile s':>9}")
    for nodeid, t in sorted(tests.items(), key=lambda kv: -kv[1].seconds)[:top]:
        lines.append(f"{nodeid:<48} {'':>5} {t.seconds:>8.1f} {t.compiles:>8} {t.compile_seconds:>9.1f}")
    lines.append(f"{'kernel':<48} {'':>5} {'':>8} {'compiles':>8} {'compile s':>9}")
    for kernel, t in sorted(kernels.items(), key=lambda kv: -kv[1].compile_seconds):
        lines.append(f"{kernel:<48} {'':>5} {'':>8} {t.compiles:>8} {t.compile_seconds:>9.1f}")
    return lines


def seconds_per_test(reports) -> dict[str, float]:
    """Each test's seconds (setup + call + teardown) from its reports, longest first."""
    seconds: defaultdict[str, float] = defaultdict(float)
    for r in reports:
        seconds[r.nodeid] += r.duration
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


def save_durations(path: str, reports) -> None:
    """Write ``reports``' :func:`seconds_per_test` (to 0.01 s) as a ``--longest-first`` file (what
    :func:`load_durations` reads), with the date and the test count as its ``source``."""
    import json
    from datetime import date
    from pathlib import Path

    seconds = {k: round(v, 2) for k, v in seconds_per_test(reports).items()}
    source = f"--save-durations of a pytest session on {date.today()} ({len(seconds)} tests)"
    Path(path).write_text(json.dumps({"source": source, "seconds": seconds}, indent=1) + "\n", encoding="utf-8")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    reports = [r for rs in terminalreporter.stats.values() for r in rs if isinstance(r, pytest.TestReport)]
    if config.getoption("compile_report", False):
        terminalreporter.write_sep("=", "Triton compiles per test file and kernel (--compile-report)")
        for line in compile_report(reports):
            terminalreporter.write_line(line)
    path = config.getoption("save_durations", None)
    if not path:
        return
    # only a session that ran every test it collected: a cut one would list its longest tests as short
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        terminalreporter.write_line(f"test durations not written to {path}: the session did not run to its end "
                                    f"(exit status {int(exitstatus)})")
        return
    try:
        save_durations(path, reports)
    except OSError as err:
        terminalreporter.write_line(f"test durations not written to {path}: {err}")
        return
    terminalreporter.write_line(f"test durations written to {path} (a --longest-first file)")
