"""What test modules share: where the checkout and the test helpers are, which Paddle major runs
the suite, and a probe script in a fresh interpreter.  Test files import it by name (``tests/`` is
on ``sys.path`` once pytest has loaded ``tests/conftest.py``); conftest.py itself holds only
fixtures and hooks, because pytest imports every ``conftest.py`` under the module name
``conftest`` and the last one loaded wins."""
import os
import subprocess
import sys
import zlib  # noqa: F401  (before paddle: Paddle 2.6 clashes with zlib)

from paddle_mgrad._compat import IS_PADDLE_2

PADDLE2 = IS_PADDLE_2
TESTS = os.path.dirname(os.path.abspath(__file__))  # the shared helpers live here
ROOT = os.path.dirname(TESTS)  # the checkout


def run_probe_script(name, *args, timeout=300):
    """``python tests/<name> args...`` in a fresh interpreter, this checkout first on
    PYTHONPATH (crash probes: a signal shows as a negative return code, not a dead suite)."""
    path = [ROOT] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return subprocess.run([sys.executable, os.path.join(TESTS, name), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)))
