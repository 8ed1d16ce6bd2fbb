"""Build, verify and load the C++ op with ``paddle.utils.cpp_extension``.

Flags, sources and CUDA toolkit discovery live in :mod:`.build_config` (Paddle-free, shared with
``benchmarks/gpu/``); this module adds what needs Paddle: building, the build cache, and the
checks that decide whether a cached library may be loaded at all.

Where the op comes from, in order:

1. ``paddle_mgrad/_prebuilt/<key>/`` when the wheel was built with ``PADDLE_MGRAD_BUILD_OPS=1``
   (ahead of time);
2. ``$PADDLE_MGRAD_CACHE/<key>/`` or ``~/.cache/paddle_mgrad/<key>/``, compiled on first use
   (JIT, ~10-60 s once, ~1 s to reload).

``<key>`` hashes everything that changes the binary: Paddle's version and commit, CUDA or not,
the Python ABI, compiler flags (toolkit paths included) and the sources.

A key directory is *complete* when it holds ``.complete``, a small JSON record written after the
build: the library's path relative to the key directory, its size and sha256, Paddle's version,
the key, CUDA or not, and the build time.  Before anything is loaded, every time:

* **who may write it** -- the cache root, the key directory, the directories down to the library,
  the library and the marker must be owned by the current user (or root: a system-wide read-only
  cache, or a system-wide install) and not writable by group or others, symbolic links below the
  root are refused.  An unsafe cache root is not used: the op goes to the default private cache
  (``~/.cache/paddle_mgrad``) instead, or, when that is the one refused, to the pure-Paddle
  fallback; one warning names the path, the owner/mode found and the fix.
  ``PADDLE_MGRAD_TRUST_SHARED_CACHE=1`` loads from such a cache anyway (the warning stays).
* **what it is** -- the library is opened once (``O_NOFOLLOW``), its owner and mode are checked on
  that descriptor, its size and sha256 must match the marker, and the loader then maps *that same
  file* (through ``/proc/self/fd``), so a file swapped after the check is never the one loaded.
  A truncated, empty, random or replaced library is never ``dlopen``-ed (``dlopen`` of a truncated
  file is a SIGBUS): the key is rebuilt.

Builds never touch a published key directory: the compiler runs in a fresh private directory
``<root>/.build-<key>-<random>/`` (our own ``setup.py build`` subprocess, without a shell, so
paths with spaces work), the marker is written, the modes are tightened, and the directory is
renamed into place (an existing stale one is renamed away first and deleted).  A file lock
``<root>/<key>.lock`` serialises the builders of one key (e.g. the ranks of a data-parallel
launch); a complete, verified build is loaded without the lock, so a read-only cache works.  The
builder that takes the lock first discards partial directories of its key left by a killed
build (their orphaned compiler keeps writing into a directory nobody will use).

Tiers: with a CUDA Paddle and a complete toolkit the module is built with the CUDA part; when the
toolkit is incomplete, or that build fails, the CPU-only module is built instead and the reason is
returned (``load_op_module``) for one warning.  A failed CUDA build leaves a key directory with
``.failed`` so later processes do not retry it (delete the directory to retry).

The concerns live in four modules: this one (what to build -- sources, flags, toolkit, the key --
and where to load it from), :mod:`._cache` (who may write the cache and what a key directory
holds: the checks above, the marker), :mod:`._locking` (the key's lock and what only its holder
does: discard partials, publish by rename), :mod:`._compiler` (the compiler invocation).

Directories created here are mode 0700, files are never group/world-writable; lock files and
markers are opened with ``O_NOFOLLOW`` (new ones with ``O_EXCL``).  :func:`inspect_cache` reports
the state of every key directory without loading anything (for ``python -m paddle_mgrad doctor``).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
import shutil
import sys
import sysconfig
import tempfile

from .._compat import PADDLE_COMMIT, paddle
from ..env import get as env_get
from . import build_config as bc
from ._cache import (  # (_write_new: the tests reach the cache through _build)
    _PARTIAL_RE,
    FAILED,
    MARKER,
    TRUST_ENV,
    CacheRefused,
    _chain_problems,
    _examine,
    _makedirs_private,
    _read_small,
    _security_fix,
    _tighten,
    _trusted,
    _warn_once,
    _write_marker,
    _write_new,
)
from ._compiler import compile_into
from ._inputs import RouteFacts
from ._locking import _discard_partials, _install, _locked

log = logging.getLogger("paddle_mgrad")
OP_PREFIX = "paddle_mgrad_ops"
# The Paddle module: CPU core + binding + the C ABI (lets a no-GPU check call the shipped
# binary's CUDA entry point through ctypes); CUDA sources added when built with CUDA.
CORE_SOURCES = bc.CORE_SOURCES + bc.PADDLE_SOURCES + bc.CAPI_SOURCES
HEADERS = bc.HEADERS
CUDA_SOURCES = bc.CUDA_SOURCES
_KEY_RE = re.compile(r"^[0-9a-f]{16}$")
_toolkit = {}
_api_dir = []


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


def gpu_capabilities() -> list:
    """Compute capabilities (major * 10 + minor) of the GPUs this process sees; [] without."""
    try:
        cuda = paddle.device.cuda
        return sorted(
            {
                a * 10 + b
                for a, b in (cuda.get_device_capability(i) for i in range(cuda.device_count()))
            }
        )
    except Exception:  # CPU Paddle, no driver: nothing to add
        return []


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
        # the running GPUs' capabilities go into the targets, so into the flags and the key
        nvcc = bc.nvcc_flags(bc.cuda_targets(gpu_capabilities(), tk.supported_codes())) + incs
        ldflags += tk.link_args()
    return sources, cflags, ldflags, nvcc


def build_key(cuda=None) -> str:
    sources, cflags, ldflags, nvcc = build_config(cuda)
    h = hashlib.sha256()
    cuda = with_cuda() if cuda is None else cuda
    tk_version = str(cuda_toolkit().version) + (cuda_toolkit().home or "") if cuda else ""
    for part in (
        paddle.__version__,
        PADDLE_COMMIT,
        str(paddle.is_compiled_with_cuda()),
        tk_version,
        sysconfig.get_config_var("SOABI") or sys.version,
        " ".join(cflags),
        " ".join(ldflags),
        " ".join(nvcc),
    ):
        h.update(part.encode())
    src = csrc_dir()
    for name in sorted(set(sources + HEADERS)):
        path = os.path.join(src, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def default_cache_root() -> str:
    """``~/.cache/paddle_mgrad``: the private per-user cache."""
    return os.path.join(os.path.expanduser("~"), ".cache", "paddle_mgrad")


def cache_root() -> str:
    """``$PADDLE_MGRAD_CACHE`` (``~`` expanded) or :func:`default_cache_root`."""
    root = env_get("PADDLE_MGRAD_CACHE")
    return os.path.abspath(root) if root else default_cache_root()


def prebuilt_root() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_prebuilt")


def _op_lib_rel(key) -> str:
    """Where Paddle's build puts the library, relative to the key directory."""
    name = _op_name(key)
    return f"{name}/{name}.so"


# ------------------------------------------------------------------ loading
def _private_api_dir() -> str:
    """A private directory for the Python wrapper Paddle generates per load (never in the
    cache: the cache may be read-only or shared); removed at exit."""
    if not _api_dir:
        import atexit

        d = tempfile.mkdtemp(prefix="paddle_mgrad-api-")
        atexit.register(shutil.rmtree, d, True)
        _api_dir.append(d)
    return _api_dir[0]


def _import_library(fd, path, key):
    """Register and wrap the op library open at ``fd`` (already verified): Paddle and Python
    ``dlopen`` ``/proc/self/fd/<fd>``, i.e. exactly the verified file, whatever ``path`` names
    by now.  ``module.__pmg_library__`` keeps the real path (:func:`library_path`)."""
    from paddle.utils.cpp_extension import extension_utils as eu

    name = _op_name(key)
    via = f"/proc/self/fd/{fd}"
    if not os.path.exists(via):  # no /proc: the checks above and the path (same owner rules)
        via = path
    op_names = eu.load_op_meta_info_and_register_op(via)
    module = eu._generate_python_module(name, op_names, _private_api_dir(), False)
    module.__pmg_library__ = path
    module.__pmg_fast__ = _fast_entry(via)
    return module


def _fast_entry(via):
    """The library's Python fast entry (``csrc/wgrad_pyentry.cc``: ``route``, ``linear_bwd``,
    ``wgrad_add``), or None when this Paddle lacks an accessor it needs.  ``via`` names the file Paddle just
    loaded: ``dlopen`` finds the same loaded object again."""
    import ctypes

    try:
        make = ctypes.PyDLL(via).pmg_fast_module
        make.restype = ctypes.py_object
        make.argtypes = [ctypes.py_object]
        return make(RouteFacts)
    except Exception as e:  # the op works without it (custom-op dispatch): say why, go on
        log.warning(
            "paddle_mgrad: the op library's fast entry is unavailable (%s: %s)", type(e).__name__, e
        )
        return None


def _load_verified(root, key, trusted):
    """Import ``root/key`` when it is complete, verified and safe; else raise ValueError with the
    problem (the caller rebuilds or moves on)."""
    r = _examine(root, key, keep_fd=True, trusted=trusted)
    if r["fd"] is None:
        raise ValueError(r["problem"] or "not verified")
    if r["security"]:  # only when trusted
        _warn_once(
            f"paddle_mgrad: loading the op from {r['directory']} although "
            f"{'; '.join(r['security'])}, because {TRUST_ENV}=1: anyone who can write "
            "there can run code in this process"
        )
    try:
        return _import_library(r["fd"], r["library"], key)
    except Exception as e:  # e.g. a library it links moved: the caller rebuilds once
        raise ValueError(f"the library did not load ({type(e).__name__}: {e})"[:1500]) from None
    finally:
        os.close(r["fd"])


def _import_built(directory, key):
    """Import a complete, verified build in ``directory`` (raises ValueError otherwise)."""
    return _load_verified(os.path.dirname(os.path.abspath(directory)), key, _trusted())


# ------------------------------------------------------------------ building
def _compile(build_dir, key, cuda, verbose=False):
    """Compile the op for ``key`` into ``build_dir`` (:func:`._compiler.compile_into`) with this
    configuration's sources and flags (:func:`build_config`) and, for ``cuda``, its toolkit."""
    compile_into(
        build_dir,
        _op_name(key),
        build_config(cuda),
        csrc_dir(),
        cuda_toolkit() if cuda else None,
        verbose,
    )


def _build_install(root, key, cuda, verbose=False):
    """Compile into a fresh private ``root/.build-<key>-*``, write the marker, tighten modes,
    rename into ``root/key``.  The caller holds the key's lock."""
    root = os.path.abspath(root)  # the compiler runs with the build directory as cwd
    build_dir = tempfile.mkdtemp(prefix=f".build-{key}-", dir=root)
    try:
        try:
            _compile(build_dir, key, cuda, verbose)
        except RuntimeError as e:
            raise RuntimeError(
                f"building the op for {os.path.join(root, key)} (in {build_dir}): {e}\nFix the "
                "cause above and start again (a failed CPU build is not cached); "
                "PADDLE_MGRAD_OPS=python uses the fallback without building"
            ) from None
        _tighten(build_dir)
        _write_marker(build_dir, key, _op_lib_rel(key), cuda)
        return _install(build_dir, root, key)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise


def _install_failed(root, key, message):
    """Publish ``root/key`` holding only ``.failed`` (this configuration is not retried)."""
    d = tempfile.mkdtemp(prefix=f".build-{key}-", dir=root)
    _write_new(os.path.join(d, FAILED), message)
    _install(d, root, key)


def _load(directory, key, cuda, verbose=False):
    """Build ``key`` into a fresh directory, publish it as ``directory`` (= ``<root>/<key>``) and
    import it (verified like any cached build).  The caller holds the key's lock."""
    root = os.path.dirname(directory)
    _build_install(root, key, cuda, verbose)
    try:
        return _load_verified(root, key, _trusted())
    except ValueError as e:
        raise RuntimeError(
            f"the op just built in {directory} cannot be used: {e}. Fix: delete "
            f"{directory} and start again; PADDLE_MGRAD_OPS=python uses the "
            "fallback without building"
        ) from None


def _failed_message(directory) -> str | None:
    path = os.path.join(directory, FAILED)
    if not os.path.lexists(path):
        return None
    try:
        text, _ = _read_small(path)
    except OSError as e:
        text = f"(unreadable .failed: {e.strerror})"
    return f"{text.strip()} (earlier build; delete {directory} to retry)"


def _candidate_roots() -> list:
    roots = [cache_root()]
    default = default_cache_root()
    if os.path.realpath(default) != os.path.realpath(roots[0]):
        roots.append(default)
    return roots


def _load_from_root(root, key, cuda, trusted):
    """Load ``key`` from the cache ``root`` (building it if needed); raises CacheRefused when
    this root cannot be used at all, other exceptions when the build fails."""
    try:
        _makedirs_private(root)
    except OSError as e:
        raise CacheRefused(
            f"cannot create the cache directory {root} ({e.strerror}). Fix: point "
            "PADDLE_MGRAD_CACHE at a writable directory of your own"
        ) from None
    unsafe = _chain_problems(root, [])
    if unsafe and not trusted:  # (trusted: _load_verified warns, once, naming all of it)
        raise CacheRefused(
            f"not loading the op from the cache {root}: {'; '.join(unsafe)} -- "
            "anyone who can write there could run code in this process. " + _security_fix(unsafe)
        )
    directory = os.path.join(root, key)
    if cuda:
        failed = _failed_message(directory)
        if failed:
            raise RuntimeError(failed)
    stale = None
    if os.path.lexists(os.path.join(directory, MARKER)):
        try:  # the fast path: no lock, nothing written (a read-only cache works)
            return _load_verified(root, key, trusted)
        except ValueError as e:
            stale = str(e)
    with _locked(root, key):
        if cuda:
            failed = _failed_message(directory)
            if failed:
                raise RuntimeError(failed)
        if os.path.lexists(os.path.join(directory, MARKER)):
            try:  # another process may have built it while we waited
                return _load_verified(root, key, trusted)
            except ValueError as e:
                stale = str(e)
        _discard_partials(root, key)
        log.warning(
            "paddle_mgrad: compiling the fused weight-gradient op%s (once per "
            "Paddle version/source change, ~10-60 s) into %s%s",
            " with CUDA" if cuda else "",
            directory,
            f" (rebuilding: {stale})" if stale else "",
        )
        try:
            return _load(directory, key, cuda)
        except Exception as e:
            if cuda:
                _install_failed(root, key, f"{type(e).__name__}: {e}"[-1500:])
            raise


def _load_keyed(cuda):
    """Load the build for one configuration (prebuilt, cached, or compile now); raises."""
    key = build_key(cuda)
    trusted = _trusted()
    pre_root = prebuilt_root()
    pre = os.path.join(pre_root, key)
    if os.path.lexists(os.path.join(pre, MARKER)):
        try:
            return _load_verified(pre_root, key, trusted)
        except ValueError as e:
            _warn_once(
                f"paddle_mgrad: not loading the prebuilt op in {pre}: {e}. Fix: reinstall "
                "paddle_mgrad (PADDLE_MGRAD_BUILD_OPS=1 pip install ...) or delete that "
                "directory; the op is built in the JIT cache instead"
            )
    refused = []
    for root in _candidate_roots():
        try:
            module = _load_from_root(root, key, cuda, trusted)
        except CacheRefused as e:
            refused.append(str(e))
            continue
        if refused:
            _warn_once("paddle_mgrad: " + " ".join(refused) + f" Using {root} instead.")
        return module
    raise CacheRefused(" ".join(refused))


def _op_name(key) -> str:
    return f"{OP_PREFIX}_{key}"


def library_path(module) -> str:
    """The shared library behind a loaded op module (its C entry points can be used via ctypes)."""
    lib = getattr(module, "__pmg_library__", None)
    if lib:
        return lib
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
                problem = (
                    f"building its CUDA part with {tk.summary()} failed: "
                    f"{type(e).__name__}: {e}".strip()[-1500:]
                )
        else:
            problem = tk.problem()
    return _load_keyed(False), problem


def build_into(root):
    """Ahead-of-time build (setup.py with PADDLE_MGRAD_BUILD_OPS=1) into ``root/<key>``, with the
    same completion record as the JIT cache (the installed copy is verified the same way)."""
    cuda = with_cuda()
    key = build_key(cuda)
    _makedirs_private(root)
    return _build_install(root, key, cuda, verbose=True)


def _current_keys() -> set:
    keys = {build_key(False)}
    try:
        if with_cuda():
            keys.add(build_key(True))
    except Exception:  # toolkit discovery trouble: the CPU key is what would load
        pass
    return keys


def inspect_cache(root=None) -> list:
    """The state of every key directory, for ``python -m paddle_mgrad doctor``; loads nothing.

    Looks at the cache root (``root``, default :func:`cache_root`) and at the prebuilt root of
    an ahead-of-time install (``paddle_mgrad/_prebuilt``, when present).  Returns one dict per
    key directory (and per partial ``.build-*``/``.trash-*`` directory left by a build):

    * ``directory`` (str), ``key`` (str), ``location``: ``"cache"`` or ``"prebuilt"``;
    * ``complete`` (bool): the completion marker ``.complete`` exists;
    * ``verified`` (bool): the library's size and sha256 match the marker -- checked by reading
      the file, WITHOUT loading it (nothing here calls ``dlopen``);
    * ``problem`` (str or None): the first reason it would not be loaded, e.g.
      ``"<path> is owned by uid 65534 (nobody), not by you ..."``,
      ``"<path> is group-writable (mode 0775)"``, ``"<path> is a symbolic link"``,
      ``"truncated: 4096 of 3986472 bytes"``, ``"hash mismatch: ..."``,
      ``"failed build: <error>"``, ``"incomplete (build in progress or killed)"``,
      ``"completion marker from an older paddle_mgrad (empty: no size/hash)"``;
      ``problems`` (list of str) holds all of them, ``security`` the ownership/mode ones
      (``PADDLE_MGRAD_TRUST_SHARED_CACHE=1`` would load despite those);
    * ``size`` (int or None): the library's size on disk; ``recorded_size``, ``sha256``,
      ``paddle_version``, ``cuda`` (bool), ``built_at`` from the marker (None without one);
    * ``library`` (str or None): the library's path;
    * ``current`` (bool): its key is the one this process would load (the CPU key, and the CUDA
      key when the CUDA part would be built).

    A missing root gives no entries.  Problems of the cache root itself (owner, mode) appear in
    every entry of that root.
    """
    current = _current_keys()
    out = []
    for location, base in (("cache", root or cache_root()), ("prebuilt", prebuilt_root())):
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        for name in names:
            if not (_KEY_RE.match(name) or _PARTIAL_RE.match(name)):
                continue
            if not os.path.isdir(os.path.join(base, name)) and not _PARTIAL_RE.match(name):
                continue
            r = _examine(base, name)
            r.pop("fd", None)
            r = dict(
                r, location=location, current=r["key"] in current and not _PARTIAL_RE.match(name)
            )
            out.append(r)
    return out
