"""Building the op: JIT cache reuse, cache key, ahead-of-time build into the package."""
import os
import subprocess
import sys
import textwrap

from paddle_mgrad.ops import _build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env=env, timeout=600, cwd="/")


def test_jit_cache_builds_once_per_key(tmp_path):
    first = _probe({"PADDLE_MGRAD_CACHE": str(tmp_path)})
    assert "BACKEND cpp-" in first.stdout, first.stdout + first.stderr
    assert "compiling the fused weight-gradient op" in first.stdout + first.stderr
    keys = os.listdir(tmp_path)
    assert keys == [_build.build_key()]
    assert os.path.exists(tmp_path / keys[0] / ".complete")
    second = _probe({"PADDLE_MGRAD_CACHE": str(tmp_path)})
    assert "BACKEND cpp-" in second.stdout, (second.returncode, second.stdout + second.stderr)
    assert "compiling the fused" not in second.stdout + second.stderr  # reused, not rebuilt


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


def test_ahead_of_time_build_needs_no_compile_at_runtime(tmp_path):
    target, cache = tmp_path / "site", tmp_path / "cache"
    cache.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
         "--target", str(target), ROOT],
        capture_output=True, text=True, timeout=900,
        env=dict(os.environ, PADDLE_MGRAD_BUILD_OPS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert list((target / "paddle_mgrad" / "_prebuilt").iterdir())
    probe = _probe({"PADDLE_MGRAD_CACHE": str(cache)}, pythonpath=str(target))
    assert "BACKEND cpp-" in probe.stdout, probe.stdout + probe.stderr
    assert "compiling the fused" not in probe.stdout + probe.stderr
    assert os.listdir(cache) == []  # nothing built into the user cache


def test_plain_install_after_an_ahead_of_time_build_ships_no_binaries(tmp_path):
    """pip builds in the source tree's build/: a _prebuilt left there by an AOT build must not
    end up in a later plain (JIT) install (it silently skipped the first-use build)."""
    stale = os.path.join(ROOT, "build", "lib", "paddle_mgrad", "_prebuilt", "stale")
    os.makedirs(stale, exist_ok=True)
    open(os.path.join(stale, ".complete"), "w").close()
    target = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k != "PADDLE_MGRAD_BUILD_OPS"}
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
         "--target", str(target), ROOT], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "paddle_mgrad" / "_csrc").is_dir()
    assert not (target / "paddle_mgrad" / "_prebuilt").exists()
