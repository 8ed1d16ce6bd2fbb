"""``python -m paddle_mgrad doctor``: what runs where, why, and whether it works -- one screen.

Sections: versions (Python, Paddle and its CUDA build, paddle_mgrad, PaddleNLP / PaddleFormers
and the pins they need); switching on (the autoload ``.pth`` in this environment, every
``PADDLE_MGRAD*`` variable that is set and whether :mod:`paddle_mgrad.env` accepts it); the op
(backend per device and why: the C++ compiler, the CUDA toolkit's nvcc / cuBLASLt / runtime and
what to install when one is missing; the CPU's ISA and the bf16 / fp16 / fp64 paths); the op cache
(each build: complete, verified, size, Paddle version); a self-test of the seed case (a PyLayer
linear saving its weight with ``ctx.save_for_backward`` under ``MixPrecisionLayer``'s fp32
``main_grad`` and non-reentrant recompute: on Paddle's own recompute -- does this Paddle lose
``main_grad``, do you need paddle_mgrad at all? -- and through paddle_mgrad, against float64);
a verdict.  Exit code 0 when healthy, 1 when something is wrong, each problem on one line with
its fix.  ``--json`` prints the same as one JSON object (CI, bug reports).

How it stays alive whatever is broken: this process imports no Paddle and nothing that does
(the package's ``__init__`` skips its imports for the command line, :mod:`paddle_mgrad._cli`;
the build configuration is loaded by path).  Everything that needs Paddle runs in two
subprocesses (:mod:`paddle_mgrad.diagnostics._doctor_probe`) with ``PADDLE_MGRAD`` and invalid variables
removed: the first imports Paddle, lists the cache (no library is loaded) and runs the seed case
on plain Paddle; the second loads -- or builds -- the op the way training would, so a corrupt
cached library kills that subprocess (SIGBUS, reported with the directory to delete), not the
doctor.  Every section catches its own errors: the doctor reports its own failure as a problem.
"""
from __future__ import annotations

import argparse
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

__all__ = ["main", "collect", "diagnose", "render"]

PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # paddle_mgrad/
PTH = "paddle_mgrad_autoload.pth"
TESTED_PADDLE = ("2.6.2", "3.3.1")
PADDLE_INSTALL = ('pip install paddlepaddle==3.3.1 (CPU; or paddlepaddle==2.6.2 "numpy<2" '
                  '"protobuf<5"; GPU: paddlepaddle-gpu)')
#: what a PaddleNLP / PaddleFormers release needs to import (tested; see docs/scaling-out.md)
NLP_PINS = {"aistudio-sdk": ("==", "0.1.7"), "huggingface_hub": ("<", "0.26"),
            "datasets": ("<", "3"), "pyarrow": ("<", "19")}
FORMERS_PINS = {"datasets": (">=<", ("3", "4")), "pyarrow": ("<", "19")}
GEMM_NAMES = {"cpp-onednn": "our C++ op, oneDNN GEMM", "cpp-portable": "our C++ op, OpenMP GEMM",
              "python": "pure-Paddle fallback (same results, slower)",
              "cuda": "our CUDA op (cuBLASLt)",
              "paddle-fused": "Paddle's own _C_ops.fused_linear_param_grad_add"}
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
            text = subprocess.run([path, "--version"], capture_output=True, text=True,
                                  timeout=20).stdout
            out["version"] = (text.strip().splitlines() or [None])[0]
        except (OSError, subprocess.SubprocessError) as e:
            out["version_error"] = _error(e)
    return out


# ------------------------------------------------------------------ facts, in this process
def _versions():
    import platform

    paddle_dists = {d: _dist_version(d) for d in ("paddlepaddle", "paddlepaddle-gpu")}
    out = {"python": platform.python_version(), "python_executable": sys.executable,
           "platform": platform.platform(),
           "paddle_dists": {k: v for k, v in paddle_dists.items() if v},
           "paddle_mgrad": __version__, "paddle_mgrad_path": PKG_DIR,
           "paddle_mgrad_installed": None, "paddle_mgrad_installed_path": None}
    for name in ("paddlenlp", "paddleformers", "numpy", "protobuf", *NLP_PINS):
        out[name] = _dist_version(name)
    try:
        from importlib import metadata

        dist = metadata.distribution("paddle_mgrad")
        out["paddle_mgrad_installed"] = dist.version
        out["paddle_mgrad_installed_path"] = os.path.dirname(
            os.path.abspath(str(dist.locate_file("paddle_mgrad/__init__.py"))))
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
    return {"site_packages": dirs, "pth": pth,
            "autoload_module": getattr(spec, "origin", None),
            "autoload_ran_in_this_process": ran is not None,
            "variables": variables, "activation": activation}


def _compilers(environ):
    cxx = environ.get("CXX") or "c++"
    cc = environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]
    return {"cxx": dict(_tool(cxx), env=environ.get("CXX")),
            "cc": dict(_tool(cc), env=environ.get("CC"))}


def _cuda_toolkit():
    bc = _load_build_config()
    tk = bc.find_cuda(need_thrust=True)  # what the op's build would use (never raises)
    return {"home": tk.home, "nvcc": tk.nvcc,
            "version": ".".join(map(str, tk.version)) if tk.version else None,
            "major": tk.major, "libs": dict(tk.libs), "source": dict(tk.source),
            "missing": list(tk.missing), "ok": tk.ok, "summary": tk.summary()}


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
    out = {"returncode": None, "signal": None, "timed_out": False, "steps": {},
           "crashed_in": None, "stderr_tail": ""}
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=timeout)
        stdout, stderr, out["returncode"] = res.stdout, res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        out["timed_out"] = True
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["signal"] = _signal_name(out["returncode"])
    for line in stdout.splitlines():
        if line.startswith(MARK):
            try:
                rec = json.loads(line[len(MARK):])
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
            progress("the op is not built for this configuration yet: building it now (once, "
                     "~10-60 s)")
        elif progress:
            progress("loading the op, seed case through paddle_mgrad")
        facts["probe_op"] = run_probe("op", penv, timeout)
    else:
        facts["probe_op"] = None
    # the command line keeps Paddle out of this process (a caller may have imported it anyway)
    facts["doctor"]["command_line"] = bool(getattr(sys.modules.get("paddle_mgrad"),
                                                   "_AS_COMMAND_LINE", False))
    facts["doctor"]["paddle_in_process"] = "paddle" in sys.modules
    return facts


# ------------------------------------------------------------------ diagnosis
def _step(facts, probe, step):
    p = facts.get(probe) or {}
    return (p.get("steps") or {}).get(step) or {}


def _install_commands(text):
    return re.findall(r"pip install [^;()]+?(?=$|;|\)|,? then)", text or "")


def _final_cache(facts):
    """The cache listing after the op was loaded (the op probe's), else the one before."""
    after = _step(facts, "probe_op", "cache_after")
    if after and not after.get("started") and not after.get("failed"):
        return after
    return _step(facts, "probe_paddle", "cache")


#: problems of a build that only matter for the build this configuration loads: another
#: configuration's failed or unfinished build (maybe in progress right now) is no fault
_ONLY_IF_CURRENT = ("failed build", "incomplete", "completion marker from an older")


def _cache_problem_matters(b):
    problem = str(b.get("problem") or "")
    if not problem:
        return False
    if b.get("security"):  # someone else could write what we would load
        return True
    if problem.startswith(_ONLY_IF_CURRENT):
        return bool(b.get("current")) and problem.startswith("failed build")
    return True  # truncated, hash mismatch, ...: corrupt, whichever configuration


def rebuilt(facts):
    """Builds that had a problem before the op was loaded and none after (the loader rebuilt
    them): ``[(directory, the problem it had)]``."""
    before = {b.get("directory"): b for b in _step(facts, "probe_paddle", "cache").get("builds", [])}
    after = _step(facts, "probe_op", "cache_after")
    if not after or after.get("started") or after.get("failed"):
        return []
    out = []
    for b in after.get("builds", []):
        old = before.get(b.get("directory"))
        if old and old.get("problem") and not b.get("problem") and b.get("complete"):
            out.append((b["directory"], old["problem"]))
    return out


def _var(facts, name):
    """The value of a variable as the doctor saw it (None when unset)."""
    for v in (facts.get("switch") or {}).get("variables", []):
        if v["name"] == name:
            return v["value"]
    return None


def _cxx_missing(facts):
    c = facts.get("compilers") or {}
    return [f"{k.upper()}={v['command']}" for k, v in c.items() if not v.get("path")]


def diagnose(facts) -> list:
    """``[{"area", "problem", "fix"}]``: everything that is wrong, each with its fix."""
    out = []

    def bad(area, problem, fix):
        out.append({"area": area, "problem": " ".join(str(problem).split()),
                    "fix": " ".join(str(fix).split())})

    for err in facts.get("errors", []):
        bad("doctor", f"the doctor failed collecting {err}",
            "report it: python -m paddle_mgrad doctor --json > doctor.json")
    ver = facts.get("versions") or {}
    dists = ver.get("paddle_dists") or {}
    if len(dists) > 1:
        bad("versions", "both paddlepaddle and paddlepaddle-gpu are installed (they overwrite "
            "each other's files)", "pip uninstall the one you do not want, then reinstall the other")
    paddle_v = next(iter(dists.values()), None)
    if paddle_v and _vtuple(paddle_v) and _vtuple(paddle_v) < (3,):
        if ver.get("numpy") and _vtuple(ver["numpy"]) >= (2,):
            bad("versions", f"Paddle {paddle_v} with numpy {ver['numpy']} (Paddle 2.6 needs numpy<2)",
                'pip install "numpy<2"')
        if ver.get("protobuf") and _vtuple(ver["protobuf"]) >= (5,):
            bad("versions", f"Paddle {paddle_v} with protobuf {ver['protobuf']}: fleet fails "
                "(\"hybrid_configs is not a attribute of DistributedStrategy\")",
                'pip install "protobuf<5"')
    for dist, pins in (("paddlenlp", NLP_PINS), ("paddleformers", FORMERS_PINS)):
        if not ver.get(dist):
            continue
        wrong = [f"{n} {ver.get(n)}" for n, pin in pins.items()
                 if ver.get(n) and not _pin_ok(ver.get(n), pin)]
        if wrong:
            bad("versions", f"{dist} {ver[dist]} does not import with {', '.join(wrong)}",
                "pip install " + " ".join(_pin_text(n, p) for n, p in pins.items()))

    sw = facts.get("switch") or {}
    for v in sw.get("variables", []):
        if v["status"] == "invalid":
            knob = next((k for k in _env.KNOBS if k.name == v["name"]), None)
            bad("environment", v["message"],
                f"export {v['name']}=<{knob.accepted if knob else 'a valid value'}> or unset it")
        elif v["status"] == "unknown":
            m = re.search(r"did you mean (\w+)\?", v["message"] or "")
            bad("environment", v["message"],
                f"rename it to {m.group(1)}" if m else f"unset {v['name']} (see docs/environment.md)")
    act = sw.get("activation")
    if act and any(act.values()) and not (sw.get("pth") or sw.get("autoload_ran_in_this_process")):
        bad("switch on", f"PADDLE_MGRAD={_var(facts, 'PADDLE_MGRAD')!r} is set but the "
            f"autoload {PTH} is not installed in this environment's site-packages "
            f"({', '.join(sw.get('site_packages', [])) or '?'}): the variable does nothing here",
            "pip install the package (pip install . in its checkout; PYTHONPATH is not enough), "
            "or call paddle_mgrad.enable() in the script")
    if sw.get("pth") and not sw.get("autoload_module"):
        bad("switch on", f"{sw['pth'][0]} is installed but the module it imports "
            "(paddle_mgrad_autoload) is not: every Python start prints an error",
            "pip install --force-reinstall the package, or delete the .pth file")

    pp = facts.get("probe_paddle") or {}
    pst = _step(facts, "probe_paddle", "paddle")
    if "version" not in pst:
        why = (_step(facts, "probe_paddle", "import").get("failed") or pst.get("failed")
               or (f"killed by {pp.get('signal')}" if pp.get("signal") else
                   "timed out" if pp.get("timed_out") else
                   f"exit code {pp.get('returncode')}"))
        if not dists:
            fix = PADDLE_INSTALL
        elif paddle_v and _vtuple(paddle_v) < (3,) and _vtuple(ver.get("numpy")) and \
                _vtuple(ver.get("numpy")) >= (2,):
            fix = 'pip install "numpy<2"'
        else:
            fix = f"reinstall Paddle (pip install --force-reinstall {next(iter(dists))}=={paddle_v})"
        bad("paddle", f"Paddle does not import: {why}", fix)
        return out  # nothing below can be known without Paddle
    paddle_cuda = bool(pst.get("cuda"))

    cache = _step(facts, "probe_paddle", "cache")  # before loading the op (what will_load says)
    final = _final_cache(facts)  # after loading it, when the op probe got that far
    if final.get("failed"):
        bad("cache", f"listing the op cache failed: {final['failed']}",
            "report it: python -m paddle_mgrad doctor --json > doctor.json")
    for b in final.get("builds", []):
        if _cache_problem_matters(b):
            bad("cache", f"build {b.get('directory')}: {b['problem']}",
                f"delete it: rm -rf {b.get('directory')} (the next use rebuilds it)")

    po = facts.get("probe_op") or {}
    op = _step(facts, "probe_op", "op")
    crashed = po.get("crashed_in") or ((po.get("signal") or po.get("timed_out")) and "op")
    if crashed:
        how = (f"was killed by {po['signal']}" if po.get("signal") else
               "timed out" if po.get("timed_out") else f"exited with {po.get('returncode')}")
        dirs = cache.get("will_load") or []
        if crashed in ("op", "import"):
            where = (f"a corrupt op build in {', '.join(dirs)}" if dirs else
                     "while building/loading the op")
            fix = (f"delete it: rm -rf {' '.join(dirs)} (the next use rebuilds it)" if dirs else
                   "rerun; if it repeats, report it with python -m paddle_mgrad doctor --json")
            bad("op", f"loading the op {how}: {where}", fix)
        else:
            bad("op", f"the op probe {how} in step {crashed}",
                "report it: python -m paddle_mgrad doctor --json > doctor.json")
    elif op.get("failed"):
        bad("op", f"loading the op raised {op['failed']}",
            "report it: python -m paddle_mgrad doctor --json > doctor.json")
    backends = op.get("backends") or {}
    if backends.get("cpu") == "python" and op.get("fallback_reason") != "PADDLE_MGRAD_OPS=python":
        missing = _cxx_missing(facts)
        reason = (op.get("fallback_reason") or "")[:300]
        fix = ("install a C++17 compiler (e.g. apt-get install g++) or point CC/CXX at one "
               f"({', '.join(missing)} not found)" if missing else
               "see the build error; check `c++ --version` works and the cache directory is "
               "writable, then rerun")
        bad("op", f"the C++ op could not be built, CPU tensors run the pure-Paddle fallback "
            f"(same results, slower): {reason}", fix)
    gpu = backends.get("gpu")
    no_cuda = any(v["name"] == "PADDLE_MGRAD_NO_CUDA" and v.get("parsed") for v in
                  sw.get("variables", []))
    if paddle_cuda and gpu and gpu != "cuda" and not no_cuda and backends.get("cpu") != "python":
        why = op.get("cuda_fallback_reason") or "unknown"
        cmds = _install_commands(why) or _install_commands(
            "; ".join((facts.get("cuda_toolkit") or {}).get("missing", [])))
        if cmds:
            fix = " && ".join(dict.fromkeys(c.strip() for c in cmds))
        elif "nvcc" in why and "missing" in why:
            fix = "install the CUDA toolkit (nvcc) and set CUDA_HOME to it"
        else:
            fix = (f"fix the build error, then delete {cache.get('root')}/<key> with a .failed "
                   "file to retry (or set PADDLE_MGRAD_NO_CUDA=1 to stop trying)")
        bad("op", f"GPU tensors run {GEMM_NAMES.get(gpu, gpu)}, not our CUDA op: {why[:300]}", fix)

    # any other step that raised: the doctor could not find out something it reports
    for probe, step in (("probe_paddle", "paddle"), ("probe_paddle", "selftest_paddle"),
                        ("probe_op", "cache_after"), ("probe_op", "cpu")):
        failed = _step(facts, probe, step).get("failed")
        if failed:
            bad("doctor", f"the doctor's step '{step}' failed: {failed}",
                "report it: python -m paddle_mgrad doctor --json > doctor.json")

    st = _step(facts, "probe_op", "selftest_paddle_mgrad")
    if po and not crashed and st and not st.get("started"):
        wrong = []
        if st.get("failed") or st.get("error"):
            wrong.append(st.get("failed") or st.get("error"))
        else:
            if not st.get("backward_got_parameter"):
                wrong.append(f"backward got a copy ({', '.join(st.get('saved_names', []))})")
            if not st.get("main_grad_ok"):
                wrong.append(f"main_grad off the float64 reference (max rel err {st.get('max_rel_err')})")
            if st.get("through_paddle_mgrad") is False:
                wrong.append(f"did not run through paddle_mgrad ({st.get('ours')})")
        if wrong:
            bad("self-test", "the seed case through paddle_mgrad failed: " + "; ".join(wrong),
                "report it: python -m paddle_mgrad doctor --json > doctor.json")
    return out


def _needs_line(facts):
    """Does this Paddle lose main_grad in the seed case (do you need paddle_mgrad)?"""
    st = _step(facts, "probe_paddle", "selftest_paddle")
    if not st or st.get("started"):
        return "not run"
    if st.get("error") or st.get("failed"):
        return f"Paddle's own recompute fails on the seed case: {st.get('error') or st.get('failed')}"
    if not st.get("backward_got_parameter") or not st.get("backward_had_main_grad"):
        names = ", ".join(st.get("saved_names", []))
        return (f"LOSES main_grad: its non-reentrant recompute hands the PyLayer's backward a copy "
                f"({names}) without main_grad -- you need paddle_mgrad (PADDLE_MGRAD=recompute "
                "or all)")
    return ("keeps main_grad in the seed case (backward gets the parameter): this Paddle has "
            "no seed bug; paddle_mgrad adds the CPU fused op and the fixes in docs/how-it-works.md")


def verdict(facts, problems):
    if problems:
        return f"{len(problems)} problem(s), each with its fix below"
    op = _step(facts, "probe_op", "op")
    return f"healthy: op {op.get('backend', '?')}; the seed case is exact through paddle_mgrad"


# ------------------------------------------------------------------ rendering
def _size(n):
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0


def _paths_line(cpu, op, fp64_kernel):
    """The bf16 / fp16 / fp64 CPU paths (cpu_info() keys when the op reports them)."""
    if not cpu or op.get("backends", {}).get("cpu") == "python":
        return "bf16/fp16/fp64: pure-Paddle fallback"
    isa = set((cpu.get("isa") or "").split())
    sgemm = "oneDNN sgemm" if op.get("backends", {}).get("cpu") == "cpp-onednn" else "OpenMP sgemm"
    bf16 = {"onednn-bf16": "oneDNN bf16 GEMM (native)",
            "widen-sgemm": f"widened to fp32 + {sgemm}"}.get(cpu.get("bf16_path"), cpu.get("bf16_path"))
    fp16 = cpu.get("fp16_path") or f"widened ({'F16C' if 'f16c' in isa else 'portable'}) + {sgemm}"
    forced = (fp64_kernel or "").strip().lower() == "generic"
    fp64 = cpu.get("fp64_path") or ("blocked DGEMM, " + (
        "generic kernel (forced)" if forced else
        "AVX2+FMA kernel" if {"avx2", "fma"} <= isa else "generic kernel"))
    return f"bf16: {bf16}; fp16: {fp16}; fp64: {fp64}"


def render(facts, problems) -> str:
    L = []
    add = L.append
    ver = facts.get("versions") or {}
    pst = _step(facts, "probe_paddle", "paddle")
    add("paddle_mgrad doctor  (python -m paddle_mgrad doctor --json for the full report)")
    add(f"versions   Python {ver.get('python')} ({ver.get('python_executable')})")
    if "version" in pst:
        cuda = (f"built with CUDA {pst.get('cuda_version') or ''}, {pst.get('gpus', '?')} GPU(s)"
                if pst.get("cuda") else "built without CUDA")
        tested = "" if pst["version"] in TESTED_PADDLE else f" (tested: {', '.join(TESTED_PADDLE)})"
        add(f"           Paddle {pst['version']} ({', '.join(ver.get('paddle_dists') or {}) or '?'}), "
            f"{cuda}{tested}")
    else:
        dists = ", ".join(f"{k} {v}" for k, v in (ver.get("paddle_dists") or {}).items())
        add(f"           Paddle {dists or 'not installed'}: does not import")
    where = ("installed" if ver.get("paddle_mgrad_installed_path") == ver.get("paddle_mgrad_path")
             else "source checkout" + (f"; installed {ver['paddle_mgrad_installed']} at "
                                      f"{ver['paddle_mgrad_installed_path']} is shadowed"
                                      if ver.get("paddle_mgrad_installed") else ", not installed"))
    add(f"           paddle_mgrad {ver.get('paddle_mgrad')} ({ver.get('paddle_mgrad_path')}, {where})")
    extra = [f"{n} {ver[n]}" for n in ("paddlenlp", "paddleformers", "numpy", "protobuf") if ver.get(n)]
    add("           " + ", ".join(extra))

    sw = facts.get("switch") or {}
    pth = (f"autoload .pth installed ({sw['pth'][0]})" if sw.get("pth") else
           "autoload .pth NOT installed in this environment (PADDLE_MGRAD does nothing; "
           "enable() and the trainer flag work)")
    add(f"switch on  {pth}")
    variables = sw.get("variables") or []
    if not variables:
        add("           no PADDLE_MGRAD* variable set (off unless the script calls enable())")
    for v in variables:
        state = "ok" if v["status"] == "ok" else v["status"].upper() + ": " + (v["message"] or "")
        add(f"           {v['name']}={v['value']}  {state}")

    op = _step(facts, "probe_op", "op")
    cpu = _step(facts, "probe_op", "cpu")
    b = op.get("backends") or {}
    if b:
        why = f" ({op['fallback_reason'][:150]})" if op.get("fallback_reason") else ""
        add(f"op         CPU tensors: {GEMM_NAMES.get(b.get('cpu'), b.get('cpu'))}{why}")
        if b.get("gpu") is None:
            add("           GPU tensors: none (Paddle built without CUDA)")
        else:
            why = op.get("cuda_fallback_reason")
            add(f"           GPU tensors: {GEMM_NAMES.get(b['gpu'], b['gpu'])}"
                + (f" ({why[:150]})" if why and b["gpu"] != "cuda" else ""))
        if op.get("library"):
            built = not _step(facts, "probe_paddle", "cache").get("will_load")
            add(f"           {'built and loaded' if built else 'loaded'} in {op.get('seconds')} s "
                f"from {op['library']}")
    else:
        add("op         not loaded" + (f" (probe {facts['probe_op'].get('signal') or 'failed'})"
                                       if facts.get("probe_op") else ""))
    comp = facts.get("compilers") or {}
    cxx = comp.get("cxx") or {}
    add(f"           compiler: {cxx.get('command')} -> "
        + (f"{cxx.get('real_path')} ({cxx.get('version')})" if cxx.get("path") else "NOT FOUND"))
    tk = facts.get("cuda_toolkit") or {}
    if pst.get("cuda"):
        add(f"           CUDA toolkit: {tk.get('summary')}")
    else:
        add("           CUDA toolkit: not needed (CPU Paddle)"
            + (f"; found CUDA {tk['version']} at {tk['home']}" if tk.get("home") else ""))
    if cpu and "isa" in cpu:
        add(f"cpu        {cpu.get('isa')}; native bf16: {cpu.get('native_bf16')}")
        add(f"           {_paths_line(cpu, op, _var(facts, 'PADDLE_MGRAD_CPU_FP64_KERNEL'))}")

    cache = _final_cache(facts)
    if cache.get("root"):
        src = "PADDLE_MGRAD_CACHE" if cache.get("from_env") else "default"
        builds = cache.get("builds") or []
        add(f"cache      {cache['root']} ({src}; {len(builds)} build(s), lister: {cache.get('lister')})")
        for bld in builds[:8]:
            flags = (["prebuilt"] if bld.get("location") == "prebuilt" else []) + [
                     "current" if bld.get("current") else "other configuration",
                     "complete" if bld.get("complete") else "incomplete",
                     {True: "verified", False: "NOT verified", None: "not checked"}[bld.get("verified")]]
            if bld.get("paddle_version"):
                flags.append(f"Paddle {bld['paddle_version']}")
            if bld.get("cuda") is not None:
                flags.append("cuda" if bld.get("cuda") else "cpu")
            add(f"           {bld.get('key')}  {', '.join(flags)}, {_size(bld.get('size'))}"
                + (f"  PROBLEM: {bld['problem'][:120]}" if bld.get("problem") else ""))
        if len(builds) > 8:
            add(f"           ... {len(builds) - 8} more (--json lists all)")
        for directory, problem in rebuilt(facts):
            add(f"           rebuilt while loading: {directory} (was: {problem[:120]})")
    st = _step(facts, "probe_op", "selftest_paddle_mgrad")
    add(f"self-test  this Paddle: {_needs_line(facts)}")
    if st and not st.get("started"):
        if st.get("error") or st.get("failed"):
            add(f"           paddle_mgrad: FAILED: {st.get('error') or st.get('failed')}")
        else:
            add(f"           paddle_mgrad: backward gets the parameter: {st.get('backward_got_parameter')}, "
                f"main_grad vs float64: max rel err {st.get('max_rel_err'):.1e} "
                f"({'exact' if st.get('main_grad_ok') else 'WRONG'}), our recompute/op calls "
                f"{(st.get('ours') or {}).get('recompute')}/{(st.get('ours') or {}).get('op_calls')}"
                f" [{st.get('seconds')} s]")
    add(f"verdict    {verdict(facts, problems)}")
    for p in problems:
        add(f"  problem: [{p['area']}] {p['problem']}  ->  fix: {p['fix']}")
    return "\n".join(L)


# ------------------------------------------------------------------ entry point
def _drop_autoload_hook():
    """This process never switches paddle_mgrad on (it must not load the op): remove the
    ``.pth``'s pending import hook, if any."""
    hook = sys.modules.get("paddle_mgrad_autoload")
    cls = getattr(hook, "_PaddleImportHook", None)
    if cls is not None:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, cls)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paddle_mgrad doctor",
        description="What paddle_mgrad runs where, why, and whether it works. Exit code 0 when "
                    "healthy, 1 when something is wrong (each problem with its fix).")
    parser.add_argument("--json", action="store_true", help="print one JSON object (CI, bug reports)")
    parser.add_argument("--timeout", type=float, default=PROBE_TIMEOUT["op"],
                        help="seconds allowed to load or build the op (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        _drop_autoload_hook()
        progress = None if args.json else (
            lambda msg: print(f"paddle_mgrad doctor: {msg} ...", file=sys.stderr, flush=True))
        facts = collect(timeout=args.timeout, progress=progress)
        problems = diagnose(facts)
        code = 1 if problems else 0
        if args.json:
            print(json.dumps({"exit_code": code, "verdict": verdict(facts, problems),
                              "needs_paddle_mgrad": _needs_line(facts),
                              "rebuilt": [{"directory": d, "was": p} for d, p in rebuilt(facts)],
                              "problems": problems, "facts": facts}, indent=1, default=str))
        else:
            print(render(facts, problems))
        return code
    except Exception as e:  # noqa: BLE001  (never a traceback: one line, exit 1)
        print(f"paddle_mgrad doctor: internal error {_error(e)}; fix: report it "
              "(python -m paddle_mgrad doctor --json)", file=sys.stdout)
        return 1
