"""``python -m paddle_mgrad doctor``: a healthy install, a missing compiler, a corrupt cached op
build, bad environment values, Paddle without CUDA (and a CUDA Paddle missing cuBLASLt, by its
facts), a Paddle that does not import -- each asserted by exit code and the problem/fix lines.

The doctor runs as users run it: a fresh interpreter, ``python -m paddle_mgrad doctor`` (or the
``paddle-mgrad`` script's form), where the ``.pth`` switch is active (tests/nlp/evidence's
sitecustomize processes a copy, as site-packages would).
"""

import glob
import json
import os
import shutil
import subprocess
import sys

import paddle
import pytest

from helpers import PADDLE2, ROOT
from paddle_mgrad import _cli, ops
from paddle_mgrad.diagnostics import doctor
from paddle_mgrad.ops import _build, build_config

EVIDENCE = os.path.join(ROOT, "tests", "nlp", "evidence")


def run_doctor(tmp_path, *args, script=False, cache=None, pythonpath=(), **env_extra):
    """Run the doctor in a fresh interpreter; returns (CompletedProcess, parsed JSON or None)."""
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    shutil.copy(os.path.join(ROOT, "paddle_mgrad_autoload.pth"), site_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_MGRAD")}
    env.update(
        PYTHONPATH=os.pathsep.join([*pythonpath, EVIDENCE, ROOT]),
        PMG_TEST_PTH_DIR=str(site_dir),
        PADDLE_MGRAD_CACHE=cache or os.environ.get("PADDLE_MGRAD_CACHE", ""),
    )
    if not env["PADDLE_MGRAD_CACHE"]:
        del env["PADDLE_MGRAD_CACHE"]
    for k, v in env_extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    if script:  # what pip's generated `paddle-mgrad` script does
        cmd = [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = '/venv/bin/paddle-mgrad'; "
            "from paddle_mgrad.__main__ import main; sys.exit(main())",
            "doctor",
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", "paddle_mgrad", "doctor", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=str(tmp_path))
    assert r.returncode in (0, 1), f"doctor died: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    data = json.loads(r.stdout) if "--json" in args else None
    return r, data


def problem_lines(text):
    return [ln for ln in text.splitlines() if ln.startswith("  problem: ")]


def current_build_dir():
    """The cache directory of the op build this process loads (built now if needed)."""
    module = ops.load()
    assert module is not None, ops.fallback_reason()
    d = os.path.dirname(os.path.dirname(_build.library_path(module)))  # <cache>/<key>/<name>/x.so
    assert os.path.exists(os.path.join(d, ".complete")), d
    return d


# ------------------------------------------------------------------ healthy
@pytest.mark.probe
def test_healthy_install(tmp_path):
    """Everything works: exit 0, no problem, the self-test says what this Paddle does."""
    current_build_dir()  # built once for the session cache: the doctor only loads it
    r, d = run_doctor(tmp_path, "--json", script=True, PADDLE_MGRAD="all")
    assert r.returncode == 0 and d["exit_code"] == 0, d["problems"]
    assert d["problems"] == [] and d["verdict"].startswith("healthy")
    f = d["facts"]
    assert f["doctor"]["command_line"] and not f["doctor"]["paddle_in_process"]
    assert f["switch"]["autoload_ran_in_this_process"]  # the .pth ran; the doctor did not switch on
    assert [v["name"] for v in f["switch"]["variables"]] == ["PADDLE_MGRAD", "PADDLE_MGRAD_CACHE"][
        : len(f["switch"]["variables"])
    ]
    steps = f["probe_paddle"]["steps"]
    assert steps["paddle"]["version"] == paddle.__version__
    assert steps["paddle"]["cuda"] is paddle.is_compiled_with_cuda()
    assert any(b["current"] and b["complete"] for b in steps["cache"]["builds"])
    op = f["probe_op"]["steps"]
    assert op["op"]["backends"] == ops.backends() and op["op"]["library"].endswith(".so")
    assert op["cpu"]["bf16_path"] == ops.cpu_info()["bf16_path"]
    mine = op["selftest_paddle_mgrad"]
    assert mine["main_grad_ok"] and mine["backward_got_parameter"] and mine["through_paddle_mgrad"]
    assert mine["max_rel_err"] < 1e-5
    plain = steps["selftest_paddle"]
    assert plain["error"] is None and plain["main_grad_ok"]  # MixPrecisionLayer's hook folds dW in
    if PADDLE2:  # the seed bug: backward gets '<name>cpy' without main_grad
        assert not plain["backward_got_parameter"] and not plain["backward_had_main_grad"]
        assert all(n.endswith("cpy") for n in plain["saved_names"])
        assert d["needs_paddle_mgrad"].startswith("LOSES main_grad")
    else:
        assert plain["backward_got_parameter"] and plain["backward_had_main_grad"]
        assert d["needs_paddle_mgrad"].startswith("keeps main_grad")


@pytest.mark.probe
def test_paddle_without_cuda(tmp_path):
    """CPU Paddle: the GPU says 'none', an incomplete CUDA toolkit is not a problem (text mode).
    On a CUDA Paddle (the gpu_wheel session runs this suite on paddlepaddle-gpu) the same
    incomplete toolkit is the one problem, with its fix."""
    fake_home = tmp_path / "cuda"
    (fake_home / "bin").mkdir(parents=True)
    r, _ = run_doctor(tmp_path, CUDA_HOME=str(fake_home))
    if paddle.is_compiled_with_cuda():
        assert r.returncode == 1 and "built with CUDA" in r.stdout
        (line,) = problem_lines(r.stdout)
        assert "[op] GPU tensors run" in line and f"CUDA_HOME/CUDA_PATH={fake_home}" in line
        assert "->  fix: install the CUDA toolkit (nvcc) and set CUDA_HOME to it" in line
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert problem_lines(r.stdout) == []
    assert "built without CUDA" in r.stdout
    assert "GPU tensors: none (Paddle built without CUDA)" in r.stdout
    assert "CUDA toolkit: not needed (CPU Paddle)" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("verdict    healthy")


def _fake_cuda_home(tmp_path):
    """A toolkit with nvcc and headers but no cuBLASLt / runtime libraries."""
    home = tmp_path / "cuda-12"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    (home / "include" / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 12040\n")
    return home


@pytest.mark.probe
def test_cuda_paddle_missing_cublas_names_the_pip_command(tmp_path):
    """The same diagnosis on a CUDA Paddle (no CUDA wheel here: its facts, from a real CPU run
    with Paddle's CUDA flag and the op's GPU tier set as a CUDA wheel reports them): GPU tensors
    not on our CUDA op is a problem whose fix is the pip command for the missing library."""
    tk = build_config.find_cuda(
        search_paths=[], environ={"CUDA_HOME": str(_fake_cuda_home(tmp_path))}, need_thrust=True
    )
    assert not tk.ok and tk.major == 12
    facts = doctor.collect(timeout=600)
    assert doctor.diagnose(facts) == []
    facts["probe_paddle"]["steps"]["paddle"]["cuda"] = True
    op = facts["probe_op"]["steps"]["op"]
    op["backends"] = dict(op["backends"], gpu="paddle-fused")
    op["cuda_fallback_reason"] = tk.problem()
    problems = doctor.diagnose(facts)
    assert len(problems) == 1 and problems[0]["area"] == "op", problems
    assert (
        "GPU tensors run Paddle's own _C_ops.fused_linear_param_grad_add" in problems[0]["problem"]
    )
    assert "pip install nvidia-cublas-cu12" in problems[0]["fix"]
    assert "pip install nvidia-cuda-runtime-cu12" in problems[0]["fix"]
    # PADDLE_MGRAD_NO_CUDA=1 is the user's choice, not a problem
    facts["switch"]["variables"].append(
        {
            "name": "PADDLE_MGRAD_NO_CUDA",
            "value": "1",
            "status": "ok",
            "message": None,
            "parsed": True,
        }
    )
    assert doctor.diagnose(facts) == []


# ------------------------------------------------------------------ broken installs
@pytest.mark.probe
def test_missing_compiler(tmp_path):
    """No C++ compiler and a fresh cache: the op cannot be built; CPU tensors run the pure-Paddle
    fallback (the self-test is still exact); one problem naming the compiler and how to get one."""
    r, d = run_doctor(
        tmp_path,
        "--json",
        cache=str(tmp_path / "fresh-cache"),
        CC="/nonexistent/cc",
        CXX="/nonexistent/c++",
    )
    assert r.returncode == 1 and d["exit_code"] == 1
    (p,) = [p for p in d["problems"] if p["area"] == "op"]
    others = [p for p in d["problems"] if p["area"] != "op"]
    if paddle.is_compiled_with_cuda():  # the +CUDA build is tried first; its failure is kept
        (c,) = others
        assert c["area"] == "cache" and "failed build" in c["problem"], c
        assert c["fix"].startswith("delete it: rm -rf"), c
    else:
        assert others == [], others
    assert "pure-Paddle fallback" in p["problem"]
    assert p["fix"].startswith("install a C++17 compiler") and "CXX=/nonexistent/c++" in p["fix"]
    assert d["facts"]["compilers"]["cxx"]["path"] is None
    op = d["facts"]["probe_op"]["steps"]
    assert op["op"]["backends"]["cpu"] == "python"
    assert op["selftest_paddle_mgrad"]["main_grad_ok"]
    r2, _ = run_doctor(
        tmp_path, cache=str(tmp_path / "fresh-cache"), CC="/nonexistent/cc", CXX="/nonexistent/c++"
    )
    op_lines = [ln for ln in problem_lines(r2.stdout) if "[op]" in ln]
    others = [ln for ln in problem_lines(r2.stdout) if "[op]" not in ln]
    (line,) = op_lines
    assert (
        "[op] the C++ op could not be built" in line and "->  fix: install a C++17 compiler" in line
    )
    if paddle.is_compiled_with_cuda():  # the first run's failed CUDA build is kept, not retried
        (line,) = others
        assert (
            "[cache] build " in line
            and "failed build" in line
            and "->  fix: delete it: rm -rf" in line
        )
    else:
        assert others == []
    assert "compiler: /nonexistent/c++ -> NOT FOUND" in r2.stdout


@pytest.mark.probe
@pytest.mark.heavy
def test_corrupt_cache(tmp_path):
    """A truncated op library in the cache (``dlopen`` of it gives SIGBUS) with PADDLE_MGRAD=all:
    the doctor never loads it in its own process and never dies.  Where the loader verifies builds
    before loading them (size + SHA-256, paddle_mgrad/ops/_build.py), the doctor lists it as
    truncated before loading, the loader rebuilds it, and the doctor names what was rebuilt
    (healthy, exit 0); where it does not, the probe that loads it dies of SIGBUS and the doctor
    says which directory to delete (exit 1)."""
    src = current_build_dir()
    cache = tmp_path / "cache"
    dst = cache / os.path.basename(src)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    (so,) = glob.glob(str(dst / "*" / "*.so"))
    with open(so, "r+b") as f:
        f.truncate(os.path.getsize(so) // 40)
    r, d = run_doctor(tmp_path, "--json", cache=str(cache), PADDLE_MGRAD="all")
    assert not d["facts"]["doctor"]["paddle_in_process"]
    po = d["facts"]["probe_op"]
    before = {b["directory"]: b for b in d["facts"]["probe_paddle"]["steps"]["cache"]["builds"]}
    if po["signal"]:  # loaded unverified: the probe died, the doctor did not
        assert r.returncode == 1 and d["exit_code"] == 1
        assert po["signal"] == "SIGBUS" and po["crashed_in"] == "op"
        fixes = [p for p in d["problems"] if f"rm -rf {dst}" in p["fix"]]
        assert fixes and all(str(dst) in p["problem"] for p in fixes), d["problems"]
        assert "killed by SIGBUS" in fixes[0]["problem"]
        return
    was = before[str(dst)]["problem"]
    assert was.startswith("truncated") and before[str(dst)]["verified"] is False, before
    assert r.returncode == 0 and d["problems"] == [], d["problems"]
    assert d["rebuilt"] == [{"directory": str(dst), "was": was}]
    assert po["steps"]["op"]["library"].startswith(str(dst))
    assert po["steps"]["selftest_paddle_mgrad"]["main_grad_ok"]


@pytest.mark.probe
def test_bad_env_values(tmp_path):
    """An invalid value, an invalid PADDLE_MGRAD (which would stop every other process at its
    first `import paddle` with exit code 2) and a misspelt name: one problem line each, with the
    fix; the probes run without them, so the rest is still checked."""
    r, d = run_doctor(
        tmp_path,
        "--json",
        PADDLE_MGRAD="bogus",
        PADDLE_MGRAD_OPS="pyhton",
        PADDLE_MGRAD_CPU_BF61="native",
    )
    assert r.returncode == 1 and d["exit_code"] == 1
    got = {p["problem"].split("=")[0].split(" ")[0]: p for p in d["problems"]}
    assert set(got) == {"PADDLE_MGRAD", "PADDLE_MGRAD_OPS", "PADDLE_MGRAD_CPU_BF61"}, d["problems"]
    assert all(p["area"] == "environment" for p in got.values())
    assert "unknown value 'bogus'" in got["PADDLE_MGRAD"]["problem"]
    assert (
        got["PADDLE_MGRAD_OPS"]["problem"]
        == "PADDLE_MGRAD_OPS='pyhton' is not valid; accepted: auto (default) or python"
    )
    assert (
        got["PADDLE_MGRAD_OPS"]["fix"]
        == "export PADDLE_MGRAD_OPS=<auto (default) or python> or unset it"
    )
    assert got["PADDLE_MGRAD_CPU_BF61"]["fix"] == "rename it to PADDLE_MGRAD_CPU_BF16"
    assert d["facts"]["probe_op"]["steps"]["selftest_paddle_mgrad"]["main_grad_ok"]
    r2, _ = run_doctor(tmp_path, PADDLE_MGRAD_OPS="pyhton", PADDLE_MGRAD_RECOMPUTE_POLICY=" Gemm")
    assert r2.returncode == 1
    # the recompute policy in force, as every recompute call reads it
    assert "recompute  policy gemm (PADDLE_MGRAD_RECOMPUTE_POLICY" in r2.stdout, r2.stdout
    assert problem_lines(r2.stdout) == [
        "  problem: [environment] PADDLE_MGRAD_OPS='pyhton' is not valid; accepted: auto "
        "(default) or python  ->  fix: export PADDLE_MGRAD_OPS=<auto (default) or python> or unset it"
    ]


def test_pth_missing_while_variable_set(tmp_path, monkeypatch):
    """PADDLE_MGRAD set where the .pth is not installed: the variable does nothing -- a problem.

    In process, with the site-packages list pointed at an empty directory: where the suite runs
    against a pip-installed paddle_mgrad (nox) the real site-packages *has* the .pth, so a
    doctor subprocess cannot see it missing there."""
    from paddle_mgrad.diagnostics import collect, doctor

    empty = tmp_path / "site-packages"
    empty.mkdir()
    monkeypatch.setattr(collect, "_site_dirs", lambda: [str(empty)])
    monkeypatch.delitem(sys.modules, "paddle_mgrad_autoload", raising=False)
    sw = collect._switching_on({"PADDLE_MGRAD": "recompute"})
    assert sw["pth"] == [] and not sw["autoload_ran_in_this_process"]
    found = [p for p in doctor.diagnose({"switch": sw}) if p["area"] == "switch on"]
    assert len(found) == 1, found
    (p,) = found
    assert "does nothing here" in p["problem"] and str(empty) in p["problem"]
    assert "pip install" in p["fix"] and "paddle_mgrad.enable()" in p["fix"]
    # the .pth in that directory: no problem
    shutil.copy(os.path.join(ROOT, "paddle_mgrad_autoload.pth"), empty)
    sw = collect._switching_on({"PADDLE_MGRAD": "recompute"})
    assert [p for p in doctor.diagnose({"switch": sw}) if p["area"] == "switch on"] == []


@pytest.mark.probe
@pytest.mark.parametrize(
    "how,expect",
    [
        ("raise ImportError('numpy.core.multiarray failed to import')", "ImportError: numpy.core"),
        ("import ctypes; ctypes.string_at(0)", "killed by SIGSEGV"),
    ],
    ids=["import-error", "segfault"],
)
def test_paddle_that_does_not_import(tmp_path, how, expect):
    """A Paddle that raises or crashes at import: reported with a fix, never a crash."""
    fake = tmp_path / "fake"
    (fake / "paddle").mkdir(parents=True)
    (fake / "paddle" / "__init__.py").write_text(how + "\n")
    r, d = run_doctor(tmp_path, "--json", pythonpath=[str(fake)])
    assert r.returncode == 1
    (p,) = d["problems"]
    assert p["area"] == "paddle" and p["problem"].startswith("Paddle does not import: ")
    assert expect in p["problem"] and p["fix"]
    assert d["facts"]["probe_op"] is None


def test_command_line_detection():
    """The package imports no Paddle only for its own command line."""
    assert _cli.command_line_process(["-m", "doctor"], ["py", "-m", "paddle_mgrad", "doctor"])
    assert _cli.command_line_process(
        ["-m", "doctor"], ["py", "-X", "dev", "-mpaddle_mgrad", "doctor"]
    )
    assert _cli.command_line_process(
        ["/venv/bin/paddle-mgrad", "doctor"], ["py", "/venv/bin/paddle-mgrad"]
    )
    assert not _cli.command_line_process(["-m", "x"], ["py", "-m", "paddle_mgrad_other", "x"])
    assert not _cli.command_line_process(["-c"], ["py", "-c", "import paddle_mgrad"])
    assert not _cli.command_line_process(["train.py"], ["py", "train.py"])
    assert not _cli.command_line_process([], [])
    setup = open(os.path.join(ROOT, "setup.py")).read()
    assert f'"{_cli.SCRIPT} = paddle_mgrad.__main__:main"' in setup


@pytest.mark.probe
def test_usage_and_unknown_command(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(
        [sys.executable, "-m", "paddle_mgrad"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert r.returncode == 2 and "usage: python -m paddle_mgrad doctor" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "paddle_mgrad", "doktor"],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert r.returncode == 2 and "unknown command 'doktor'" in r.stderr


@pytest.mark.probe
def test_a_failing_step_is_a_problem(tmp_path):
    """A step of the probes that raises (here: cpu_info, broken on purpose in the probe through a
    sitecustomize) is reported as the doctor's own problem, not silently left out."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('pmg_ev', {os.path.join(EVIDENCE, 'sitecustomize.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "if sys.argv[-2:-1] == ['op']:\n"
        "    def _break(mod):\n"
        "        def cpu_info():\n"
        "            raise RuntimeError('cpu_info broken on purpose')\n"
        "        mod.cpu_info = cpu_info\n"
        "    m._after_import('paddle_mgrad.ops', _break)\n"
    )
    r, d = run_doctor(tmp_path, "--json", pythonpath=[str(broken)])
    assert r.returncode == 1
    (p,) = d["problems"]
    assert (
        p["area"] == "doctor"
        and "'cpu' failed: RuntimeError: cpu_info broken on purpose" in p["problem"]
    )
    assert "report it" in p["fix"]


def test_the_policy_line_says_what_is_in_force():
    from paddle_mgrad.diagnostics.render import _policy_line

    assert _policy_line([]).startswith("policy full (the default")
    bad = {"name": "PADDLE_MGRAD_RECOMPUTE_POLICY", "value": "x", "status": "invalid"}
    assert "invalid" in _policy_line([bad])
    ok = dict(bad, status="ok", parsed="gemm")
    assert _policy_line([ok]).startswith("policy gemm (PADDLE_MGRAD_RECOMPUTE_POLICY")
