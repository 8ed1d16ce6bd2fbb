"""Build and load the C++ op with ``paddle.utils.cpp_extension``.

Where the build goes:

1. ``paddle_mgrad/_prebuilt/<key>/`` when the wheel was built with
   ``PADDLE_MGRAD_BUILD_OPS=1`` (ahead of time),
2. otherwise ``$PADDLE_MGRAD_CACHE`` or ``~/.cache/paddle_mgrad`` ``/<key>/``,
   compiled on first use (JIT, ~10 s once, ~1 s to reload).

``<key>`` hashes everything that changes the binary: Paddle's version and
commit, CUDA or not, the Python ABI, compiler flags and the sources.  A file
lock serialises concurrent builds (e.g. the ranks of a data-parallel launch).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import sysconfig

from .._compat import paddle

log = logging.getLogger("paddle_mgrad")
OP_PREFIX = "paddle_mgrad_ops"
CORE_SOURCES = ["wgrad_cpu.cc", "wgrad_op.cc"]
HEADERS = ["wgrad_core.h", "wgrad_cuda.h"]
CUDA_SOURCES = ["wgrad_cuda.cu"]


def csrc_dir() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shipped = os.path.join(here, "_csrc")  # installed package
    if os.path.isdir(shipped):
        return shipped
    return os.path.join(os.path.dirname(here), "csrc")  # source checkout


def paddle_libs_dir() -> str:
    return os.path.join(os.path.dirname(paddle.__file__), "libs")


def has_onednn() -> bool:
    return os.path.exists(os.path.join(paddle_libs_dir(), "libdnnl.so.3"))


def with_cuda() -> bool:
    return paddle.is_compiled_with_cuda() and os.environ.get("PADDLE_MGRAD_NO_CUDA", "0") == "0"


def build_config():
    cflags = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"]
    ldflags = ["-fopenmp"]
    if has_onednn() and os.environ.get("PADDLE_MGRAD_NO_ONEDNN", "0") == "0":
        libs = paddle_libs_dir()
        cflags.append("-DPMG_WITH_ONEDNN")
        ldflags += [f"-L{libs}", "-l:libdnnl.so.3", f"-Wl,-rpath,{libs}"]
    sources = list(CORE_SOURCES)
    nvcc = []
    if with_cuda():
        cflags.append("-DPMG_WITH_CUDA")
        sources += CUDA_SOURCES
        nvcc = ["-O3", "-DPMG_WITH_CUDA", "-std=c++17",
                "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                "-gencode=arch=compute_90,code=compute_90"]
        ldflags += ["-lcublasLt", "-lcublas"]
    return sources, cflags, ldflags, nvcc


def build_key() -> str:
    sources, cflags, ldflags, nvcc = build_config()
    h = hashlib.sha256()
    commit = getattr(getattr(paddle, "version", None), "commit", "")
    for part in (paddle.__version__, commit, str(paddle.is_compiled_with_cuda()),
                 sysconfig.get_config_var("SOABI") or sys.version, " ".join(cflags),
                 " ".join(ldflags), " ".join(nvcc)):
        h.update(part.encode())
    src = csrc_dir()
    for name in sorted(set(sources + HEADERS)):
        path = os.path.join(src, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def cache_root() -> str:
    return os.environ.get("PADDLE_MGRAD_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "paddle_mgrad")


def prebuilt_root() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_prebuilt")


@contextlib.contextmanager
def _locked(directory):
    os.makedirs(directory, exist_ok=True)
    import fcntl

    with open(os.path.join(directory, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _op_name(key) -> str:
    return f"{OP_PREFIX}_{key}"


def _load(directory, key, verbose=False):
    from paddle.utils.cpp_extension import load

    sources, cflags, ldflags, nvcc = build_config()
    src = csrc_dir()
    kwargs = dict(
        name=_op_name(key),
        sources=[os.path.join(src, s) for s in sources],
        extra_cxx_cflags=cflags + [f"-I{src}"],
        extra_ldflags=ldflags,
        build_directory=directory,
        verbose=verbose,
    )
    if nvcc:
        kwargs["extra_cuda_cflags"] = nvcc + [f"-I{src}"]
    return load(**kwargs)


def _import_built(directory, key):
    """Import an existing build without re-running the compiler's checks.

    The key already covers sources and flags, so a completed directory is
    current.  (``load()`` would recompile when the sources moved, e.g. from
    the build tree to site-packages for an ahead-of-time build.)
    """
    from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

    name = _op_name(key)
    return _import_module_from_library(name, os.path.join(directory, name), False)


def load_op_module():
    """Load (building if needed) the op module; raises on failure."""
    key = build_key()
    pre = os.path.join(prebuilt_root(), key)
    if os.path.exists(os.path.join(pre, ".complete")):
        try:
            return _import_built(pre, key)
        except Exception as e:  # e.g. read-only site-packages: fall back to the user cache
            log.info("paddle_mgrad: prebuilt op in %s not usable (%s); using the JIT cache", pre, e)
    directory = os.path.join(cache_root(), key)
    with _locked(directory):
        if os.path.exists(os.path.join(directory, ".complete")):
            try:
                return _import_built(directory, key)
            except Exception as e:
                log.warning("paddle_mgrad: cached op in %s did not load (%s); rebuilding", directory, e)
        log.warning("paddle_mgrad: compiling the fused weight-gradient op (once per "
                    "Paddle version/source change, ~10-30 s) into %s", directory)
        module = _load(directory, key)
        open(os.path.join(directory, ".complete"), "w").close()
    return module


def build_into(root):
    """Ahead-of-time build (setup.py with PADDLE_MGRAD_BUILD_OPS=1)."""
    key = build_key()
    directory = os.path.join(root, key)
    with _locked(directory):
        _load(directory, key, verbose=True)
        open(os.path.join(directory, ".complete"), "w").close()
    return directory
