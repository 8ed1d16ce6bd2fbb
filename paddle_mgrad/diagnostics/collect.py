"""The doctor's facts (:mod:`paddle_mgrad.diagnostics.doctor`): what this process can see without
importing Paddle -- versions of the installed distributions, the ``.pth``, every
``PADDLE_MGRAD*`` variable, the compilers and the CUDA toolkit -- and what the two probe
subprocesses (:mod:`paddle_mgrad.diagnostics._doctor_probe`) report: Paddle, the op cache, the
op and the self-tests.  :func:`collect` returns them as one dict; nothing here judges them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time

from .. import __version__, env as _env
from ._doctor_probe import MARK

PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # paddle_mgrad/
PTH = "paddle_mgrad_autoload.pth"
TESTED_PADDLE = ("2.6.2", "3.3.1")
PADDLE_INSTALL = (
    'pip install paddlepaddle==3.3.1 (CPU; or paddlepaddle==2.6.2 "numpy<2" '
    '"protobuf<5"; GPU: paddlepaddle-gpu)'
)
#: what a PaddleNLP / PaddleFormers release needs to import (tested; see docs/scaling-out.md)
NLP_PINS = {
    "aistudio-sdk": ("==", "0.1.7"),
    "huggingface_hub": ("<", "0.26"),
    "datasets": ("<", "3"),
    "pyarrow": ("<", "19"),
}
FORMERS_PINS = {"datasets": (">=<", ("3", "4")), "pyarrow": ("<", "19")}
GEMM_NAMES = {
    "cpp-onednn": "our C++ op, oneDNN GEMM",
    "cpp-portable": "our C++ op, OpenMP GEMM",
    "python": "pure-Paddle fallback (same results, slower)",
    "cuda": "our CUDA op (cuBLASLt)",
    "paddle-fused": "Paddle's own _C_ops.fused_linear_param_grad_add",
}
PROBE_TIMEOUT = {"paddle": 300, "op": 900}

_BOOTSTRAP = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
MARK = sys.argv[3]
def say(**d):
    sys.stdout.write(MARK + json.dumps(d) + "\n"); sys.stdout.flush()
say(step="import", started=True)
try:
    import zlib  # before paddle: Paddle 2.6
    import paddle
except BaseException as e:
    say(step="import", failed=(type(e).__name__ + ": " + str(e))[:1500])
    raise SystemExit(3)
say(step="import", ok=True)
from paddle_mgrad.diagnostics import _doctor_probe
raise SystemExit(_doctor_probe.main(sys.argv[2]))
"""


# ------------------------------------------------------------------ small helpers
def _vtuple(text):
    """'2.6.2' -> (2, 6, 2); '0.26.0rc1' -> (0, 26, 0); None -> None."""
    if not text:
        return None
    out = []
    for part in str(text).split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out) or None


def _pin_ok(version, pin):
    op, want = pin
    v = _vtuple(version)
    if v is None:
        return True
    if op == "==":
        return v == _vtuple(want)
    if op == "<":
        return v < _vtuple(want)
    lo, hi = want
    return _vtuple(lo) <= v < _vtuple(hi)


def _pin_text(name, pin):
    op, want = pin
    return f'"{name}>={want[0]},<{want[1]}"' if op == ">=<" else f'"{name}{op}{want}"'


def _dist_version(name):
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _error(e):
    return f"{type(e).__name__}: {e}".strip()[:1000]


def _signal_name(returncode):
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _load_build_config():
    """``ops/build_config.py`` by path: Paddle-free, but ``paddle_mgrad.ops`` imports Paddle."""
    path = os.path.join(PKG_DIR, "ops", "build_config.py")
    spec = importlib.util.spec_from_file_location("_paddle_mgrad_doctor_build_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tool(command):
    """Where a compiler command resolves and its first ``--version`` line."""
    path = shutil.which(command) if command else None
    out = {"command": command, "path": path, "version": None}
    if path:
        out["real_path"] = os.path.realpath(path)
        try:
            text = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=20
            ).stdout
            out["version"] = (text.strip().splitlines() or [None])[0]
        except (OSError, subprocess.SubprocessError) as e:
            out["version_error"] = _error(e)
    return out


# ------------------------------------------------------------------ facts, in this process
def _versions():
    import platform

    paddle_dists = {d: _dist_version(d) for d in ("paddlepaddle", "paddlepaddle-gpu")}
    out = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "paddle_dists": {k: v for k, v in paddle_dists.items() if v},
        "paddle_mgrad": __version__,
        "paddle_mgrad_path": PKG_DIR,
        "paddle_mgrad_installed": None,
        "paddle_mgrad_installed_path": None,
    }
    for name in ("paddlenlp", "paddleformers", "numpy", "protobuf", *NLP_PINS):
        out[name] = _dist_version(name)
    try:
        from importlib import metadata

        dist = metadata.distribution("paddle_mgrad")
        out["paddle_mgrad_installed"] = dist.version
        out["paddle_mgrad_installed_path"] = os.path.dirname(
            os.path.abspath(str(dist.locate_file("paddle_mgrad/__init__.py")))
        )
    except Exception:  # noqa: BLE001  (not installed: a source checkout on PYTHONPATH)
        pass
    return out


def _site_dirs():
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if getattr(site, "ENABLE_USER_SITE", False):
        dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(dirs))


def _switching_on(environ):
    dirs = _site_dirs()
    spec = importlib.util.find_spec("paddle_mgrad_autoload")  # finds, does not run it
    problems = {}
    variables = []
    for name in sorted(n for n in environ if n == _env.PREFIX or n.startswith(_env.PREFIX + "_")):
        found = _env.problems({name: environ[name]})  # env.py: the one table of variables
        kind, message = found[0] if found else ("ok", None)
        problems[name] = None if kind == "ok" else message
        item = {"name": name, "value": environ[name], "status": kind, "message": message}
        if kind == "ok":
            try:
                item["parsed"] = _env.get(name, environ)
            except Exception as e:  # noqa: BLE001
                item.update(status="invalid", message=_error(e))
        variables.append(item)
    activation = None
    if _env.raw(_env.PREFIX, environ) is not None and problems.get(_env.PREFIX) is None:
        activation = _env.get(_env.PREFIX, environ)
    ran = sys.modules.get("paddle_mgrad_autoload")
    pth = [os.path.join(d, PTH) for d in dirs if os.path.exists(os.path.join(d, PTH))]
    if ran is not None and not pth:  # processed from another site dir (site.addsitedir)
        pth = [os.path.join(d, PTH) for d in sys.path if d and os.path.exists(os.path.join(d, PTH))]
    return {
        "site_packages": dirs,
        "pth": pth,
        "autoload_module": getattr(spec, "origin", None),
        "autoload_ran_in_this_process": ran is not None,
        "variables": variables,
        "activation": activation,
    }


def _compilers(environ):
    cxx = environ.get("CXX") or "c++"
    cc = environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]
    return {
        "cxx": dict(_tool(cxx), env=environ.get("CXX")),
        "cc": dict(_tool(cc), env=environ.get("CC")),
    }


def _cuda_toolkit():
    bc = _load_build_config()
    tk = bc.find_cuda(need_thrust=True)  # what the op's build would use (never raises)
    return {
        "home": tk.home,
        "nvcc": tk.nvcc,
        "version": ".".join(map(str, tk.version)) if tk.version else None,
        "major": tk.major,
        "libs": dict(tk.libs),
        "source": dict(tk.source),
        "missing": list(tk.missing),
        "ok": tk.ok,
        "summary": tk.summary(),
    }


# ------------------------------------------------------------------ facts, from subprocesses
def probe_environ(variables, environ=None):
    """The probes' environment: no ``PADDLE_MGRAD`` (the doctor switches on itself, where it
    wants), no variable the doctor found invalid (reported already; it would stop the import)."""
    out = dict(os.environ if environ is None else environ)
    out.pop(_env.PREFIX, None)
    for v in variables:
        if v["status"] == "invalid":
            out.pop(v["name"], None)
    out.setdefault("PYTHONFAULTHANDLER", "1")  # a crash leaves its Python stack in stderr
    return out


def run_probe(which, environ, timeout):
    """Run one probe; returns its step records, exit status (signal name) and stderr's tail."""
    cmd = [sys.executable, "-c", _BOOTSTRAP, os.path.dirname(PKG_DIR), which, MARK]
    t0 = time.perf_counter()
    out = {
        "returncode": None,
        "signal": None,
        "timed_out": False,
        "steps": {},
        "crashed_in": None,
        "stderr_tail": "",
    }
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=timeout)
        stdout, stderr, out["returncode"] = res.stdout, res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        out["timed_out"] = True
        stdout = (
            e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        )
        stderr = (
            e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        )
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["signal"] = _signal_name(out["returncode"])
    for line in stdout.splitlines():
        if line.startswith(MARK):
            try:
                rec = json.loads(line[len(MARK) :])
            except ValueError:
                continue
            out["steps"][rec.pop("step")] = rec
    unfinished = [s for s, r in out["steps"].items() if r.get("started")]
    out["crashed_in"] = unfinished[-1] if unfinished else None
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    out["stderr_tail"] = "\n".join(lines[-25:])
    return out


def collect(environ=None, timeout=None, progress=None) -> dict:
    """Every fact the doctor reports (a dict of plain data); never raises."""
    environ = dict(os.environ if environ is None else environ)
    timeout = timeout or PROBE_TIMEOUT["op"]
    facts = {"doctor": {"version": __version__, "argv": sys.argv}, "errors": []}

    def section(name, fn, *args):
        try:
            facts[name] = fn(*args)
        except Exception as e:  # noqa: BLE001  (the doctor reports its own failure)
            facts[name] = None
            facts["errors"].append(f"{name}: {_error(e)}")

    section("versions", _versions)
    section("switch", _switching_on, environ)
    section("compilers", _compilers, environ)
    section("cuda_toolkit", _cuda_toolkit)
    variables = (facts.get("switch") or {}).get("variables", [])
    penv = probe_environ(variables, environ)
    if progress:
        progress("importing Paddle, listing the cache, seed case on Paddle's own recompute")
    facts["probe_paddle"] = run_probe("paddle", penv, PROBE_TIMEOUT["paddle"])
    paddle_ok = "version" in facts["probe_paddle"]["steps"].get("paddle", {})
    if paddle_ok:
        cache = facts["probe_paddle"]["steps"].get("cache", {})
        if progress and not cache.get("will_load") and not cache.get("failed"):
            progress(
                "the op is not built for this configuration yet: building it now (once, ~10-60 s)"
            )
        elif progress:
            progress("loading the op, seed case through paddle_mgrad")
        facts["probe_op"] = run_probe("op", penv, timeout)
    else:
        facts["probe_op"] = None
    # the command line keeps Paddle out of this process (a caller may have imported it anyway)
    facts["doctor"]["command_line"] = bool(
        getattr(sys.modules.get("paddle_mgrad"), "_AS_COMMAND_LINE", False)
    )
    facts["doctor"]["paddle_in_process"] = "paddle" in sys.modules
    return facts
