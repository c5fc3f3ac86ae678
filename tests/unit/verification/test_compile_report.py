"""``--compile-report``: the per-file and per-kernel sums of Triton compiles and test seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from minference.testing.plugin import COMPILE_PROPERTY, compile_report, load_durations, longest_first, schedule_order


def _report(nodeid: str, when: str, duration: float, compiles=None) -> pytest.TestReport:
    props = [(COMPILE_PROPERTY, compiles)] if compiles is not None else []
    return pytest.TestReport(nodeid, (nodeid, 0, nodeid), {}, "passed", None, when, duration=duration,
                             user_properties=props)


def test_sums_per_file_and_kernel_most_expensive_first():
    reports = [
        _report("tests/a.py::t1", "setup", 1.0), _report("tests/a.py::t1", "call", 2.0),
        _report("tests/a.py::t1", "teardown", 0.5, [("_fwd", 1.5), ("_conv", 0.25)]),
        _report("tests/b.py::t2", "call", 10.0), _report("tests/b.py::t2", "teardown", 0.0, [("_fwd", 4.0)]),
        _report("tests/b.py::t3", "teardown", 0.0, []),
    ]
    lines = compile_report(reports)
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert lines[1].startswith("tests/b.py") and lines[2].startswith("tests/a.py")  # by test seconds
    assert rows["tests/b.py"] == ["2", "10.0", "1", "4.0"]
    assert rows["tests/a.py"] == ["1", "3.5", "2", "1.8"]
    assert rows["all"] == ["3", "13.5", "3", "5.8"]
    kernel_rows = lines[lines.index(next(l for l in lines if l.startswith("kernel"))) + 1:]
    assert [l.split() for l in kernel_rows] == [["_fwd", "2", "5.5"], ["_conv", "1", "0.2"]]


def test_the_option_runs_a_session_and_prints_the_table(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_one():\n    assert True\n")
    env = dict(os.environ, MINFERENCE_HYPOTHESIS_PROFILE="ci")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--compile-report", "test_x.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if "Triton compiles per test file and kernel" in line)
    assert lines[at + 2].split()[0] == "test_x.py" and lines[at + 2].split()[1] == "1"


def test_xdist_workers_take_their_share_of_the_cores(tmp_path):
    """A worker of N (xdist sets PYTEST_XDIST_WORKER_COUNT) runs torch on cores // N threads."""
    (tmp_path / "test_y.py").write_text(
        "import os, torch\n"
        "from minference.testing.plugin import worker_threads\n"
        "def test_threads():\n"
        "    assert torch.get_num_threads() == worker_threads(os.cpu_count(), 3) == max(1, os.cpu_count() // 3)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nminference_testing = true\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(MINFERENCE_HYPOTHESIS_PROFILE="ci", PYTEST_XDIST_WORKER_COUNT="3")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_y.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_longest_first_orders_the_listed_tests_and_keeps_the_rest():
    items = [types.SimpleNamespace(nodeid=n) for n in ("a", "b", "c", "d", "e")]
    order = [i.nodeid for i in longest_first(items, {"d": 85.0, "b": 30.0, "zz": 99.0})]
    assert order == ["d", "b", "a", "c", "e"]


def test_schedule_order_starts_each_worker_on_one_of_the_longest():
    """xdist's load scheduler gives worker i items 2i and 2i + 1 first: each worker's pair is one of
    the w longest with one of the next w, longest with shortest."""
    items = [types.SimpleNamespace(nodeid=n) for n in "abcdefgh"]
    seconds = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 5.0, "f": 6.0, "g": 7.0}
    assert [i.nodeid for i in schedule_order(items, seconds, 1)] == list("gfedcbah")
    assert [i.nodeid for i in schedule_order(items, seconds, 2)] == list("gdfecbah")
    assert [i.nodeid for i in schedule_order(items, seconds, 3)] == list("gbfcedah")
    assert [i.nodeid for i in schedule_order(items, seconds, 5)] == list("gfedcbah")  # < 2w items: plain


def test_longest_first_under_xdist_runs_the_two_longest_on_two_workers(tmp_path):
    """A real ``-n 2`` session of 64 tests: the two longest listed run on different workers (plain
    longest-first gave xdist's first worker both, back to back; with 64 tests its first chunk
    would be the 8 longest)."""
    pytest.importorskip("xdist")
    names = [f"t{i:02d}" for i in range(64)]
    (tmp_path / "test_s.py").write_text(
        "import os\n" + "".join(
            f"def test_{n}():\n    open('ran.txt', 'a').write('{n} ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
            for n in names))
    seconds = {f"test_s.py::test_t{i:02d}": 100.0 - i for i in (40, 41, 42, 43)}  # t40 longest, then t41
    (tmp_path / "d.json").write_text(json.dumps({"seconds": seconds}))
    env = dict(os.environ, MINFERENCE_HYPOTHESIS_PROFILE="ci")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2",
                          "--longest-first", "d.json", "test_s.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    worker = dict(line.split() for line in (tmp_path / "ran.txt").read_text().splitlines())
    assert len(worker) == 64 and len(set(worker.values())) == 2
    assert worker["t40"] != worker["t41"], worker


def test_the_plugin_leaves_a_project_that_does_not_opt_in_alone(tmp_path):
    """Installed, the plugin loads in every pytest session: without ``minference_testing = true``
    it neither skips another project's ``gpu`` / ``interpret`` tests nor loads its hypothesis
    profile; with it, both apply."""
    (tmp_path / "test_o.py").write_text(
        "import pytest\nfrom hypothesis import settings\n"
        "@pytest.mark.gpu\ndef test_marked():\n    pass\n"
        "def test_profile():\n    assert settings.default.max_examples == 100, settings.default.max_examples\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MINFERENCE_HYPOTHESIS_PROFILE", "CI")}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "test_o.py"]
    alone = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0 and "2 passed" in alone.stdout, alone.stdout[-2000:] + alone.stderr[-2000:]
    (tmp_path / "pytest.ini").write_text("[pytest]\nminference_testing = true\n")
    opted = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    import torch

    cuda = torch.cuda.is_available()
    out = opted.stdout
    assert opted.returncode == 1 and f"AssertionError: {400 if cuda else 25}" in out, out[-2000:]  # its profile
    assert cuda or "needs a CUDA GPU" in out, out[-2000:]


def _collect(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MINFERENCE_HYPOTHESIS_PROFILE="ci")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_longest_first_orders_an_xdist_workers_collection(tmp_path):
    """In an xdist worker (``config.workerinput``, set here by a conftest as xdist does) the listed
    tests come first, longest first; in the controller or a plain run the order stays."""
    (tmp_path / "test_z.py").write_text("".join(f"def test_{c}():\n    pass\n" for c in "abcd"))
    (tmp_path / "d.json").write_text(json.dumps({"seconds": {"test_z.py::test_c": 40.0, "test_z.py::test_b": 9.5}}))
    plain = _collect(tmp_path, "--longest-first", "d.json", "test_z.py")
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]
    assert [l for l in plain.stdout.splitlines() if "::" in l] == [f"test_z.py::test_{c}" for c in "abcd"]
    (tmp_path / "conftest.py").write_text(
        "import pytest\n@pytest.hookimpl(tryfirst=True)\ndef pytest_configure(config):\n    config.workerinput = {}\n")
    worker = _collect(tmp_path, "--longest-first", "d.json", "test_z.py")
    assert [l for l in worker.stdout.splitlines() if "::" in l] == [f"test_z.py::test_{c}" for c in "cbad"]


def test_longest_first_refuses_a_bad_file_before_collecting(tmp_path):
    (tmp_path / "test_w.py").write_text("def test_w():\n    pass\n")
    (tmp_path / "bad.json").write_text('{"secs": {}}')
    for name in ("bad.json", "missing.json"):
        run = _collect(tmp_path, "--longest-first", name, "test_w.py")
        assert run.returncode == 4 and f"--longest-first {name}: expected a JSON object" in run.stderr, run.stderr


def test_save_durations_under_xdist_writes_a_longest_first_file(tmp_path):
    """``--save-durations`` in a real ``-n 2`` session: every test once, its setup, call and
    teardown summed (a test slow in its fixture's teardown counts whole), longest first; the file
    is what ``--longest-first`` reads."""
    pytest.importorskip("xdist")
    (tmp_path / "test_d.py").write_text(
        "import time, pytest\n"
        "@pytest.fixture\ndef slow_teardown():\n    yield\n    time.sleep(0.4)\n"
        "def test_fast():\n    pass\n"
        "def test_torn(slow_teardown):\n    pass\n"
        "@pytest.mark.parametrize('i', [1, 2])\ndef test_p(i):\n    pass\n")
    env = dict(os.environ, MINFERENCE_HYPOTHESIS_PROFILE="ci")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2",
                          "--save-durations", "d.json", "test_d.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "test durations written to d.json" in run.stdout
    data = json.loads((tmp_path / "d.json").read_text())
    seconds = data["seconds"]
    assert sorted(seconds) == ["test_d.py::test_fast", "test_d.py::test_p[1]", "test_d.py::test_p[2]",
                               "test_d.py::test_torn"]
    assert next(iter(seconds)) == "test_d.py::test_torn" and seconds["test_d.py::test_torn"] >= 0.4
    assert list(seconds.values()) == sorted(seconds.values(), reverse=True)
    assert "4 tests" in data["source"]
    assert load_durations(str(tmp_path / "d.json")) == seconds


def test_save_durations_only_for_a_whole_session_and_a_folder_that_exists(tmp_path):
    """A session cut short (here by ^C in its second test) writes no file: its longest tests would
    read as short. A path in a missing folder is a usage error before any test runs."""
    (tmp_path / "test_i.py").write_text("def test_a():\n    pass\n"
                                        "def test_b():\n    raise KeyboardInterrupt\n"
                                        "def test_c():\n    pass\n")
    env = dict(os.environ, MINFERENCE_HYPOTHESIS_PROFILE="ci")

    def pytest_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    cut = pytest_run("--save-durations", "d.json", "test_i.py")
    assert cut.returncode == 2 and not (tmp_path / "d.json").exists(), cut.stdout[-2000:]
    assert "test durations not written to d.json: the session did not run to its end (exit status 2)" in cut.stdout
    missing = pytest_run("--save-durations", "nodir/d.json", "test_i.py")
    assert missing.returncode == 4 and "test_a" not in missing.stdout, missing.stdout[-2000:]
    assert f"--save-durations nodir/d.json: no folder {tmp_path / 'nodir'}" in missing.stderr
