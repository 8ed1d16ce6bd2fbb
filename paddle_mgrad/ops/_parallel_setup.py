"""Run Paddle's setup script for the op with the extension's sources compiled concurrently.

Usage (by :mod:`._compiler`, by path: this file imports nothing from paddle_mgrad or Paddle)::

    python _parallel_setup.py <setup file> build

Why: Paddle 3.x's ``BuildExtension`` compiles one extension's sources on a thread pool, Paddle
2.6's one after the other, through distutils' ``CCompiler.compile``.  Our op is seven translation
units; on 2.6 a JIT build on two cores took 11 s serially and ~6 s this way.  Here
``CCompiler.compile`` (the class's loop over ``self._compile``, which 2.6 replaces per instance
with its own single-file compiler) becomes a loop over a thread pool of ``$MAX_JOBS`` workers
(Paddle 3's knob), else one per CPU this process may use.  Paddle 3.x puts its own parallel
``compile`` on the class for the duration of the build, so there this changes nothing.

CUDA sources are compiled first and alone: Paddle 2.6's single-file compiler swaps the compiler
executable on the shared compiler object for a ``.cu`` file (nvcc) and restores it afterwards, so
a C++ file compiled beside it would be handed to nvcc.  The C++ files share that object only by
reading it, which is safe across threads.  After a compile error no further compile starts (the
error stays at the end of the output, where the caller's message quotes it), and the first error
is raised once every started compile has finished (no orphaned compiler writing into the build
directory).
"""

import os
import runpy
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import setuptools  # noqa: F401  (before distutils: then distutils IS setuptools' copy, Paddle's)

# isort: split
from distutils import ccompiler

CUDA_SUFFIXES = (".cu", ".cuh")


def workers(count, environ=os.environ):
    """Compile threads for ``count`` sources: ``$MAX_JOBS`` if it is a positive integer, else the
    CPUs this process may use; never more than ``count`` nor fewer than 1."""
    wanted = environ.get("MAX_JOBS", "").strip()
    if wanted.isdigit() and int(wanted) > 0:
        n = int(wanted)
    else:
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            n = os.cpu_count() or 1
    return max(1, min(n, count))


def compile_concurrently(
    self,
    sources,
    output_dir=None,
    macros=None,
    include_dirs=None,
    debug=0,
    extra_preargs=None,
    extra_postargs=None,
    depends=None,
):
    """``CCompiler.compile`` with the per-file ``self._compile`` calls on a thread pool."""
    macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs
    )
    cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)
    todo = [(obj,) + tuple(build[obj]) for obj in objects if obj in build]
    cuda = [t for t in todo if t[1].endswith(CUDA_SUFFIXES)]
    rest = [t for t in todo if not t[1].endswith(CUDA_SUFFIXES)]

    failed = threading.Event()

    def one(task):
        if failed.is_set():  # a compile failed: start no other (its error stays the last output)
            return
        obj, src, ext = task
        try:
            self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
        except BaseException:
            failed.set()
            raise

    for task in cuda:
        one(task)
    if rest:
        with ThreadPoolExecutor(max_workers=workers(len(rest))) as pool:
            futures = [pool.submit(one, task) for task in rest]
        for f in futures:  # all have finished (the with-block waited); the first error wins
            f.result()
    return objects


def main(argv):
    if len(argv) < 2:
        raise SystemExit("usage: _parallel_setup.py <setup file> <setup command>...")
    ccompiler.CCompiler.compile = compile_concurrently
    setup_file = os.path.abspath(argv[1])
    sys.argv = [setup_file] + argv[2:]
    sys.path[0] = os.path.dirname(setup_file)  # as when the setup file runs itself (not ops/)
    runpy.run_path(setup_file, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv)
