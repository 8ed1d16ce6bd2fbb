"""The op cache is no door into the process: what paddle_mgrad loads and writes.

Attack tried as another user on the same machine would: a complete cache in a directory others
can write, its library replaced by one whose constructor writes a marker file, the completion
marker kept (or forged to match), everything owned by another user.  That code must never run:
the cache is refused with one warning and the op comes from the user's private cache.

Root can write anything, so these tests never ask ``access()``: they make the ownership/mode
situation with ``os.chown`` (to ``nobody``) and mode bits, and paddle_mgrad decides by ``stat``.
Tests that need ``chown`` or another user skip, saying so, where the suite does not run as root.
No test here compiles the op: they copy the build the suite already uses (tests/cache_probe.py).
"""

import json
import os
import shutil
import stat

import pytest

from cache_probe import (
    COMPILING,
    FAKE_COMPILE,
    NOBODY,
    chown_tree,
    compile_planted,
    copy_build,
    forge_marker,
    good_build,
    home_with_build,
    library_in,
    private_dir,
    result,
    run_probe,
)
from paddle_mgrad import autoload
from paddle_mgrad.ops import _build

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root: chown to another user (nobody)")


def _one_warning(res, *parts):
    assert len(res["warnings"]) == 1, res["warnings"]
    for p in parts:
        assert p in res["warnings"][0], (p, res["warnings"][0])
    return res["warnings"][0]


# ------------------------------------------------------------------ the planted library
@pytest.mark.probe
@needs_root
@pytest.mark.parametrize(
    "mode,marker,pth",
    [
        (0o777, "kept", False),
        (0o777, "kept", True),  # the attack as reported, both entry points
        (0o777, "forged", False),
        (0o755, "forged", False),  # only the owner could have planted it: ownership alone refuses
    ],
    ids=[
        "world-writable-kept",
        "world-writable-kept-PADDLE_MGRAD=all",
        "world-writable-forged",
        "other-owner-forged",
    ],
)
def test_planted_library_in_a_foreign_cache_never_runs(tmp_path, mode, marker, pth):
    """A cache owned by ``nobody`` whose library was replaced by one whose constructor writes a
    marker file: not loaded (with the completion marker kept, or forged to match the planted
    file), one warning, the user's private cache serves the op, no build.  With
    ``PADDLE_MGRAD=all`` (the .pth switch) the op is loaded at ``import paddle``."""
    ran = tmp_path / "PLANTED_CODE_RAN"
    shared = tmp_path / "shared"
    key_dir = copy_build(shared)
    planted = compile_planted(tmp_path, ran)
    with open(planted, "rb") as src, open(library_in(key_dir), "wb") as dst:
        dst.write(src.read())
    if marker == "forged":
        forge_marker(key_dir)
    for dirpath, _dirnames, _filenames in os.walk(shared):
        os.chmod(dirpath, 0o755)
    os.chmod(shared, mode)
    chown_tree(shared, NOBODY)
    home = home_with_build(tmp_path)
    extra = {"PADDLE_MGRAD": "all"} if pth else {}
    p = run_probe(shared, home, pth=pth, **extra)
    res = result(p)
    assert not ran.exists(), "the planted library's constructor ran"
    assert res["backend"].startswith("cpp-") and res["correct"], res
    assert res["library"].startswith(str(home)), res
    _one_warning(
        res,
        str(shared),
        "owned by uid 65534",
        "Fix:",
        *(["world-writable (mode 0777)"] if mode == 0o777 else []),
    )
    assert COMPILING not in p.stdout + p.stderr
    if pth:
        assert "paddle_mgrad: recompute, fused_linear on (op: cpp-" in p.stderr


@pytest.mark.probe
def test_replaced_library_in_a_private_cache_is_not_loaded_but_rebuilt(tmp_path):
    """Our own cache, the library replaced, the marker kept: the hash differs, the file is never
    loaded, the key is rebuilt in a fresh directory (compiler step faked: a copy of the good
    build) and the rebuilt library loads."""
    ran = tmp_path / "PLANTED_CODE_RAN"
    cache = tmp_path / "cache"
    key_dir = copy_build(cache)
    planted = open(compile_planted(tmp_path, ran), "rb").read()
    size = os.path.getsize(library_in(key_dir))
    with open(library_in(key_dir), "wb") as dst:  # same size: only the hash tells them apart
        dst.write(planted + b"\0" * (size - len(planted)))
    res = result(
        p := run_probe(cache, tmp_path / "home", patch=FAKE_COMPILE.format(good=good_build()[2]))
    )
    assert not ran.exists(), "the replaced library was loaded"
    assert res["backend"].startswith("cpp-") and res["correct"] and not res["warnings"], res
    assert res["library"] == library_in(key_dir)
    assert "FAKE COMPILE" in p.stdout and "rebuilding: hash mismatch" in p.stdout + p.stderr
    (entry,) = [e for e in _build.inspect_cache(str(cache)) if e["location"] == "cache"]
    assert entry["verified"] and entry["problem"] is None


# ------------------------------------------------------------------ unsafe caches refused
@pytest.mark.probe
def test_group_writable_cache_is_refused_with_one_warning(tmp_path):
    """A complete, genuine build in a group-writable cache root: refused (one warning naming
    the path, the mode and the fix), the private cache serves the op, no crash, no build."""
    cache = tmp_path / "team-cache"
    copy_build(cache)
    os.chmod(cache, 0o770)
    home = home_with_build(tmp_path)
    res = result(p := run_probe(cache, home))
    assert res["backend"].startswith("cpp-") and res["correct"], res
    assert res["library"].startswith(str(home)), res
    _one_warning(
        res,
        f"{cache} is group-writable (mode 0770)",
        f"chmod go-w {cache}",
        "PADDLE_MGRAD_TRUST_SHARED_CACHE=1",
        f"Using {home}",
    )
    assert COMPILING not in p.stdout + p.stderr


@pytest.mark.probe
def test_refused_default_cache_falls_back_with_one_warning(tmp_path):
    """When the refused cache is the default one there is no private place left: the pure-Paddle
    fallback (same results), one warning naming the directory and the fix."""
    home = tmp_path / "home"
    default = home / ".cache" / "paddle_mgrad"
    copy_build(default)
    os.chmod(default, 0o777)
    p = run_probe(default, home)
    res = result(p)
    # CPU tier "python"; a CUDA wheel adds ";gpu=paddle-fused" (Paddle's own fused GPU kernel)
    assert res["backend"].split(";")[0] == "python" and res["correct"] is None, res
    _one_warning(
        res,
        "pure-Paddle fallback",
        f"{default} is group- and world-writable (mode 0777)",
        f"chmod go-w {default}",
        "Fix:",
    )
    assert COMPILING not in p.stdout + p.stderr


@pytest.mark.probe
def test_trust_shared_cache_loads_it_and_still_warns(tmp_path):
    cache = tmp_path / "team-cache"
    key_dir = copy_build(cache)
    os.chmod(cache, 0o775)
    res = result(run_probe(cache, tmp_path / "home", PADDLE_MGRAD_TRUST_SHARED_CACHE="1"))
    assert res["backend"].startswith("cpp-") and res["library"] == library_in(key_dir), res
    _one_warning(res, str(cache), "group-writable", "PADDLE_MGRAD_TRUST_SHARED_CACHE=1")


def _read_only(cache):
    """How to run a probe for which ``cache`` is really read-only: as root (who may write
    anything), in a private mount namespace with ``cache`` bind-mounted read-only (EROFS, as a
    read-only NFS/squashfs share); as another user, ``chmod a-w`` suffices."""
    if not IS_ROOT:
        for dirpath, _dirnames, _filenames in os.walk(cache):
            os.chmod(dirpath, 0o555)
        return []
    if shutil.which("unshare") is None:
        pytest.skip("as root a read-only cache needs `unshare -m` + a read-only bind mount")
    return ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(cache)]


@pytest.mark.probe
def test_read_only_cache_with_a_complete_build_loads(tmp_path):
    """A complete build in a read-only cache loads with nothing written there: no lock, no
    warning, no build.  Without a build of this key it cannot build there: the private cache
    serves the op and one warning names the directory and the fix."""
    cache = tmp_path / "system-cache"
    key_dir = copy_build(cache)
    wrap = _read_only(cache)
    before = sorted(os.listdir(cache))
    res = result(p := run_probe(cache, tmp_path / "home", wrap=wrap))
    assert res["backend"].startswith("cpp-") and res["correct"] and not res["warnings"], res
    assert res["library"] == library_in(key_dir)
    assert COMPILING not in p.stdout + p.stderr and sorted(os.listdir(cache)) == before

    empty = tmp_path / "empty-cache"
    private_dir(empty)
    wrap = _read_only(empty)
    home = home_with_build(tmp_path)
    res = result(p := run_probe(empty, home, wrap=wrap))
    assert res["backend"].startswith("cpp-") and res["library"].startswith(str(home)), res
    _one_warning(res, str(empty), "not writable", "Fix:", f"Using {home}")
    assert COMPILING not in p.stdout + p.stderr and os.listdir(empty) == []


# ------------------------------------------------------------------ links never followed
@pytest.mark.probe
def test_planted_lock_symlink_is_not_followed(tmp_path):
    """Symbolic links at the lock file's place (and at the old in-directory ``.lock``) pointing
    at a file of the user's: never opened through, never truncated; the cache is refused (one
    warning naming the link) and the private cache serves the op."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious data\n")
    cache = private_dir(tmp_path / "cache")
    key = good_build()[1]
    os.symlink(victim, os.path.join(cache, f"{key}.lock"))
    os.mkdir(os.path.join(cache, key), 0o700)
    os.symlink(victim, os.path.join(cache, key, ".lock"))
    home = home_with_build(tmp_path)
    res = result(run_probe(cache, home))
    assert victim.read_text() == "precious data\n"
    assert res["backend"].startswith("cpp-") and res["library"].startswith(str(home)), res
    _one_warning(res, os.path.join(cache, f"{key}.lock"), "symbolic link", "Fix: remove it")


def test_lock_and_failed_marker_open_without_following_links(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("precious data\n")
    root = private_dir(tmp_path / "cache")
    os.symlink(victim, os.path.join(root, "0123456789abcdef.lock"))
    with pytest.raises(_build.CacheRefused, match="symbolic link"):
        with _build._locked(root, "0123456789abcdef"):
            pass
    # a .failed link is not read through, and a new .failed is a fresh file in a fresh directory
    key_dir = os.path.join(root, "fedcba9876543210")
    os.mkdir(key_dir, 0o700)
    os.symlink(victim, os.path.join(key_dir, ".failed"))
    assert "precious" not in _build._failed_message(key_dir)
    _build._install_failed(root, "fedcba9876543210", "nvcc: fake failure")
    failed = os.path.join(key_dir, ".failed")
    assert not os.path.islink(failed) and open(failed).read() == "nvcc: fake failure"
    assert victim.read_text() == "precious data\n"
    with pytest.raises(FileExistsError):  # O_EXCL: never onto something already there
        _build._write_new(failed, "again")


# ------------------------------------------------------------------ what paddle_mgrad creates
@pytest.mark.probe
def test_created_directories_are_private_and_files_not_writable_by_others(tmp_path):
    """Whatever the umask (002 here): the cache root and every directory created are 0700, no
    file is group/world-writable.  (Compiler step faked; the real build is checked in
    tests/ops/test_build.py.)"""
    cache = tmp_path / "a" / "b" / "cache"
    res = result(
        run_probe(
            cache, tmp_path / "home", umask=0o002, patch=FAKE_COMPILE.format(good=good_build()[2])
        )
    )
    assert res["backend"].startswith("cpp-"), res
    for path in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
    for rel, mode in _tree_modes(cache).items():
        full = os.path.join(cache, rel)
        if os.path.isdir(full):
            assert mode == 0o700, (rel, oct(mode))
        else:
            assert not mode & 0o022, (rel, oct(mode))


def _tree_modes(tree):
    from cache_probe import modes

    return modes(tree)


@pytest.mark.probe
def test_inspect_cache_reports_owner_and_mode_without_loading(tmp_path):
    """inspect_cache reads, never dlopens: a forged-marker planted library (which verifies by
    hash!) is reported as such and its constructor does not run."""
    ran = tmp_path / "PLANTED_CODE_RAN"
    cache = tmp_path / "cache"
    key_dir = copy_build(cache)
    planted = compile_planted(tmp_path, ran)
    with open(planted, "rb") as src, open(library_in(key_dir), "wb") as dst:
        dst.write(src.read())
    forge_marker(key_dir)
    (e,) = [e for e in _build.inspect_cache(str(cache)) if e["location"] == "cache"]
    assert e["complete"] and e["verified"] and e["problem"] is None  # by hash it is "fine"
    os.chmod(library_in(key_dir), 0o664)
    (e,) = [e for e in _build.inspect_cache(str(cache)) if e["location"] == "cache"]
    assert e["security"] and "group-writable (mode 0664)" in e["problem"], e
    if IS_ROOT:
        os.chmod(library_in(key_dir), 0o644)
        chown_tree(cache, NOBODY)
        (e,) = [e for e in _build.inspect_cache(str(cache)) if e["location"] == "cache"]
        assert "owned by uid 65534" in e["problem"] and e["security"], e
    assert not ran.exists()


# ------------------------------------------------------------------ PADDLE_MGRAD_REPORT files
def test_report_never_written_through_a_planted_symlink(tmp_path, monkeypatch):
    monkeypatch.delenv("PADDLE_TRAINER_ID", raising=False)
    victim = tmp_path / "precious.txt"
    victim.write_text("precious data\n")
    reports = tmp_path / "reports"
    reports.mkdir()
    name = f"paddle_mgrad_report.main.{os.getpid()}.json"
    os.symlink(victim, reports / name)
    autoload._write_report(str(reports), "recompute")
    assert victim.read_text() == "precious data\n"
    assert not os.path.islink(reports / name)
    assert json.load(open(reports / name))["pid"] == os.getpid()
    assert not stat.S_IMODE(os.stat(reports / name).st_mode) & 0o022
    assert sorted(os.listdir(reports)) == [name]  # no temporary left behind


def test_report_directory_is_created_private(tmp_path, monkeypatch):
    monkeypatch.delenv("PADDLE_TRAINER_ID", raising=False)
    reports = tmp_path / "new-reports"
    old = os.umask(0o002)
    try:
        autoload._write_report(str(reports), "recompute")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(reports).st_mode) == 0o700
    assert len(os.listdir(reports)) == 1


@pytest.mark.probe
def test_report_naming_a_file_gives_one_warning_line_not_a_traceback(tmp_path):
    report = tmp_path / "report.json"
    report.write_text("not a directory\n")
    p = run_probe(
        tmp_path / "cache",
        tmp_path / "home",
        pth=True,
        code="""
        import paddle
        print("ran")
    """,
        PADDLE_MGRAD="recompute",
        PADDLE_MGRAD_REPORT=str(report),
    )
    assert p.returncode == 0 and "ran" in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if "PADDLE_MGRAD_REPORT" in ln]
    assert len(lines) == 1 and "not a directory" in lines[0] and str(report) in lines[0], p.stderr
    assert report.read_text() == "not a directory\n"
