"""The ``probe`` mark is kept true (tests/process_starts.py): a test that starts a process
without it fails, through a fixture too; marked, a quick tool or a ``--version`` query, it
passes.  Run in a pytest of its own over a file of such tests."""

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import TESTS

CASES = """
import os, subprocess, sys
import pytest

def test_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_os_system():
    os.system("true")

@pytest.fixture(scope="module")
def started():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_unmarked_through_a_fixture(started):
    pass

@pytest.mark.probe
def test_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_a_quick_tool():
    subprocess.run(["git", "var", "-l"], capture_output=True)

def test_a_version_query():
    subprocess.run([sys.executable, "--version"], check=True)

def test_in_process():
    assert sum(range(4)) == 6
"""


@pytest.mark.probe
def test_a_test_that_starts_a_process_is_a_probe(tmp_path):
    (tmp_path / "test_cases.py").write_text(textwrap.dedent(CASES))
    env = dict(os.environ, PYTHONPATH=TESTS)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "process_starts", "-p", "no:cacheprovider"]
        + ["-p", "no:xdist", "-q", "-rA", "test_cases.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    failed = {
        line.split("::")[1].split()[0] for line in out.splitlines() if line.startswith("ERROR")
    }
    assert failed == {
        "test_unmarked",
        "test_unmarked_os_system",
        "test_unmarked_through_a_fixture",
    }, out
    assert f"starts a process ({sys.executable} -c pass) and is not marked" in out
    assert "7 passed, 3 errors" in out, out  # (an error at teardown, after a call that passed)
    assert "starts a process (true) and is not marked" in out
    # the mark is registered: selecting by it runs the marked test alone
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "process_starts", "-p", "no:cacheprovider"]
        + ["-p", "no:xdist", "-q", "--strict-markers", "-m", "probe", "test_cases.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "1 passed, 6 deselected" in r.stdout, r.stdout + r.stderr
