"""Build and load the C++ op with ``paddle.utils.cpp_extension``.

Flags, sources and CUDA toolkit discovery live in :mod:`.build_config` (Paddle-free, shared with
``benchmarks/gpu/``); this module adds what needs Paddle and does the building.

Where the build goes:

1. ``paddle_mgrad/_prebuilt/<key>/`` when the wheel was built with
   ``PADDLE_MGRAD_BUILD_OPS=1`` (ahead of time),
2. otherwise ``$PADDLE_MGRAD_CACHE`` or ``~/.cache/paddle_mgrad`` ``/<key>/``,
   compiled on first use (JIT, ~10 s once, ~1 s to reload).

``<key>`` hashes everything that changes the binary: Paddle's version and
commit, CUDA or not, the Python ABI, compiler flags (toolkit paths included) and the sources.
A file lock serialises concurrent builds (e.g. the ranks of a data-parallel launch).

Tiers: with a CUDA Paddle and a complete toolkit the module is built with the CUDA part; when the
toolkit is incomplete, or that build fails, the CPU-only module is built instead and the reason is
returned (``load_op_module``) for one warning.  A failed CUDA build leaves ``.failed`` in its
key directory so later processes do not retry it (delete the directory to retry).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import sys
import sysconfig

from .._compat import paddle
from ..env import get as env_get
from . import build_config as bc

log = logging.getLogger("paddle_mgrad")
OP_PREFIX = "paddle_mgrad_ops"
# The Paddle module: CPU core + binding + the C ABI (lets a no-GPU check call the shipped
# binary's CUDA entry point through ctypes); CUDA sources added when built with CUDA.
CORE_SOURCES = bc.CORE_SOURCES + bc.PADDLE_SOURCES + bc.CAPI_SOURCES
HEADERS = bc.HEADERS
CUDA_SOURCES = bc.CUDA_SOURCES
_toolkit = {}


def csrc_dir() -> str:
    return bc.csrc_dir()


def paddle_libs_dir() -> str:
    return os.path.join(os.path.dirname(paddle.__file__), "libs")


def has_onednn() -> bool:
    return os.path.exists(os.path.join(paddle_libs_dir(), "libdnnl.so.3"))


def want_cuda() -> bool:
    """Paddle is built with CUDA and the user did not opt out (PADDLE_MGRAD_NO_CUDA=1)."""
    return paddle.is_compiled_with_cuda() and not env_get("PADDLE_MGRAD_NO_CUDA")


def cuda_toolkit() -> bc.CudaToolkit:
    """The CUDA toolkit for our build (found once per process and environment)."""
    env = tuple(os.environ.get(k, "") for k in ("CUDA_HOME", "CUDA_PATH", "PATH"))
    if env not in _toolkit:
        # Paddle 2.6's paddle/extension.h under PADDLE_WITH_CUDA includes thrust
        _toolkit[env] = bc.find_cuda(need_thrust=True)
    return _toolkit[env]


def with_cuda() -> bool:
    """Build the CUDA part: CUDA Paddle, not opted out, and a complete toolkit."""
    return want_cuda() and cuda_toolkit().ok


def build_config(cuda=None):
    """(sources, cxx flags, ld flags, nvcc flags) for the Paddle module; ``cuda`` defaults to
    :func:`with_cuda`."""
    cuda = with_cuda() if cuda is None else cuda
    cflags = list(bc.CXX_FLAGS)
    ldflags = list(bc.LD_FLAGS)
    if has_onednn() and not env_get("PADDLE_MGRAD_NO_ONEDNN"):
        libs = paddle_libs_dir()
        cflags.append(bc.ONEDNN_DEFINE)
        ldflags += [f"-L{libs}", "-l:libdnnl.so.3", f"-Wl,-rpath,{libs}"]
    sources = list(CORE_SOURCES)
    nvcc = []
    if cuda:
        tk = cuda_toolkit()
        incs = [f"-I{d}" for d in tk.include_dirs]
        cflags += [bc.CUDA_DEFINE] + incs
        sources += CUDA_SOURCES
        nvcc = list(bc.NVCC_FLAGS) + incs
        ldflags += tk.link_args()
    return sources, cflags, ldflags, nvcc


def build_key(cuda=None) -> str:
    sources, cflags, ldflags, nvcc = build_config(cuda)
    h = hashlib.sha256()
    commit = getattr(getattr(paddle, "version", None), "commit", "")
    cuda = with_cuda() if cuda is None else cuda
    tk_version = str(cuda_toolkit().version) + (cuda_toolkit().home or "") if cuda else ""
    for part in (paddle.__version__, commit, str(paddle.is_compiled_with_cuda()), tk_version,
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
    return env_get("PADDLE_MGRAD_CACHE") or os.path.join(
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


@contextlib.contextmanager
def _cuda_home(home):
    """Paddle's JIT runs ``setup.py`` in a subprocess that takes nvcc (and the include/lib dirs
    it adds itself, and the ``-lcudart`` it links) from ``$CUDA_HOME``, else from ``which nvcc``
    (wrong for a wrapper script such as /usr/local/bin/nvcc): point it at our toolkit."""
    old = os.environ.get("CUDA_HOME")
    os.environ["CUDA_HOME"] = home
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_HOME", None)
        else:
            os.environ["CUDA_HOME"] = old


def _load(directory, key, cuda, verbose=False):
    from paddle.utils.cpp_extension import load

    sources, cflags, ldflags, nvcc = build_config(cuda)
    src = csrc_dir()
    home = contextlib.nullcontext()
    if cuda:
        tk = cuda_toolkit()
        shims = tk.link_shims()  # e.g. libcudart.so for Paddle's -lcudart when only .so.12 exists
        if shims:
            link_dir = os.path.join(directory, "cuda-link")
            os.makedirs(link_dir, exist_ok=True)
            for name, target in shims.items():
                path = os.path.join(link_dir, name)
                if not os.path.lexists(path):
                    os.symlink(target, path)
            ldflags = [f"-L{link_dir}"] + ldflags
        home = _cuda_home(tk.home)
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
    with home:
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


def _load_keyed(cuda):
    """Load the build for one configuration (prebuilt, cached, or compile now); raises."""
    key = build_key(cuda)
    pre = os.path.join(prebuilt_root(), key)
    if os.path.exists(os.path.join(pre, ".complete")):
        try:
            return _import_built(pre, key)
        except Exception as e:  # e.g. read-only site-packages: fall back to the user cache
            log.info("paddle_mgrad: prebuilt op in %s not usable (%s); using the JIT cache", pre, e)
    directory = os.path.join(cache_root(), key)
    with _locked(directory):
        failed = os.path.join(directory, ".failed")
        if os.path.exists(failed):  # this exact configuration failed before: do not retry
            with open(failed) as f:
                raise RuntimeError(f"{f.read()} (earlier build; delete {directory} to retry)")
        if os.path.exists(os.path.join(directory, ".complete")):
            try:
                return _import_built(directory, key)
            except Exception as e:
                log.warning("paddle_mgrad: cached op in %s did not load (%s); rebuilding", directory, e)
        log.warning("paddle_mgrad: compiling the fused weight-gradient op%s (once per "
                    "Paddle version/source change, ~10-60 s) into %s",
                    " with CUDA" if cuda else "", directory)
        try:
            module = _load(directory, key, cuda)
        except Exception as e:
            if cuda:
                with open(failed, "w") as f:
                    f.write(f"{type(e).__name__}: {e}"[-1500:])
            raise
        open(os.path.join(directory, ".complete"), "w").close()
    return module


def library_path(module) -> str:
    """The shared library behind a loaded op module (its C entry points can be used via ctypes)."""
    d = os.path.dirname(module.__file__)
    libs = sorted(glob.glob(os.path.join(d, "*.so")))
    if not libs:
        raise FileNotFoundError(f"no shared library next to {module.__file__}")
    return libs[0]


def load_op_module():
    """Load (building if needed) the op module; raises when even the CPU build fails.

    Returns ``(module, cuda_problem)``: ``cuda_problem`` is None when the module has our CUDA
    part or Paddle has no CUDA; else one line saying why the CUDA part is missing (incomplete
    toolkit: what and how to install it; or the failed CUDA build's error).
    """
    problem = None
    if want_cuda():
        tk = cuda_toolkit()
        if tk.ok:
            try:
                return _load_keyed(True), None
            except Exception as e:
                problem = f"building its CUDA part with {tk.summary()} failed: " \
                          f"{type(e).__name__}: {e}".strip()[-1500:]
        else:
            problem = tk.problem()
    return _load_keyed(False), problem


def build_into(root):
    """Ahead-of-time build (setup.py with PADDLE_MGRAD_BUILD_OPS=1)."""
    cuda = with_cuda()
    key = build_key(cuda)
    directory = os.path.join(root, key)
    with _locked(directory):
        _load(directory, key, cuda, verbose=True)
        open(os.path.join(directory, ".complete"), "w").close()
    return directory
