"""What test modules share: where the checkout and the test helpers are, which Paddle major runs
the suite (and which op backend it implies), and a probe script in a fresh interpreter.  Test
files import it by name (``tests/`` is on ``sys.path`` once pytest has loaded
``tests/conftest.py``); conftest.py itself holds only fixtures and hooks, because pytest imports
every ``conftest.py`` under the module name ``conftest`` and the last one loaded wins."""

import importlib
import os
import re
import subprocess
import sys
import types
import zlib  # noqa: F401  (before paddle: Paddle 2.6 clashes with zlib)

import paddle
import pytest

from paddle_mgrad import env as mgrad_env
from paddle_mgrad._compat import IS_PADDLE_2

PADDLE2 = IS_PADDLE_2
TESTS = os.path.dirname(os.path.abspath(__file__))  # the shared helpers live here
ROOT = os.path.dirname(TESTS)  # the checkout


def pip_install_target(source, target, env=None, timeout=900):
    """``pip install --no-build-isolation --no-deps --target target source`` with this
    interpreter -- a checkout installed as a user installs it, into a directory of its own (this
    venv untouched) -- and assert that it succeeded.  ``env``: the install's environment."""
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps"]
        + ["--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return target


def run_probe_script(name, *args, timeout=300):
    """``python tests/<name> args...`` in a fresh interpreter, this checkout first on
    PYTHONPATH (crash probes: a signal shows as a negative return code, not a dead suite)."""
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return subprocess.run(
        [sys.executable, os.path.join(TESTS, name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
    )


def expected_cpu_backend(environ=None):
    """The CPU tier of the op backend that a process with ``environ`` (default: this one's)
    must get on this Paddle, from what decides it and not from the op itself:
    ``"python"`` under ``PADDLE_MGRAD_OPS=python``; otherwise our C++ op, ``"cpp-onednn"``
    where Paddle says it was compiled with oneDNN (MKLDNN) and ``PADDLE_MGRAD_NO_ONEDNN`` is
    off, else ``"cpp-portable"``.  (A failed build also ends in ``"python"``: that is the
    failure this expectation exists to catch.)"""
    if mgrad_env.get("PADDLE_MGRAD_OPS", environ) == "python":
        return "python"
    if paddle.base.core.is_compiled_with_mkldnn() and not mgrad_env.get(
        "PADDLE_MGRAD_NO_ONEDNN", environ
    ):
        return "cpp-onednn"
    return "cpp-portable"


def require_cpp_op(state=None):
    """The C++ op module, for a test of what only the C++ op does.  Skips only where the op was
    switched off on purpose (``PADDLE_MGRAD_OPS=python`` when it loaded); anywhere else the op
    must have been built and loaded, and a failed build fails the test with the build's error
    instead of skipping it.  ``state``: ``{"module": ops.load(), "why": ops.fallback_reason()}``
    as a test saved it (default: load now)."""
    from paddle_mgrad import ops

    if state is None:
        state = {"module": ops.load(), "why": ops.fallback_reason()}
    if state["module"] is None and state.get("why") == "PADDLE_MGRAD_OPS=python":
        pytest.skip("PADDLE_MGRAD_OPS=python: the C++ op is switched off")
    assert state["module"] is not None, f"the C++ op did not load: {state.get('why')}"
    return state["module"]


def cpu_backend(backend):
    """The CPU tier of a backend string such as ``"cpp-onednn+cuda"`` or
    ``"cpp-portable;gpu=python"`` (on a CPU Paddle, the whole string)."""
    return re.split(r"[+;]", backend, maxsplit=1)[0]


def nonzero_biases(layer):
    """``layer`` with every bias of its sublayers drawn at random (Paddle's global generator):
    Paddle initialises biases to zeros, and a path that drops a bias, or adds it twice, gives
    the same numbers as the right one while they are."""
    for name, p in layer.named_parameters():
        if name.rsplit(".", 1)[-1] == "bias":
            p.set_value(paddle.uniform(p.shape, dtype=p.dtype, min=-0.5, max=0.5))
    return layer


def custom_state_manager():
    """Paddle 3.x's ``custom_state_manager`` (a user's generator, by get/set functions, which
    Paddle's recompute replays); skips on Paddle 2.6, which has none.  Looked up on the module:
    the package's ``recompute`` attribute is the function, which has no such attribute."""
    module = importlib.import_module("paddle.distributed.fleet.recompute.recompute")
    mgr = getattr(module, "custom_state_manager", None)
    if mgr is None:
        pytest.skip("Paddle 2.6 has no custom_state_manager (Paddle 3.x's user RNG registry)")
    return mgr


def register_counter_generator(monkeypatch):
    """Register with :func:`custom_state_manager` (undone at the test's end) a generator whose
    state is ``counter["n"]``: a draw reads it and advances it.  Returns ``counter``."""
    mgr = custom_state_manager()
    counter = {"n": 0}
    monkeypatch.setattr(mgr, "custom_get_state_func", lambda: counter["n"])
    monkeypatch.setattr(mgr, "custom_set_state_func", lambda n: counter.__setitem__("n", n))
    return counter


class StandInPlace:
    """A tensor place as the code asks it (``is_cpu_place``, ``is_gpu_place``,
    ``gpu_device_id``): the host (``cpu``), GPU ``gpu``, or neither (an XPU, a custom device) --
    for a decision about devices this machine has not."""

    def __init__(self, cpu=False, gpu=None):
        self.cpu, self.gpu = cpu, gpu

    def is_cpu_place(self):
        return self.cpu

    def is_gpu_place(self):
        return self.gpu is not None

    def gpu_device_id(self):
        return self.gpu


def tensor_on(place):
    """A stand-in tensor that has nothing but its ``place``."""
    return types.SimpleNamespace(place=place)
