"""paddle_mgrad/ops/_parallel_setup.py: the op's sources compile concurrently (Paddle 2.6's
BuildExtension compiles them one by one), CUDA sources first and alone, the first error raised
after every started compile has finished.  A fake compiler stands in for gcc here; every real
build of the suite (tests/ops/test_build.py and others) goes through the same script."""

import threading
import time

import pytest

from paddle_mgrad.ops import _parallel_setup as ps
from paddle_mgrad.ops._compiler import _PARALLEL_SETUP

ccompiler = ps.ccompiler  # setuptools' distutils, imported the way the script does


class FakeCompiler(ccompiler.CCompiler):
    """distutils' own bookkeeping (_setup_compile, object names); ``_compile`` only records."""

    compiler_type = "fake"
    src_extensions = [".cc", ".cu"]
    obj_extension = ".o"
    executables = {}

    def __init__(self, work):
        super().__init__()
        self.work = work  # src -> callable run inside _compile
        self.log = []
        self.lock = threading.Lock()
        self.running = 0

    def _compile(self, obj, src, ext, cc_args, extra_postargs, pp_opts):
        with self.lock:
            self.running += 1
            self.log.append(("start", src, self.running))
        try:
            self.work.get(src, lambda: time.sleep(0.01))()
        finally:
            with self.lock:
                self.running -= 1
                self.log.append(("end", src, self.running))


def _compile(compiler, sources, tmp_path):
    return ps.compile_concurrently(compiler, sources, output_dir=str(tmp_path))


def test_cpp_sources_compile_at_the_same_time_after_the_cuda_ones_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    both = threading.Barrier(3, timeout=20)  # passes only if three C++ compiles run at once
    fake = FakeCompiler({s: both.wait for s in ("b.cc", "c.cc", "d.cc")})
    objects = _compile(fake, ["a.cu", "b.cc", "c.cc", "d.cc", "e.cu"], tmp_path)
    assert [o.rsplit("/", 1)[-1] for o in objects] == ["a.o", "b.o", "c.o", "d.o", "e.o"]
    starts = [src for what, src, _ in fake.log if what == "start"]
    assert starts[:2] == ["a.cu", "e.cu"], fake.log
    assert fake.log[:4] == [
        ("start", "a.cu", 1),
        ("end", "a.cu", 0),
        ("start", "e.cu", 1),
        ("end", "e.cu", 0),
    ], fake.log
    assert max(n for what, _, n in fake.log if what == "start") == 3, fake.log


def test_first_error_is_raised_once_every_compile_has_ended(tmp_path, monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "2")
    slow_started, slow_done = threading.Event(), threading.Event()

    def fail():
        assert slow_started.wait(20)  # fails while the other compile is running
        raise ccompiler.CompileError("b.cc: error: expected ';'")

    def slow():
        slow_started.set()
        time.sleep(0.3)
        slow_done.set()

    fake = FakeCompiler({"b.cc": fail, "c.cc": slow})
    with pytest.raises(ccompiler.CompileError, match="b.cc: error"):
        _compile(fake, ["b.cc", "c.cc", "d.cc", "e.cc"], tmp_path)
    assert slow_done.is_set()  # the other compiler was waited for, not orphaned
    assert fake.running == 0
    # nothing queued started after the failure: the error is the build's last output
    assert sorted(src for what, src, _ in fake.log if what == "start") == ["b.cc", "c.cc"], fake.log


@pytest.mark.parametrize(
    "value,expected",
    [
        ("4", 4),
        ("1", 1),
        ("99999999999999999999", 7),
        ("0", None),
        ("-2", None),
        ("two", None),
        ("", None),
        (" 3 ", 3),
    ],
)
def test_max_jobs_is_honoured_when_it_is_a_positive_integer(value, expected):
    n = ps.workers(7, {"MAX_JOBS": value})
    if expected is None:  # not a positive integer: the CPUs this process may use, at most 7
        assert n == ps.workers(7, {})
    else:
        assert n == expected
    assert 1 <= ps.workers(1, {"MAX_JOBS": value}) == 1


def test_the_compiler_runs_the_script_that_ships_in_the_package():
    import os

    assert os.path.isfile(_PARALLEL_SETUP) and _PARALLEL_SETUP == ps.__file__.replace(".pyc", ".py")
