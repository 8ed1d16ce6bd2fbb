import zlib  # noqa: F401  (before paddle: Paddle 2.6 clashes with zlib)

import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

import paddle_mgrad
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


@pytest.fixture(autouse=True)
def _clean_state():
    """Every test starts from unpatched Paddle, fixed seeds, grad on, AMP off."""
    paddle_mgrad.disable()
    paddle.seed(1234)
    np.random.seed(1234)
    paddle.set_device("cpu")
    yield
    paddle_mgrad.disable()

