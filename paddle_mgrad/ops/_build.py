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

Directories created here are mode 0700, files are never group/world-writable; lock files and
markers are opened with ``O_NOFOLLOW`` (new ones with ``O_EXCL``).  :func:`inspect_cache` reports
the state of every key directory without loading anything (for ``python -m paddle_mgrad doctor``).
"""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings

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
MARKER = ".complete"
FAILED = ".failed"
MARKER_FORMAT = 1
TRUST_ENV = "PADDLE_MGRAD_TRUST_SHARED_CACHE"
_KEY_RE = re.compile(r"^[0-9a-f]{16}$")
_PARTIAL_RE = re.compile(r"^\.(build|trash)-([0-9a-f]{16})-")
_toolkit = {}
_warned = set()
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
        return sorted({a * 10 + b for a, b in (cuda.get_device_capability(i)
                                               for i in range(cuda.device_count()))})
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


# ------------------------------------------------------------------ who may write it
class CacheRefused(RuntimeError):
    """A cache root cannot be used (unsafe owner/mode, not writable, unusable path)."""


def _warn_once(message):
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def _user_name(uid) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _stat_problem(path, st) -> str | None:
    """Why ``st`` (of ``path``) may not be trusted: a symbolic link, another owner than the
    current user or root, group/world write permission -- from the stat, never ``access()``
    (root may write anything, but that says nothing about who else may)."""
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    why = []
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        why.append(f"owned by {_user_name(st.st_uid)} (expected you, {_user_name(me)}, or root)")
    bits = st.st_mode & 0o022
    if bits:
        who = {0o020: "group-writable", 0o002: "world-writable",
               0o022: "group- and world-writable"}[bits]
        why.append(f"{who} (mode {stat.S_IMODE(st.st_mode):04o})")
    return f"{path} is {' and '.join(why)}" if why else None


def _chain_problems(root, rel_paths) -> list:
    """Problems of the cache root (its real path) and of ``rel_paths`` below it (lstat: a link
    below the root is itself a problem).  Missing paths are not problems here."""
    out = []
    real = os.path.realpath(root)
    for rel in [""] + list(rel_paths):
        path = os.path.join(real, rel) if rel else real
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            out.append(f"{path}: {e.strerror}")
            continue
        p = _stat_problem(path, st)
        if p:
            out.append(p)
    return out


def _trusted() -> bool:
    return bool(env_get(TRUST_ENV))


def _security_fix(problems) -> str:
    paths = [p.split(" is ")[0] for p in problems if "-writable (mode" in p]
    chmod = f"`chmod go-w {' '.join(paths)}` if those are yours, or " if paths else ""
    return (f"Fix: {chmod}point PADDLE_MGRAD_CACHE at a directory only you can write "
            f"(default ~/.cache/paddle_mgrad); {TRUST_ENV}=1 loads it anyway, at that risk.")


def _makedirs_private(path):
    """``os.makedirs`` where every directory created is 0700 (whatever the umask)."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        _makedirs_private(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return
    os.chmod(path, 0o700)


def _tighten(tree):
    """After a build: directories 0700, files without group/world write (the compiler and
    setuptools follow the umask, which may be 002)."""
    for dirpath, _dirnames, filenames in os.walk(tree):
        os.chmod(dirpath, 0o700)
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o022:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)


# ------------------------------------------------------------------ what it is
def _open_nofollow(path, flags=os.O_RDONLY, mode=0o600):
    return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)


def _write_new(path, text):
    """Create ``path`` (``O_EXCL | O_NOFOLLOW``: never through a planted link) with ``text``."""
    fd = _open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read_small(path, limit=1 << 20) -> tuple:
    """(text, fstat) of a small file opened without following links."""
    fd = _open_nofollow(path)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        return f.read(limit).decode("utf-8", "replace"), st


def _hash_fd(fd) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        h.update(chunk)
    return h.hexdigest()


def _hash_file(path) -> tuple:
    fd = _open_nofollow(path)
    try:
        return os.fstat(fd).st_size, _hash_fd(fd)
    finally:
        os.close(fd)


def _read_marker(directory):
    """The completion record, or raises ValueError naming what is wrong with it."""
    text, st = _read_small(os.path.join(directory, MARKER))
    if not text.strip():
        raise ValueError("completion marker from an older paddle_mgrad (empty: no size/hash)")
    try:
        info = json.loads(text)
    except ValueError:
        raise ValueError("corrupt completion marker (not JSON)") from None
    need = {"library": str, "size": int, "sha256": str, "key": str}
    if not isinstance(info, dict) or any(not isinstance(info.get(k), t) for k, t in need.items()):
        raise ValueError("corrupt completion marker (fields missing)")
    lib = info["library"]
    if os.path.isabs(lib) or ".." in lib.split("/") or os.path.normpath(lib) != lib:
        raise ValueError(f"corrupt completion marker (library path {lib!r})")
    info["_stat"] = st
    return info


class _Examined(dict):
    """One key directory's state (see :func:`inspect_cache`); ``fd`` holds the verified
    library open when asked for (the caller closes it)."""


def _examine(root, name, keep_fd=False, trusted=False) -> _Examined:
    """Everything about ``root/name`` short of loading it: safety of the chain, failed marker,
    completion record, the library's size and sha256 against it.  Never dlopens."""
    directory = os.path.join(root, name)
    m = _PARTIAL_RE.match(name)
    key = m.group(2) if m else name
    r = _Examined(directory=directory, key=key, complete=False, verified=False, problem=None,
                  problems=[], security=[], size=None, recorded_size=None, sha256=None,
                  paddle_version=None, cuda=None, built_at=None, library=None, fd=None)
    if m:
        r["problems"].append("incomplete (build in progress or killed)")
        r["problem"] = r["problems"][0]
        return r
    rel = [name, os.path.join(name, MARKER)]
    info = None
    marker_error = None
    if os.path.lexists(os.path.join(directory, MARKER)):
        r["complete"] = True
        try:
            info = _read_marker(directory)
        except (OSError, ValueError) as e:
            marker_error = f"completion marker: {e.strerror}" if isinstance(e, OSError) else str(e)
    if info is not None:
        r.update(recorded_size=info["size"], sha256=info["sha256"],
                 paddle_version=info.get("paddle_version"), cuda=info.get("cuda"),
                 built_at=info.get("built_at"))
        parts = info["library"].split("/")
        rel += [os.path.join(name, *parts[:i + 1]) for i in range(len(parts))]
        r["library"] = os.path.join(directory, *parts)
    r["security"] = _chain_problems(root, rel)
    problems = list(r["security"])
    if os.path.lexists(os.path.join(directory, FAILED)):
        try:
            text, _ = _read_small(os.path.join(directory, FAILED))
        except OSError as e:
            text = f"(unreadable: {e.strerror})"
        problems.append(f"failed build: {text.strip()[:300]}")
    if not r["complete"]:
        if not any(p.startswith("failed build") for p in problems):
            problems.append("incomplete (build in progress or killed)")
    elif marker_error:
        problems.append(marker_error)
    elif info["key"] != key:
        problems.append(f"completion marker is for key {info['key']}")
    else:
        fd = None
        try:
            fd = _open_nofollow(r["library"])
            st = os.fstat(fd)
            r["size"] = st.st_size
            p = _stat_problem(r["library"], st)  # on the descriptor that would be loaded
            if p and p not in r["security"]:
                r["security"].append(p)
                problems.insert(0, p)
            if not stat.S_ISREG(st.st_mode):
                problems.append(f"{r['library']} is not a regular file")
            elif st.st_size < info["size"]:
                problems.append(f"truncated: {st.st_size} of {info['size']} bytes")
            elif st.st_size != info["size"]:
                problems.append(f"size mismatch: {st.st_size} bytes, built {info['size']}")
            elif _hash_fd(fd) != info["sha256"]:
                problems.append("hash mismatch: the library is not the one that was built")
            else:
                r["verified"] = True
        except OSError as e:
            problems.append(f"library {r['library']}: {e.strerror}")
        if keep_fd and r["verified"] and (trusted or not r["security"]):
            r["fd"] = fd
        elif fd is not None:
            os.close(fd)
    r["problems"] = problems
    r["problem"] = problems[0] if problems else None
    return r


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
    return module


def _load_verified(root, key, trusted):
    """Import ``root/key`` when it is complete, verified and safe; else raise ValueError with the
    problem (the caller rebuilds or moves on)."""
    r = _examine(root, key, keep_fd=True, trusted=trusted)
    if r["fd"] is None:
        raise ValueError(r["problem"] or "not verified")
    if r["security"]:  # only when trusted
        _warn_once(f"paddle_mgrad: loading the op from {r['directory']} although "
                   f"{'; '.join(r['security'])}, because {TRUST_ENV}=1: anyone who can write "
                   "there can run code in this process")
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
@contextlib.contextmanager
def _locked(root, key):
    """Exclusive lock ``root/<key>.lock`` (never through a link: ``O_NOFOLLOW``)."""
    import fcntl

    path = os.path.join(root, f"{key}.lock")
    try:
        fd = _open_nofollow(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CacheRefused(f"the lock file {path} is a symbolic link; not following it "
                               f"(Fix: remove it)") from None
        raise CacheRefused(f"cannot create the lock file {path} ({e.strerror}): the cache is not "
                           "writable and holds no usable build of this key. Fix: point "
                           "PADDLE_MGRAD_CACHE at a writable directory of your own") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.geteuid(), 0):
            raise CacheRefused(f"the lock file {path} is not a regular file of yours "
                               f"({_user_name(st.st_uid)}); Fix: remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _trash_name(root, key) -> str:
    return os.path.join(root, f".trash-{key}-{os.getpid()}-{secrets.token_hex(4)}")


def _discard_partials(root, key):
    """Under the key's lock no other builder of ``key`` is alive: partial directories of it
    (a killed build, whose orphaned compiler may still be writing) are renamed away and
    deleted."""
    for name in os.listdir(root):
        m = _PARTIAL_RE.match(name)
        if not m or m.group(2) != key:
            continue
        path = os.path.join(root, name)
        if m.group(1) == "build":
            trash = _trash_name(root, key)
            try:
                os.rename(path, trash)
                path = trash
            except OSError:
                pass
        shutil.rmtree(path, ignore_errors=True)


def _install(build_dir, root, key):
    """Publish ``build_dir`` as ``root/key`` by rename; a previous one is renamed away first."""
    final = os.path.join(root, key)
    trash = None
    if os.path.lexists(final):
        trash = _trash_name(root, key)
        os.rename(final, trash)
    os.rename(build_dir, final)
    if trash:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def _write_marker(build_dir, key, cuda):
    rel = _op_lib_rel(key)
    lib = os.path.join(build_dir, *rel.split("/"))
    if not os.path.isfile(lib):
        raise RuntimeError(f"the build in {build_dir} produced no {rel}")
    size, digest = _hash_file(lib)
    info = {"format": MARKER_FORMAT, "key": key, "library": rel, "size": size, "sha256": digest,
            "paddle_version": paddle.__version__,
            "paddle_commit": getattr(getattr(paddle, "version", None), "commit", ""),
            "cuda": bool(cuda), "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "built_by_uid": os.geteuid()}
    _write_new(os.path.join(build_dir, MARKER), json.dumps(info, indent=1) + "\n")


def _compile(build_dir, key, cuda, verbose=False):
    """Compile the op into ``build_dir``: Paddle's setup script (``_write_setup_file``, the
    same one ``cpp_extension.load`` writes) run by ``python setup.py build`` WITHOUT a shell
    (Paddle's ``load`` runs ``cd <dir> && ...`` unquoted, which breaks on a space)."""
    from paddle.utils.cpp_extension import extension_utils as eu

    if any(c in build_dir for c in "'\\\n"):
        raise RuntimeError(f"the build directory {build_dir!r} contains a quote, backslash or "
                           "newline, which Paddle's setup script cannot hold. Fix: set "
                           "PADDLE_MGRAD_CACHE to a path without them")
    sources, cflags, ldflags, nvcc = build_config(cuda)
    src = csrc_dir()
    env = dict(os.environ)
    if cuda:
        tk = cuda_toolkit()
        shims = tk.link_shims()  # e.g. libcudart.so for Paddle's -lcudart when only .so.12 exists
        if shims:
            link_dir = os.path.join(build_dir, "cuda-link")
            os.makedirs(link_dir, exist_ok=True)
            for name, target in shims.items():
                path = os.path.join(link_dir, name)
                if not os.path.lexists(path):
                    os.symlink(target, path)
            ldflags = [f"-L{link_dir}"] + ldflags
        # Paddle's setup takes nvcc (and the include/lib dirs it adds itself, and the -lcudart
        # it links) from $CUDA_HOME, else from `which nvcc`: point it at our toolkit.
        env["CUDA_HOME"] = tk.home
    name = _op_name(key)
    setup_file = os.path.join(build_dir, f"{name}_setup.py")
    eu._write_setup_file(name, [os.path.join(src, s) for s in sources], setup_file,
                         os.path.join(build_dir, name), None, None, cflags + [f"-I{src}"],
                         (nvcc + [f"-I{src}"]) if nvcc else [], ldflags, verbose)
    cmd = [sys.executable, setup_file, "build"]
    if verbose:
        r = subprocess.run(cmd, cwd=build_dir, env=env)
        out = ""
    else:
        r = subprocess.run(cmd, cwd=build_dir, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace")
        out = r.stdout
    if r.returncode != 0:
        tail = "\n".join(ln for ln in out.strip().splitlines()[-15:]
                         if not ln.startswith("running "))
        raise RuntimeError(f"the compiler failed (exit {r.returncode})"
                           + (f":\n{tail}" if tail else " (output above)"))


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
                "PADDLE_MGRAD_OPS=python uses the fallback without building") from None
        _tighten(build_dir)
        _write_marker(build_dir, key, cuda)
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
        raise RuntimeError(f"the op just built in {directory} cannot be used: {e}. Fix: delete "
                           f"{directory} and start again; PADDLE_MGRAD_OPS=python uses the "
                           "fallback without building") from None


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
        raise CacheRefused(f"cannot create the cache directory {root} ({e.strerror}). Fix: point "
                           "PADDLE_MGRAD_CACHE at a writable directory of your own") from None
    unsafe = _chain_problems(root, [])
    if unsafe and not trusted:  # (trusted: _load_verified warns, once, naming all of it)
        raise CacheRefused(f"not loading the op from the cache {root}: {'; '.join(unsafe)} -- "
                           "anyone who can write there could run code in this process. "
                           + _security_fix(unsafe))
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
        log.warning("paddle_mgrad: compiling the fused weight-gradient op%s (once per "
                    "Paddle version/source change, ~10-60 s) into %s%s",
                    " with CUDA" if cuda else "", directory,
                    f" (rebuilding: {stale})" if stale else "")
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
            _warn_once(f"paddle_mgrad: not loading the prebuilt op in {pre}: {e}. Fix: reinstall "
                       "paddle_mgrad (PADDLE_MGRAD_BUILD_OPS=1 pip install ...) or delete that "
                       "directory; the op is built in the JIT cache instead")
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
                problem = f"building its CUDA part with {tk.summary()} failed: " \
                          f"{type(e).__name__}: {e}".strip()[-1500:]
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
            r = dict(r, location=location, current=r["key"] in current and not _PARTIAL_RE.match(name))
            out.append(r)
    return out
