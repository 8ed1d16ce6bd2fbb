"""The suite's fixtures and hooks (and nothing a test module imports: shared names live in
helpers.py, because pytest imports every ``conftest.py`` under the one module name ``conftest``)."""

import importlib.util
import os
import shutil
import tempfile
import zlib  # noqa: F401  (before paddle: Paddle 2.6 clashes with zlib)

import numpy as np
import paddle
import pytest

import paddle_mgrad
import process_starts
from helpers import TESTS
from paddle_mgrad.autograd import passes

# ------------------------------------------------------------------ families needing a package
# tests/nlp, tests/formers and the 2-rank hybrid-parallel runs train with PaddleNLP or
# PaddleFormers, which ``nox -s tests`` does not install (their own sessions do, with pins).
# Where the package is not installed, each family is one skip naming it and its session -- its
# modules are not imported, so no "No module named ..." per file.  A package that is installed
# but fails to import is not skipped: the module's own import shows that error.
NEEDS_PACKAGE = {  # path under tests/ (a directory or one file) -> (package, what installs it)
    "nlp": ("paddlenlp", "nox -s nlp"),
    "formers": ("paddleformers", "nox -s formers"),
    os.path.join("fleet", "launch", "test_hybrid_parallel.py"): ("paddlenlp", "nox -s fleet"),
    os.path.join("fleet", "launch", "test_llm_script_parallel.py"): ("paddlenlp", "nox -s fleet"),
}


class _NeedsPackage(pytest.Module):
    """A test module of a family whose package is not installed: collected as one skip."""

    reason = ""

    def collect(self):
        pytest.skip(self.reason)


def pytest_pycollect_makemodule(module_path, parent):
    rel = os.path.relpath(str(module_path), TESTS)
    for where, (package, session) in NEEDS_PACKAGE.items():
        if (rel == where or rel.startswith(where + os.sep)) and importlib.util.find_spec(
            package
        ) is None:
            module = _NeedsPackage.from_parent(parent, path=module_path)
            module.reason = (
                f"tests/{where.replace(os.sep, '/')} needs {package}, not installed "
                f"(`{session}` installs it with its pins)"
            )
            return module
    return None


# ------------------------------------------------------------------ pytest-xdist
# ``nox -s tests`` runs the suite on both cores (``-n 2``).  Each worker is a separate process
# with its own op cache, its own basetemp (pytest-of-<user>/pytest-N/popen-gwK) and OS-assigned
# ports; nothing a test writes is shared between workers.  The op the suite runs on is built
# once, by the controller, before the workers start (not twice, and not by one worker while the
# other waits on the cache lock); each worker gets a private copy of that verified build.
HEAVY = "heavy"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{HEAVY}: a real build of the op or a nested suite (~20-60 s): scheduled "
        "first, spread over the xdist workers (see pytest_collection_modifyitems)",
    )
    config.pluginmanager.register(process_starts, "process_starts")
    if getattr(config, "workerinput", None) is not None:
        _private_worker_cache(config)
    elif not config.option.collectonly:
        from paddle_mgrad import ops

        # the controller (or the one process): build the suite's op once (kept in the cache
        # after), and the test library (the capi fixture's) -- before any test, so that no
        # test but a probe starts the compiler
        ops.load()
        _bench_module_core()


def _private_worker_cache(config):
    """Point this worker's PADDLE_MGRAD_CACHE at a new private directory holding a copy of the
    build the controller made (what every test that only needs *a* build loads); subprocesses
    inherit it.  Removed when the worker ends."""
    from paddle_mgrad.ops import _build

    worker = config.workerinput["workerid"]
    cache = tempfile.mkdtemp(prefix=f"paddle_mgrad-op-cache-{worker}-")
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    for key in sorted(_build._current_keys()):  # the CPU build (+ the CUDA one on a CUDA wheel)
        key_dir = os.path.join(_build.cache_root(), key)
        if any(os.path.lexists(os.path.join(key_dir, m)) for m in (_build.MARKER, _build.FAILED)):
            shutil.copytree(key_dir, os.path.join(cache, key), symlinks=True)
    for name in os.listdir(_build.cache_root()) if os.path.isdir(_build.cache_root()) else ():
        if name.startswith("capi-test-"):  # the test library (the capi fixture's)
            shutil.copytree(os.path.join(_build.cache_root(), name), os.path.join(cache, name))
    os.environ["PADDLE_MGRAD_CACHE"] = cache


# Families that train through launches and scripts of their own (their sessions: nox -s nlp,
# fleet, nlp_fleet, nlp272, formers): every test there may start a process.
PROBE_FAMILIES = ("nlp", "formers", os.path.join("fleet", "launch"))


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item):
    rel = os.path.relpath(str(item.path), TESTS)
    if any(rel == d or rel.startswith(d + os.sep) for d in PROBE_FAMILIES):
        item.add_marker(process_starts.PROBE)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``--dist worksteal``), order the tests so that each worker's first
    share starts with its part of the ``heavy`` ones.  worksteal hands worker k the next
    ``remaining // (workers - k)`` tests of this order, then lets an idle worker take the tail
    of a busy one's queue: the long tests overlap instead of one core finishing them alone, and
    tests that share a module-scoped fixture (``xdist_group``, e.g. one AOT install) stay in one
    worker's queue, in order.  (pytest 9.2 drops ``--dist loadgroup``'s grouping silently:
    pytest-xdist issue 1386.)  Without xdist the order is the files' own."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    units = {}  # heavy tests by xdist_group (a group is dealt as one unit), in collection order
    for item in items:
        if item.get_closest_marker(HEAVY) is not None:
            group = item.get_closest_marker("xdist_group")
            key = (
                (group.args[0] if group.args else group.kwargs.get("name", "default"))
                if group is not None
                else item.nodeid
            )
            units.setdefault(key, []).append(item)
    if not units:
        return
    heavy = {id(i) for unit in units.values() for i in unit}
    light = [i for i in items if id(i) not in heavy]
    workers = int(workerinput.get("workercount", 1))
    lanes = [[] for _ in range(workers)]
    for n, unit in enumerate(units.values()):
        lanes[n % workers].extend(unit)
    ordered, left = [], len(items)
    for k, lane in enumerate(lanes):
        share = left // (workers - k)  # what worksteal sends worker k first
        fill = max(0, share - len(lane))
        ordered += lane + light[:fill]
        light = light[fill:]
        left -= len(lane) + fill
    items[:] = ordered + light


@pytest.fixture(autouse=True)
def _clean_state():
    """Every test starts from unpatched Paddle, fixed seeds, grad on, AMP off -- and leaves the
    ``PADDLE_MGRAD*`` variables as it found them: paddle_mgrad reads several at every call (a
    recompute policy left behind by one test changes how every later test in the worker
    recomputes), so a test that changes one without putting it back fails here.  No node an
    earlier test's backward ran counts as consumed: on Paddle 2.6 a nested block's fused-linear
    nodes can outlive their test with no output left to tell where they are, and
    ``paddle.grad``'s check then counts them as maybe in its graph (docs/limits.md)."""
    paddle_mgrad.disable()
    with passes._consumed_lock:
        passes._consumed.clear()
    paddle.seed(1234)
    np.random.seed(1234)
    paddle.set_device("cpu")
    before = _our_variables()
    yield
    paddle_mgrad.disable()
    after = _our_variables()
    if after != before:
        os.environ.update(before)
        for name in set(after) - set(before):
            del os.environ[name]
        pytest.fail(
            f"the test changed PADDLE_MGRAD* variables and left them: {before} -> {after} "
            "(use monkeypatch.setenv/delenv)",
            pytrace=False,
        )


def _our_variables():
    return {k: v for k, v in os.environ.items() if k.startswith("PADDLE_MGRAD")}


def _bench_module():
    """benchmarks/gpu/bench_wgrad_gpu.py, loaded by path (it is a script, not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "bench_wgrad_gpu.py")
    spec = importlib.util.spec_from_file_location("bench_wgrad_gpu_for_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def capi():
    """The test library's C ABI: the op library's (the cores) plus the test-only one (the GPU
    path's decisions, the fake host and the fake GPU, the bf16 scan's kernels), which is never
    compiled into the op library users load.  Built once per key into the op cache's root
    (benchmarks/gpu/pmg_gpu_bench/build.py ``cached_cpu_library``)."""
    return _bench_module_core()


def _bench_module_core():
    from paddle_mgrad.ops import _build

    g = _bench_module()
    return g.Core(g.cached_cpu_library(_build.cache_root()), cuda=False)
