"""The doctor's judgement (:mod:`paddle_mgrad.diagnostics.doctor`): from the facts
:mod:`.collect` gathered, every problem with its fix (:func:`diagnose`), which cached builds the
loader rebuilt (:func:`rebuilt`) and the one-line verdict (:func:`verdict`).  Pure functions of
the facts dict: no process, no file, no Paddle.
"""

from __future__ import annotations

import re

from .. import env as _env
from .collect import (
    FORMERS_PINS,
    GEMM_NAMES,
    NLP_PINS,
    PADDLE_INSTALL,
    PTH,
    _pin_ok,
    _pin_text,
    _vtuple,
)


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
    before = {
        b.get("directory"): b for b in _step(facts, "probe_paddle", "cache").get("builds", [])
    }
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
    """``[{"area", "problem", "fix"}]``: everything that is wrong, each with its fix -- one judge
    per area, in the order the screen lists them; nothing past Paddle when it does not import."""
    out = []

    def bad(area, problem, fix):
        out.append(
            {
                "area": area,
                "problem": " ".join(str(problem).split()),
                "fix": " ".join(str(fix).split()),
            }
        )

    _judge_versions(facts, bad)
    _judge_switch(facts, bad)
    if not _judge_paddle(facts, bad):
        return out  # nothing below can be known without Paddle
    _judge_cache(facts, bad)
    crashed = _judge_op_load(facts, bad)
    _judge_backends(facts, bad)
    _judge_steps(facts, bad)
    _judge_selftest(facts, bad, crashed)
    return out


def _paddle_versions(facts):
    """(versions, the installed Paddle distributions, Paddle's version or None)."""
    ver = facts.get("versions") or {}
    dists = ver.get("paddle_dists") or {}
    return ver, dists, next(iter(dists.values()), None)


def _judge_versions(facts, bad):
    """The doctor's own failures, Paddle's wheel and its numpy/protobuf, PaddleNLP's pins."""
    for err in facts.get("errors", []):
        bad(
            "doctor",
            f"the doctor failed collecting {err}",
            "report it: python -m paddle_mgrad doctor --json > doctor.json",
        )
    ver, dists, paddle_v = _paddle_versions(facts)
    if len(dists) > 1:
        bad(
            "versions",
            "both paddlepaddle and paddlepaddle-gpu are installed (they overwrite "
            "each other's files)",
            "pip uninstall the one you do not want, then reinstall the other",
        )
    if paddle_v and _vtuple(paddle_v) and _vtuple(paddle_v) < (3,):
        if ver.get("numpy") and _vtuple(ver["numpy"]) >= (2,):
            bad(
                "versions",
                f"Paddle {paddle_v} with numpy {ver['numpy']} (Paddle 2.6 needs numpy<2)",
                'pip install "numpy<2"',
            )
        if ver.get("protobuf") and _vtuple(ver["protobuf"]) >= (5,):
            bad(
                "versions",
                f"Paddle {paddle_v} with protobuf {ver['protobuf']}: fleet fails "
                '("hybrid_configs is not a attribute of DistributedStrategy")',
                'pip install "protobuf<5"',
            )
    for dist, pins in (("paddlenlp", NLP_PINS), ("paddleformers", FORMERS_PINS)):
        if not ver.get(dist):
            continue
        wrong = [
            f"{n} {ver.get(n)}"
            for n, pin in pins.items()
            if ver.get(n) and not _pin_ok(ver.get(n), pin)
        ]
        if wrong:
            bad(
                "versions",
                f"{dist} {ver[dist]} does not import with {', '.join(wrong)}",
                "pip install " + " ".join(_pin_text(n, p) for n, p in pins.items()),
            )


def _judge_switch(facts, bad):
    """PADDLE_MGRAD* variables (invalid, unknown) and the autoload .pth."""
    sw = facts.get("switch") or {}
    for v in sw.get("variables", []):
        if v["status"] == "invalid":
            knob = next((k for k in _env.KNOBS if k.name == v["name"]), None)
            bad(
                "environment",
                v["message"],
                f"export {v['name']}=<{knob.accepted if knob else 'a valid value'}> or unset it",
            )
        elif v["status"] == "unknown":
            m = re.search(r"did you mean (\w+)\?", v["message"] or "")
            bad(
                "environment",
                v["message"],
                f"rename it to {m.group(1)}"
                if m
                else f"unset {v['name']} (see docs/environment.md)",
            )
    act = sw.get("activation")
    if act and any(act.values()) and not (sw.get("pth") or sw.get("autoload_ran_in_this_process")):
        bad(
            "switch on",
            f"PADDLE_MGRAD={_var(facts, 'PADDLE_MGRAD')!r} is set but the "
            f"autoload {PTH} is not installed in this environment's site-packages "
            f"({', '.join(sw.get('site_packages', [])) or '?'}): the variable does nothing here",
            "pip install the package (pip install . in its checkout; PYTHONPATH is not enough), "
            "or call paddle_mgrad.enable() in the script",
        )
    if sw.get("pth") and not sw.get("autoload_module"):
        bad(
            "switch on",
            f"{sw['pth'][0]} is installed but the module it imports "
            "(paddle_mgrad_autoload) is not: every Python start prints an error",
            "pip install --force-reinstall the package, or delete the .pth file",
        )


def _judge_paddle(facts, bad) -> bool:
    """Whether Paddle imports in the probe; when not, why and what to install."""
    ver, dists, paddle_v = _paddle_versions(facts)
    pp = facts.get("probe_paddle") or {}
    pst = _step(facts, "probe_paddle", "paddle")
    if "version" not in pst:
        why = (
            _step(facts, "probe_paddle", "import").get("failed")
            or pst.get("failed")
            or (
                f"killed by {pp.get('signal')}"
                if pp.get("signal")
                else "timed out"
                if pp.get("timed_out")
                else f"exit code {pp.get('returncode')}"
            )
        )
        if not dists:
            fix = PADDLE_INSTALL
        elif (
            paddle_v
            and _vtuple(paddle_v) < (3,)
            and _vtuple(ver.get("numpy"))
            and _vtuple(ver.get("numpy")) >= (2,)
        ):
            fix = 'pip install "numpy<2"'
        else:
            fix = (
                f"reinstall Paddle (pip install --force-reinstall {next(iter(dists))}=={paddle_v})"
            )
        bad("paddle", f"Paddle does not import: {why}", fix)
        return False
    return True


def _judge_cache(facts, bad):
    """Builds in the op cache with a problem that matters (corrupt, unsafe, this key failed)."""
    final = _final_cache(facts)  # after loading it, when the op probe got that far
    if final.get("failed"):
        bad(
            "cache",
            f"listing the op cache failed: {final['failed']}",
            "report it: python -m paddle_mgrad doctor --json > doctor.json",
        )
    for b in final.get("builds", []):
        if _cache_problem_matters(b):
            bad(
                "cache",
                f"build {b.get('directory')}: {b['problem']}",
                f"delete it: rm -rf {b.get('directory')} (the next use rebuilds it)",
            )


def _judge_op_load(facts, bad):
    """Loading the op: a crash (a corrupt build), a timeout, an exception.  Returns the step the
    op probe died in (None when it did not)."""
    cache = _step(facts, "probe_paddle", "cache")  # before loading the op (what will_load says)
    po = facts.get("probe_op") or {}
    op = _step(facts, "probe_op", "op")
    crashed = po.get("crashed_in") or ((po.get("signal") or po.get("timed_out")) and "op")
    if crashed:
        how = (
            f"was killed by {po['signal']}"
            if po.get("signal")
            else "timed out"
            if po.get("timed_out")
            else f"exited with {po.get('returncode')}"
        )
        dirs = cache.get("will_load") or []
        if crashed in ("op", "import"):
            where = (
                f"a corrupt op build in {', '.join(dirs)}"
                if dirs
                else "while building/loading the op"
            )
            fix = (
                f"delete it: rm -rf {' '.join(dirs)} (the next use rebuilds it)"
                if dirs
                else "rerun; if it repeats, report it with python -m paddle_mgrad doctor --json"
            )
            bad("op", f"loading the op {how}: {where}", fix)
        else:
            bad(
                "op",
                f"the op probe {how} in step {crashed}",
                "report it: python -m paddle_mgrad doctor --json > doctor.json",
            )
    elif op.get("failed"):
        bad(
            "op",
            f"loading the op raised {op['failed']}",
            "report it: python -m paddle_mgrad doctor --json > doctor.json",
        )
    return crashed


def _judge_backends(facts, bad):
    """CPU tensors on the pure-Paddle fallback, GPU tensors not on our CUDA op: why and the fix."""
    op = _step(facts, "probe_op", "op")
    cache = _step(facts, "probe_paddle", "cache")
    sw = facts.get("switch") or {}
    paddle_cuda = bool(_step(facts, "probe_paddle", "paddle").get("cuda"))
    backends = op.get("backends") or {}
    if backends.get("cpu") == "python" and op.get("fallback_reason") != "PADDLE_MGRAD_OPS=python":
        missing = _cxx_missing(facts)
        reason = (op.get("fallback_reason") or "")[:300]
        fix = (
            "install a C++17 compiler (e.g. apt-get install g++) or point CC/CXX at one "
            f"({', '.join(missing)} not found)"
            if missing
            else "see the build error; check `c++ --version` works and the cache directory is "
            "writable, then rerun"
        )
        bad(
            "op",
            f"the C++ op could not be built, CPU tensors run the pure-Paddle fallback "
            f"(same results, slower): {reason}",
            fix,
        )
    gpu = backends.get("gpu")
    no_cuda = any(
        v["name"] == "PADDLE_MGRAD_NO_CUDA" and v.get("parsed") for v in sw.get("variables", [])
    )
    if paddle_cuda and gpu and gpu != "cuda" and not no_cuda and backends.get("cpu") != "python":
        why = op.get("cuda_fallback_reason") or "unknown"
        cmds = _install_commands(why) or _install_commands(
            "; ".join((facts.get("cuda_toolkit") or {}).get("missing", []))
        )
        if cmds:
            fix = " && ".join(dict.fromkeys(c.strip() for c in cmds))
        elif "nvcc" in why and "missing" in why:
            fix = "install the CUDA toolkit (nvcc) and set CUDA_HOME to it"
        else:
            fix = (
                f"fix the build error, then delete {cache.get('root')}/<key> with a .failed "
                "file to retry (or set PADDLE_MGRAD_NO_CUDA=1 to stop trying)"
            )
        bad("op", f"GPU tensors run {GEMM_NAMES.get(gpu, gpu)}, not our CUDA op: {why[:300]}", fix)


def _judge_steps(facts, bad):
    """Any other probe step that raised: the doctor could not find out something it reports."""
    for probe, step in (
        ("probe_paddle", "paddle"),
        ("probe_paddle", "selftest_paddle"),
        ("probe_op", "cache_after"),
        ("probe_op", "cpu"),
    ):
        failed = _step(facts, probe, step).get("failed")
        if failed:
            bad(
                "doctor",
                f"the doctor's step '{step}' failed: {failed}",
                "report it: python -m paddle_mgrad doctor --json > doctor.json",
            )


def _judge_selftest(facts, bad, crashed):
    """The seed case through paddle_mgrad (when the op probe got there)."""
    po = facts.get("probe_op") or {}
    st = _step(facts, "probe_op", "selftest_paddle_mgrad")
    if po and not crashed and st and not st.get("started"):
        wrong = []
        if st.get("failed") or st.get("error"):
            wrong.append(st.get("failed") or st.get("error"))
        else:
            if not st.get("backward_got_parameter"):
                wrong.append(f"backward got a copy ({', '.join(st.get('saved_names', []))})")
            if not st.get("main_grad_ok"):
                wrong.append(
                    f"main_grad off the float64 reference (max rel err {st.get('max_rel_err')})"
                )
            if st.get("through_paddle_mgrad") is False:
                wrong.append(f"did not run through paddle_mgrad ({st.get('ours')})")
        if wrong:
            bad(
                "self-test",
                "the seed case through paddle_mgrad failed: " + "; ".join(wrong),
                "report it: python -m paddle_mgrad doctor --json > doctor.json",
            )


def _needs_line(facts):
    """Does this Paddle lose main_grad in the seed case (do you need paddle_mgrad)?"""
    st = _step(facts, "probe_paddle", "selftest_paddle")
    if not st or st.get("started"):
        return "not run"
    if st.get("error") or st.get("failed"):
        return (
            f"Paddle's own recompute fails on the seed case: {st.get('error') or st.get('failed')}"
        )
    if not st.get("backward_got_parameter") or not st.get("backward_had_main_grad"):
        names = ", ".join(st.get("saved_names", []))
        return (
            f"LOSES main_grad: its non-reentrant recompute hands the PyLayer's backward a copy "
            f"({names}) without main_grad -- you need paddle_mgrad (PADDLE_MGRAD=recompute "
            "or all)"
        )
    return (
        "keeps main_grad in the seed case (backward gets the parameter): this Paddle has "
        "no seed bug; paddle_mgrad adds the CPU fused op and the fixes in docs/how-it-works.md"
    )


def verdict(facts, problems):
    if problems:
        return f"{len(problems)} problem(s), each with its fix below"
    op = _step(facts, "probe_op", "op")
    return f"healthy: op {op.get('backend', '?')}; the seed case is exact through paddle_mgrad"
