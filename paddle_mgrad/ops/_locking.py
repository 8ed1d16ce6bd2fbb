"""The build lock of one key (``<root>/<key>.lock``) and what only its holder may do: discard the
partial directories a killed build left, publish a build by rename.

Split out of :mod:`._build`: the ranks of a data-parallel launch serialise their builders of one
key here; a complete, verified build is loaded without the lock (a read-only cache works).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat

from ._cache import _PARTIAL_RE, CacheRefused, _open_nofollow, _user_name


@contextlib.contextmanager
def _locked(root, key):
    """Exclusive lock ``root/<key>.lock`` (never through a link: ``O_NOFOLLOW``)."""
    import fcntl

    path = os.path.join(root, f"{key}.lock")
    try:
        fd = _open_nofollow(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CacheRefused(
                f"the lock file {path} is a symbolic link; not following it (Fix: remove it)"
            ) from None
        raise CacheRefused(
            f"cannot create the lock file {path} ({e.strerror}): the cache is not "
            "writable and holds no usable build of this key. Fix: point "
            "PADDLE_MGRAD_CACHE at a writable directory of your own"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.geteuid(), 0):
            raise CacheRefused(
                f"the lock file {path} is not a regular file of yours "
                f"({_user_name(st.st_uid)}); Fix: remove it"
            )
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
