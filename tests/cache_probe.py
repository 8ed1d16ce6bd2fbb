"""Helpers for the op-cache tests (tests/ops/test_build.py, tests/ops/test_cache_security.py).

JIT builds cost ~10-60 s each on a small box, so most cache tests do not build: they copy the
build the suite already uses (:func:`good_build`) into temporary caches and run a fresh
interpreter on them (:func:`run_probe`).  Where the point is what happens around a rebuild
(fresh directory, marker, rename), :data:`FAKE_COMPILE` replaces only the compiler step by a
copy of that good build; the tests that are about the compiler itself build for real.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = os.path.join(ROOT, "paddle_mgrad_autoload.pth")
EVIDENCE = os.path.join(ROOT, "tests", "nlp", "evidence")
NOBODY = 65534
COMPILING = "compiling the fused weight-gradient op"

# What a user runs; prints one RESULT line (JSON) after it.
PROBE = """
import json, os, sys, warnings, zlib
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import paddle, paddle_mgrad.ops as o
    {patch}
    backend = o.backend()
from paddle_mgrad.ops import _build
module = o.load()
ok = None
if module is not None:
    import numpy as np
    x = paddle.to_tensor(np.arange(12, dtype="float32").reshape(4, 3))
    dy = paddle.to_tensor(np.arange(8, dtype="float32").reshape(4, 2) - 3)
    dw, _ = o.fused_linear_param_grad_add(x, dy, None, None, True, False)
    ok = bool(np.allclose(dw.numpy(), x.numpy().T @ dy.numpy()))
print("RESULT " + json.dumps({{
    "backend": backend, "why": o.fallback_reason(), "correct": ok,
    "library": _build.library_path(module) if module is not None else None,
    "warnings": [str(w.message) for w in caught if "paddle_mgrad" in str(w.message)]}}))
"""

FAKE_COMPILE = """
from paddle_mgrad.ops import _build
import shutil as _sh
def _fake_compile(build_dir, key, cuda, verbose=False):
    # what the compiler leaves: new files and directories with umask-given modes
    name = _build._op_name(key)
    src = os.path.join({good!r}, name)
    mask = os.umask(0); os.umask(mask)
    for dirpath, dirnames, filenames in os.walk(src):
        out = os.path.join(build_dir, name, os.path.relpath(dirpath, src))
        os.makedirs(out, exist_ok=True)
        for n in filenames:
            _sh.copyfile(os.path.join(dirpath, n), os.path.join(out, n))
            if n.endswith(".so"):
                os.chmod(os.path.join(out, n), 0o777 & ~mask)
    print("FAKE COMPILE", flush=True)
_build._compile = _fake_compile
"""


def good_build():
    """(root, key, key_dir) of the verified build this process loaded (building it once into
    the suite's cache when needed)."""
    from paddle_mgrad import ops
    from paddle_mgrad.ops import _build

    module = ops.load()
    assert module is not None, f"the op did not build here: {ops.fallback_reason()}"
    lib = _build.library_path(module)
    key_dir = os.path.dirname(os.path.dirname(lib))
    # the key of what this Paddle builds: CPU-only, or +CUDA on a CUDA wheel (nox -s gpu_wheel)
    assert os.path.basename(key_dir) == _build.build_key(), key_dir
    return os.path.dirname(key_dir), os.path.basename(key_dir), key_dir


def private_dir(path):
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return str(path)


def copy_build(root, key_dir=None):
    """Copy the good key directory into the cache ``root`` (made private); returns the copy."""
    key_dir = key_dir or good_build()[2]
    private_dir(root)
    dst = os.path.join(str(root), os.path.basename(key_dir))
    shutil.copytree(key_dir, dst, symlinks=True)
    return dst


def library_in(key_dir):
    from paddle_mgrad.ops import _build

    name = f"{_build.OP_PREFIX}_{os.path.basename(key_dir)}"
    return os.path.join(key_dir, name, name + ".so")


def home_with_build(tmp_path):
    """A HOME whose default cache (~/.cache/paddle_mgrad) holds a copy of the good build."""
    home = tmp_path / "home"
    copy_build(home / ".cache" / "paddle_mgrad")
    return home


def compile_planted(tmp_path, marker):
    """A shared library whose constructor writes ``marker``: code that must never run."""
    src = tmp_path / "planted.c"
    src.write_text(
        textwrap.dedent(f"""
        #include <stdio.h>
        __attribute__((constructor)) static void planted(void) {{
            FILE *f = fopen("{marker}", "w");
            if (f) {{ fputs("planted code ran\\n", f); fclose(f); }}
        }}
    """)
    )
    out = tmp_path / "planted.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return str(out)


def forge_marker(key_dir):
    """Rewrite .complete so that it describes the library now in ``key_dir`` (an attacker who can
    write the directory can do this too): only ownership/mode checks stop such a library."""
    import hashlib

    lib = library_in(key_dir)
    data = open(lib, "rb").read()
    path = os.path.join(key_dir, ".complete")
    info = json.load(open(path))
    info.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    os.chmod(path, 0o644)
    with open(path, "w") as f:
        json.dump(info, f)


def chown_tree(path, uid, gid=None):
    gid = uid if gid is None else gid
    for dirpath, dirnames, filenames in os.walk(path):
        os.lchown(dirpath, uid, gid)
        for n in dirnames + filenames:
            os.lchown(os.path.join(dirpath, n), uid, gid)


def modes(tree):
    """{relative path: mode} of everything under ``tree``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(tree):
        for n in [""] + dirnames + filenames:
            p = os.path.join(dirpath, n) if n else dirpath
            out[os.path.relpath(p, tree)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def run_probe(
    cache,
    home,
    patch="",
    pth=False,
    code=None,
    cwd="/",
    umask=None,
    start_new_session=False,
    popen=False,
    wrap=(),
    **env_extra,
):
    """Run :data:`PROBE` (or ``code``) in a fresh interpreter with ``PADDLE_MGRAD_CACHE=cache``
    and ``HOME=home``; with ``pth`` the interpreter processes paddle_mgrad_autoload.pth at start
    (as site-packages would); ``wrap`` prefixes the command (e.g. ``unshare ...``).  Returns the
    CompletedProcess (``popen``: the Popen)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_MGRAD")}
    env.update(PYTHONPATH=ROOT, HOME=str(home), PADDLE_MGRAD_CACHE=str(cache))
    if pth:
        env["PYTHONPATH"] = os.pathsep.join([EVIDENCE, ROOT])
        env["PMG_TEST_PTH_DIR"] = os.path.dirname(PTH)
    env.update(env_extra)
    if code is None:
        code = PROBE.format(patch=textwrap.indent(textwrap.dedent(patch), "    ").strip())
    kwargs = dict(env=env, cwd=cwd, text=True, start_new_session=start_new_session)
    if umask is not None:
        kwargs["umask"] = umask
    cmd = list(wrap) + [sys.executable, "-c", textwrap.dedent(code)]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
    return subprocess.run(cmd, capture_output=True, timeout=600, **kwargs)


def finish(proc, timeout=600):
    """Wait for a :func:`run_probe` ``popen``; a CompletedProcess (stderr merged into stdout)."""
    out, _ = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def result(proc):
    """The probe's RESULT dict; asserts it exited normally (no signal, no error)."""
    out = proc.stdout + (proc.stderr or "")
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: killed by a signal):\n{out}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, out
    return json.loads(lines[-1][len("RESULT ") :])
