"""The ``probe`` mark, kept true: a pytest plugin (tests/conftest.py registers it).

Most of the unit suite's time is spent in the tests that start a process: a build of the op, a
fresh interpreter (a crash probe, what an import or the ``.pth`` hook does, a script), a
launcher.  They carry ``@pytest.mark.probe``: ``nox -s tests`` runs the others (``-m "not
probe"``: minutes for both Paddle versions), ``nox -s probes`` these, CI both, a bare ``pytest``
all.  A test without the mark that starts a process -- itself or through a fixture -- fails,
naming the command, so the fast session never grows slow behind anyone's back.

Processes are seen through Python's audit events (``sys.addaudithook``: every subprocess,
``os.system``, ``posix_spawn`` and ``fork`` raises one), not by patching ``subprocess``.
Imports nothing but pytest: ``python -m pytest -p process_starts`` loads it alone.
"""

import os
import sys

import pytest

PROBE = "probe"
# What any test may start: tools, and questions to any tool, that answer in milliseconds.
QUICK_TOOLS = {
    "git": "the docs checks list the checkout's files",
    "nm": "the op library's exported symbols",
    "lscpu": "Paddle 2.6 runs it when a test first imports its auto_parallel topology module",
}
QUICK_QUESTIONS = {
    ("--version",): "a compiler's version (part of the op's build key, the doctor's report)",
    ("--list-gpu-code",): "the GPU targets an nvcc can build (the CUDA build's discovery)",
}
EVENTS = frozenset(("subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.fork"))


class _Watch:
    """What the running test has started (while ``on``)."""

    on = False
    started: list = []
    hooked = False


def _audit(event, args):
    if _Watch.on and event in EVENTS:
        command = _command(event, args)
        if (
            os.path.basename(command[0]) not in QUICK_TOOLS
            and tuple(command[1:]) not in QUICK_QUESTIONS
        ):
            _Watch.started.append(" ".join(command)[:200])


def _command(event, args):
    """The argv (or what stands for it) of an audited process start."""
    if event == "subprocess.Popen":  # (executable, args, cwd, env)
        argv = args[1]
        argv = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv)
        return [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in argv]
    if event == "os.fork":
        return ["fork()"]
    if event == "os.system":
        return os.fsdecode(args[0]).split() or [""]
    return [os.fsdecode(args[0])]  # posix_spawn, spawn: (path, argv, env)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{PROBE}: starts a process -- a build, a fresh interpreter (crash probes, import-time "
        "behaviour), a launcher: `nox -s probes` runs these, `nox -s tests` the others "
        "(tests/process_starts.py)",
    )
    if not _Watch.hooked:  # (once per process: an audit hook cannot be removed; off between tests)
        sys.addaudithook(_audit)
        _Watch.hooked = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Watch what an unmarked test starts, its fixtures' setup and teardown included."""
    _Watch.started = []
    _Watch.on = item.get_closest_marker(PROBE) is None
    try:
        yield
    finally:
        _Watch.on = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and _Watch.started and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} starts a process ({_Watch.started[0]}) and is not marked "
            f"@pytest.mark.{PROBE}: mark it (docs/development.md#probes)"
        )
