"""
Tests of the harness in conftest.py: a test that hangs fails at its time limit, and every process it started
ends with it, those its processes started in sessions of their own (as torchrun starts its workers) included; the
progress line a long test writes leaves what the test prints where the test sends it.
"""

import os
import re
import sys

from conftest import HERE, run

HANGING = '''
import contextlib, io, os, sys, time
import pytest
import conftest
from conftest import run_ranks, start

WORKER = """
import os, time
os.setsid()  # a session of its own, as torchrun starts its workers
open(os.path.join(os.environ["PIDS"], "worker"), "w").write(str(os.getpid()))
time.sleep(1000)
"""


def _rank(rank, world_size):
    return rank


def _hanging_rank(rank, world_size):
    open(os.path.join(os.environ["PIDS"], f"rank_{rank}"), "w").write(str(os.getpid()))
    time.sleep(1000)


def test_ranks_start():  # the first ranks start the server they fork from: seconds, which the next test should not pay
    assert run_ranks(2, _rank) == [0, 1]


@pytest.mark.limit(2)
def test_ranks_that_hang():
    run_ranks(2, _hanging_rank)


@pytest.mark.limit(2)
def test_a_launcher_whose_worker_hangs():
    launcher = start([sys.executable, "-c", "import subprocess, sys, time; "
                      f"subprocess.Popen([sys.executable, '-c', {WORKER!r}]); time.sleep(1000)"])
    open(os.path.join(os.environ["PIDS"], "launcher"), "w").write(str(launcher.pid))
    launcher.wait()


@pytest.fixture
def ticking(monkeypatch):  # set before the test's call starts its progress line
    monkeypatch.setattr(conftest, "TICK", 0.05)


def test_what_a_test_prints_into_its_own_stdout_stays_there(ticking):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # as train_rank does
        time.sleep(0.5)  # the progress line is written meanwhile, several times
        print("printed")
    assert printed.getvalue() == "printed\\n"
'''


def test_a_hanging_test_fails_at_its_limit_and_its_processes_end(tmp_path):
    """Two tests that hang, limited to 2 s: rank processes asleep in run_ranks, and a launcher whose worker, in a
    session of its own, sleeps. Each fails once its 2 s are up, naming its limit, and when they have failed no
    process either started is running. Beside them, a test that redirects its stdout while the progress line is
    written keeps what it printed."""
    (tmp_path / "test_hanging.py").write_text(HANGING)
    pids = tmp_path / "pids"
    pids.mkdir()
    status, output, _ = run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                             "--durations=0", "test_hanging.py"], cwd=tmp_path, timeout=60,
                            env=dict(os.environ, PYTHONPATH=HERE, PIDS=str(pids)))
    assert status == 1 and "2 failed, 2 passed" in output, output[-3000:]
    for name in ("test_ranks_that_hang", "test_a_launcher_whose_worker_hangs"):
        assert f"{name} ran past its limit of 2 s; its processes are ended" in output, output[-3000:]
        seconds = float(re.search(rf"^([\d.]+)s call +test_hanging.py::{name}$", output, re.M).group(1))
        assert 2 <= seconds < 6, (name, seconds)  # failed at its limit, its processes ended at once
    started = sorted(os.listdir(pids))
    assert started == ["launcher", "rank_0", "rank_1", "worker"], started
    for name in started:
        pid = (pids / name).read_text()
        if os.path.exists(f"/proc/{pid}"):  # gone, or a zombie whose parent has not reaped it yet
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "Z", name
