"""The op cache and its verification: who may write a key directory and what it holds.

Split out of :mod:`._build` (which decides what to load or build and where): the ownership and
mode checks of the cache root and every path down to the library (**who may write it**), the
completion marker ``.complete`` and the library's size and sha256, checked on one ``O_NOFOLLOW``
descriptor that the loader then maps (**what it is**), and the private directories and files the
builder creates.  See :mod:`._build`'s docstring for the whole story.  Loads nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
import warnings

from .._compat import PADDLE_COMMIT, paddle
from ..env import get as env_get

MARKER = ".complete"
FAILED = ".failed"
MARKER_FORMAT = 1
TRUST_ENV = "PADDLE_MGRAD_TRUST_SHARED_CACHE"
# a builder's private directory, or one renamed away to be deleted: .build-<key>-*, .trash-<key>-*
_PARTIAL_RE = re.compile(r"^\.(build|trash)-([0-9a-f]{16})-")
_warned = set()


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
        who = {
            0o020: "group-writable",
            0o002: "world-writable",
            0o022: "group- and world-writable",
        }[bits]
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
    return (
        f"Fix: {chmod}point PADDLE_MGRAD_CACHE at a directory only you can write "
        f"(default ~/.cache/paddle_mgrad); {TRUST_ENV}=1 loads it anyway, at that risk."
    )


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
    r = _Examined(
        directory=directory,
        key=key,
        complete=False,
        verified=False,
        problem=None,
        problems=[],
        security=[],
        size=None,
        recorded_size=None,
        sha256=None,
        paddle_version=None,
        cuda=None,
        built_at=None,
        library=None,
        fd=None,
    )
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
        r.update(
            recorded_size=info["size"],
            sha256=info["sha256"],
            paddle_version=info.get("paddle_version"),
            cuda=info.get("cuda"),
            built_at=info.get("built_at"),
        )
        parts = info["library"].split("/")
        rel += [os.path.join(name, *parts[: i + 1]) for i in range(len(parts))]
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


def _write_marker(build_dir, key, rel, cuda):
    """The completion record of the build in ``build_dir`` whose library is at ``rel``."""
    lib = os.path.join(build_dir, *rel.split("/"))
    if not os.path.isfile(lib):
        raise RuntimeError(f"the build in {build_dir} produced no {rel}")
    size, digest = _hash_file(lib)
    info = {
        "format": MARKER_FORMAT,
        "key": key,
        "library": rel,
        "size": size,
        "sha256": digest,
        "paddle_version": paddle.__version__,
        "paddle_commit": PADDLE_COMMIT,
        "cuda": bool(cuda),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "built_by_uid": os.geteuid(),
    }
    _write_new(os.path.join(build_dir, MARKER), json.dumps(info, indent=1) + "\n")
