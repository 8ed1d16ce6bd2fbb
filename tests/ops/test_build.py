"""Building the op: JIT cache reuse, cache key, ahead-of-time build into the package, and the
faults a build cache meets: truncated/empty/random libraries, a build killed
half-way, read-only and oddly named caches.

Real compiles are few (each ~10-60 s): the cache-reuse test, the empty-library heal, the killed
build and the ahead-of-time install.  Where the point is the cache's handling of a rebuild, the
compiler step is faked by a copy of the suite's own build (tests/cache_probe.py).
"""

import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import paddle
import pytest

from cache_probe import (
    COMPILING,
    FAKE_COMPILE,
    compile_planted,
    copy_build,
    finish,
    good_build,
    library_in,
    modes,
    result,
    run_probe,
)
from helpers import ROOT, pip_install_target
from paddle_mgrad.ops import _build

PROBE = textwrap.dedent("""
    import zlib, logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    import paddle
    from paddle_mgrad import ops
    print("BACKEND", ops.backend(), ops.fallback_reason())
""")


def _probe(env_extra, pythonpath=None):
    env = dict(os.environ, **env_extra)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600, cwd="/"
    )


@pytest.mark.probe
@pytest.mark.heavy
def test_empty_library_heals_once_with_the_real_compiler_in_a_path_with_a_space(tmp_path):
    """A 0-byte cached library (Paddle's own build used to trip over the stale file forever) in
    a cache whose path has a space (Paddle's unquoted ``cd``), umask 002.  Two processes start
    at once -- one plain (``import paddle, paddle_mgrad.ops as o; o.backend()``), one switched on
    by ``PADDLE_MGRAD=all`` through the .pth (every ``import paddle`` loads the op): neither is
    killed by a signal, one compiles (for real), the other waits and loads that build; a third
    start reuses it.  Published with a completion record, directories 0700, no group/world-
    writable file."""
    cache = tmp_path / "my cache"
    home = tmp_path / "home"
    key_dir = copy_build(cache)
    for leftover in glob.glob(os.path.join(key_dir, "*", "build")):
        shutil.rmtree(leftover)  # no object files to reuse
    _corrupt(library_in(key_dir), "empty")
    started = [
        run_probe(cache, home, popen=True, umask=0o002),
        run_probe(cache, home, popen=True, umask=0o002, pth=True, PADDLE_MGRAD="all"),
    ]
    done = [finish(p) for p in started]
    for p in done:
        res = result(p)  # exit 0: no signal
        assert res["backend"].startswith("cpp-") and res["correct"] and res["why"] is None, p.stdout
    assert "paddle_mgrad: recompute, fused_linear on (op: cpp-" in done[1].stdout
    compiled = [p.stdout for p in done if COMPILING in p.stdout]
    assert len(compiled) == 1 and "(rebuilding: truncated: 0 of" in compiled[0], compiled
    key = _build.build_key()
    assert sorted(os.listdir(cache)) == [key, f"{key}.lock"]
    info = json.load(open(cache / key / ".complete"))
    lib = library_in(str(cache / key))
    assert info["key"] == key and info["library"] == os.path.relpath(lib, cache / key)
    assert info["size"] == os.path.getsize(lib) > 0
    assert info["sha256"] == hashlib.sha256(open(lib, "rb").read()).hexdigest()
    assert info["paddle_version"] == paddle.__version__ and info["cuda"] is _build.with_cuda()
    assert info["built_at"]
    for rel, mode in modes(cache).items():
        if os.path.isdir(cache / rel):
            assert mode == 0o700, (rel, oct(mode))
        else:
            assert not mode & 0o022, (rel, oct(mode))
    third = run_probe(cache, home)
    res = result(third)
    assert res["backend"].startswith("cpp-") and res["library"] == lib
    assert COMPILING not in third.stdout + third.stderr  # reused, not rebuilt


def test_cache_key_tracks_flags_and_sources(monkeypatch, tmp_path):
    key = _build.build_key()
    monkeypatch.setenv("PADDLE_MGRAD_NO_ONEDNN", "1")
    assert _build.build_key() != key
    monkeypatch.delenv("PADDLE_MGRAD_NO_ONEDNN")
    src = tmp_path / "csrc"
    src.mkdir()
    for name in os.listdir(_build.csrc_dir()):
        (src / name).write_bytes(open(os.path.join(_build.csrc_dir(), name), "rb").read())
    monkeypatch.setattr(_build, "csrc_dir", lambda: str(src))
    assert _build.build_key() == key
    (src / "wgrad_cpu.cc").write_text((src / "wgrad_cpu.cc").read_text() + "\n// changed\n")
    assert _build.build_key() != key


def _checkout_copy(dest):
    """A copy of the checkout (sources only) for pip to build from: setuptools writes
    ``<source>/build``, which tests running at once (xdist workers, two suites) must not share."""
    shutil.copytree(
        ROOT,
        dest,
        ignore=shutil.ignore_patterns(
            ".git",
            ".nox",
            ".venv*",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            ".hypothesis",
            ".op-cache*",
        ),
    )
    return dest


@pytest.fixture(scope="module")
def aot_site(tmp_path_factory):
    """``PADDLE_MGRAD_BUILD_OPS=1 pip install --target`` once for the tests that need it.

    Installed from a copy of the checkout: setuptools builds in ``<source>/build``, so two
    suites run at once from one checkout (e.g. both Paddle versions) would collide there."""
    base = tmp_path_factory.mktemp("aot")
    source = _checkout_copy(base / "source")
    target = base / "site"
    return pip_install_target(source, target, env=dict(os.environ, PADDLE_MGRAD_BUILD_OPS="1"))


@pytest.mark.probe
@pytest.mark.heavy
@pytest.mark.xdist_group("aot_site")  # one AOT install, one worker
def test_ahead_of_time_build_needs_no_compile_at_runtime(tmp_path, aot_site):
    cache = tmp_path / "cache"
    cache.mkdir()
    (key,) = [
        n for n in os.listdir(aot_site / "paddle_mgrad" / "_prebuilt") if not n.endswith(".lock")
    ]
    info = json.load(open(aot_site / "paddle_mgrad" / "_prebuilt" / key / ".complete"))
    assert info["key"] == key and info["size"] > 0 and len(info["sha256"]) == 64
    probe = _probe({"PADDLE_MGRAD_CACHE": str(cache)}, pythonpath=str(aot_site))
    assert "BACKEND cpp-" in probe.stdout, probe.stdout + probe.stderr
    assert "compiling the fused" not in probe.stdout + probe.stderr
    assert os.listdir(cache) == []  # nothing built into the user cache


@pytest.mark.probe
@pytest.mark.heavy
@pytest.mark.xdist_group("aot_site")  # one AOT install, one worker
def test_tampered_prebuilt_library_is_not_loaded(tmp_path, aot_site):
    """The prebuilt module gets the same verification: a replaced library in
    ``_prebuilt/<key>`` never runs; one warning; the JIT cache serves the op."""
    site = tmp_path / "site"
    shutil.copytree(aot_site, site, symlinks=True)
    (key,) = os.listdir(site / "paddle_mgrad" / "_prebuilt")
    ran = tmp_path / "PLANTED_CODE_RAN"
    lib = library_in(str(site / "paddle_mgrad" / "_prebuilt" / key))
    planted = open(compile_planted(tmp_path, ran), "rb").read()
    size = os.path.getsize(lib)
    with open(lib, "wb") as f:  # same size: only the hash tells them apart
        f.write(planted + b"\0" * (size - len(planted)))
    cache = tmp_path / "cache"
    own = copy_build(cache)
    p = run_probe(cache, tmp_path / "home", PYTHONPATH=str(site))
    res = result(p)
    assert not ran.exists(), "the tampered prebuilt library ran"
    assert res["backend"].startswith("cpp-") and res["library"] == library_in(own), res
    assert len(res["warnings"]) == 1 and "not loading the prebuilt op" in res["warnings"][0]
    assert "hash mismatch" in res["warnings"][0] and "reinstall" in res["warnings"][0]
    assert COMPILING not in p.stdout + p.stderr


@pytest.mark.probe
def test_plain_install_after_an_ahead_of_time_build_ships_no_binaries(tmp_path):
    """pip builds in the source tree's build/: a _prebuilt left there by an AOT build must not
    end up in a later plain (JIT) install (it silently skipped the first-use build)."""
    source = _checkout_copy(tmp_path / "source")
    stale = os.path.join(source, "build", "lib", "paddle_mgrad", "_prebuilt", "stale")
    os.makedirs(stale, exist_ok=True)
    open(os.path.join(stale, ".complete"), "w").close()
    target = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k != "PADDLE_MGRAD_BUILD_OPS"}
    pip_install_target(source, target, env=env)
    assert (target / "paddle_mgrad" / "_csrc").is_dir()
    assert not (target / "paddle_mgrad" / "_prebuilt").exists()


# ------------------------------------------------------------------ faults in the build cache
def _corrupt(lib, how):
    data = open(lib, "rb").read()
    with open(lib, "wb") as f:
        if how == "truncated":  # a full disk or a killed copy: the first 4 KiB
            f.write(data[:4096])
        elif how == "empty":
            pass
        elif how == "random-same-size":
            f.write(os.urandom(len(data)))
        elif how == "random-other-size":
            f.write(os.urandom(len(data) + 12345))
    return how


EXPECTED_PROBLEM = {
    "truncated": "truncated: 4096 of",
    "empty": "truncated: 0 of",
    "random-same-size": "hash mismatch",
    "random-other-size": "size mismatch",
}


@pytest.mark.probe
@pytest.mark.parametrize("how", list(EXPECTED_PROBLEM))
def test_corrupt_library_is_never_loaded_and_is_rebuilt(tmp_path, how):
    """Crash probe (subprocess, no signal): ``import paddle, paddle_mgrad.ops as o;
    o.backend()`` on a cache whose library is truncated/empty/random: never dlopen-ed (a
    truncated file was a SIGBUS at every start), rebuilt in a fresh directory (compiler step
    faked), renamed into place, correct results."""
    cache = tmp_path / "cache"
    key_dir = copy_build(cache)
    _corrupt(library_in(key_dir), how)
    (e,) = [e for e in _build.inspect_cache(str(cache)) if e["location"] == "cache"]
    assert e["complete"] and not e["verified"] and EXPECTED_PROBLEM[how] in e["problem"], e
    p = run_probe(cache, tmp_path / "home", patch=FAKE_COMPILE.format(good=good_build()[2]))
    res = result(p)  # returncode 0: not a signal
    assert res["backend"].startswith("cpp-") and res["correct"] and res["why"] is None, res
    assert res["library"] == library_in(key_dir) and not res["warnings"]
    assert (
        "FAKE COMPILE" in p.stdout
        and f"(rebuilding: {EXPECTED_PROBLEM[how]}" in p.stdout + p.stderr
    )
    (e,) = [e for e in _build.inspect_cache(str(cache)) if e["location"] == "cache"]
    assert e["verified"] and e["problem"] is None and e["current"], e
    assert sorted(os.listdir(cache)) == [
        os.path.basename(key_dir),
        f"{os.path.basename(key_dir)}.lock",
    ]


def _compiler_at_work(cache):
    """An object file anywhere below ``cache`` (hidden build directories included)."""
    return any(n.endswith(".o") for _, _, names in os.walk(cache) for n in names)


@pytest.mark.probe
@pytest.mark.heavy
def test_build_killed_half_way_then_restart(tmp_path):
    """kill -9 while the compiler runs, restart at once: the orphaned compiler keeps writing into
    its own private directory; the restart builds in a fresh one (discarding the orphan's) and
    loads, no fallback."""
    cache = tmp_path / "cache"
    home = tmp_path / "home"
    first = run_probe(cache, home, popen=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not _compiler_at_work(cache):
            assert first.poll() is None, first.stdout.read()
            assert time.time() < deadline, "the first build never started compiling"
            time.sleep(0.1)
        first.kill()  # SIGKILL to the Python process only: its compiler lives on
        first.wait()
        second = run_probe(cache, home)
        res = result(second)
        assert res["backend"].startswith("cpp-") and res["correct"] and res["why"] is None, res
        assert not res["warnings"], res
        key = _build.build_key()
        (e,) = [
            e
            for e in _build.inspect_cache(str(cache))
            if e["location"] == "cache" and e["key"] == key and e["problem"] is None
        ]
        assert e["verified"] and res["library"] == library_in(os.path.join(cache, key))
        # the orphan's directory was discarded (renamed away, deleted as far as it could be)
        assert not [n for n in os.listdir(cache) if n.startswith(".build-")], os.listdir(cache)
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)  # the orphaned compiler
        except ProcessLookupError:
            pass
        first.stdout.close()


def test_inspect_cache_reports_every_state_without_loading(tmp_path):
    cache = tmp_path / "cache"
    good = copy_build(cache)
    key = os.path.basename(good)
    (e,) = [e for e in _build.inspect_cache(str(cache)) if e["location"] == "cache"]
    assert e["directory"] == good and e["key"] == key and e["complete"] and e["verified"]
    assert e["problem"] is None and e["current"] and e["cuda"] is _build.with_cuda()
    assert e["size"] == os.path.getsize(library_in(good)) == e["recorded_size"]
    assert e["paddle_version"] == paddle.__version__
    # other states, each in its own key directory (names are any 16 hex digits)
    states = {}
    for n, how in enumerate(["truncated", "random-same-size"]):
        d = shutil.copytree(good, cache / f"{n:016x}")
        info = json.load(open(d / ".complete"))
        info["key"] = f"{n:016x}"
        os.chmod(d / ".complete", 0o644)
        json.dump(info, open(d / ".complete", "w"))
        lib = os.path.join(d, info["library"])
        _corrupt(lib, how)
        states[f"{n:016x}"] = EXPECTED_PROBLEM[how]
    os.makedirs(cache / "00000000000000f1")
    open(cache / "00000000000000f1" / ".failed", "w").write("nvcc: fake failure")
    states["00000000000000f1"] = "failed build: nvcc: fake failure"
    os.makedirs(cache / "00000000000000f2")
    states["00000000000000f2"] = "incomplete (build in progress or killed)"
    os.makedirs(cache / "00000000000000f3")
    open(cache / "00000000000000f3" / ".complete", "w").close()
    states["00000000000000f3"] = "completion marker from an older paddle_mgrad"
    os.makedirs(cache / f".build-{key}-x1y2z3")
    got = {e["directory"]: e for e in _build.inspect_cache(str(cache)) if e["location"] == "cache"}
    for k, problem in states.items():
        e = got[str(cache / k)]
        assert problem in (e["problem"] or ""), (k, e)
        assert not e["verified"] and not e["current"]
    partial = got[str(cache / f".build-{key}-x1y2z3")]
    assert (
        partial["problem"] == "incomplete (build in progress or killed)" and not partial["current"]
    )
    assert [
        e for e in _build.inspect_cache(str(tmp_path / "missing")) if e["location"] == "cache"
    ] == []


def test_verification_cost_is_small():
    """Hashing the library at every start: measured, well under the ~1 s a cached load takes."""
    root, key, _ = good_build()
    t = time.perf_counter()
    for _ in range(5):
        e = _build._examine(root, key)
    per = (time.perf_counter() - t) / 5
    assert e["verified"], e
    print(f"verify {e['size'] / 2**20:.1f} MiB: {per * 1e3:.1f} ms")
    assert per < 0.5
