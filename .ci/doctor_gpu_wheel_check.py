"""``python -m paddle_mgrad doctor`` on paddlepaddle-gpu 2.6.2 (a CUDA Paddle, no GPU needed), run
by the ``gpu_wheel`` nox session after each .ci/gpu_wheel_check.py phase, with that phase's cache:

    python .ci/doctor_gpu_wheel_check.py no-cublas   # exit 1: one [op] problem, fix = the pip command
    python .ci/doctor_gpu_wheel_check.py cuda        # exit 0: healthy, GPU tensors on our CUDA op
"""

import json
import subprocess
import sys


def main(mode):
    r = subprocess.run(
        [sys.executable, "-m", "paddle_mgrad", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode in (0, 1), f"doctor died: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    d = json.loads(r.stdout)
    op = d["facts"]["probe_op"]["steps"]["op"]
    print(
        f"doctor ({mode}): exit {r.returncode}, backend {op.get('backend')}, verdict: {d['verdict']}"
    )
    for p in d["problems"]:
        print(f"  problem: [{p['area']}] {p['problem']}  ->  fix: {p['fix']}")
    assert d["exit_code"] == r.returncode
    assert d["facts"]["probe_paddle"]["steps"]["paddle"]["cuda"] is True
    if mode == "no-cublas":
        assert r.returncode == 1 and len(d["problems"]) == 1, d["problems"]
        (p,) = d["problems"]
        assert p["area"] == "op" and "not our CUDA op" in p["problem"], p
        assert p["fix"].startswith("pip install") and "nvidia-cublas" in p["fix"], p
        assert op["backends"]["gpu"] in ("paddle-fused", "python")
    elif mode == "cuda":
        assert r.returncode == 0 and d["problems"] == [], d["problems"]
        assert op["backend"].endswith("+cuda") and op["backends"]["gpu"] == "cuda"
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    st = d["facts"]["probe_op"]["steps"]["selftest_paddle_mgrad"]
    assert st["main_grad_ok"] and st["through_paddle_mgrad"], st


if __name__ == "__main__":
    main(sys.argv[1])
