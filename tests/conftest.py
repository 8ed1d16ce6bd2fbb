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
TESTS = os.path.dirname(os.path.abspath(__file__))


def run_probe_script(name, *args, timeout=300):
    """``python tests/<name> args...`` in a fresh interpreter, this checkout first on
    PYTHONPATH (crash probes: a signal shows as a negative return code, not a dead suite)."""
    path = [os.path.dirname(TESTS)] + [
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



def bench_module():
    """benchmarks/gpu/bench_wgrad_gpu.py, loaded by path (it is a script, not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "bench_wgrad_gpu.py")
    spec = importlib.util.spec_from_file_location("bench_wgrad_gpu_for_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def capi(tmp_path_factory):
    """The C ABI of the shipped op module (the GPU path's decisions, the fake host and the fake
    GPU are compiled into every build); built with the benchmark's g++ line when the op is not
    built here."""
    from paddle_mgrad import ops
    from paddle_mgrad.ops import _build

    g = bench_module()
    module = ops.load()
    path = _build.library_path(module) if module is not None else \
        g.build(str(tmp_path_factory.mktemp("capi")), cuda=False)
    return g.Core(path, cuda=False)
