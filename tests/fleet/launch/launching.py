"""Running the fleet drivers from a test: one process or ``paddle.distributed.launch`` with 2
ranks, in its own process group (a timeout kills the launcher's ranks too), failing with the
rank logs.  Shared by test_hybrid_parallel.py and test_zero_bubble_pipeline.py."""
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def env():
    # paddle_mgrad as the test process sees it (installed, or PYTHONPATH=<worktree>)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def logs(out):
    """The tail of every rank's log under ``out/log``."""
    text = ""
    log_dir = os.path.join(out, "log")
    if os.path.isdir(log_dir):
        for name in sorted(n for n in os.listdir(log_dir) if n.startswith("workerlog")):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                text += f"\n--- {name} (last 4000 chars)\n" + f.read()[-4000:]
    return text


def run(cmd, out, what, timeout):
    """Run ``cmd`` in its own process group; on timeout kill that group (the launcher's rank
    processes too) and fail with the rank logs; fail likewise on a non-zero exit."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(), cwd=ROOT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{what} timed out after {timeout}s{logs(out)}\n--- launcher (last 3000)\n"
                    f"{output[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited {proc.returncode}{logs(out)}\n--- launcher (last 3000)\n"
                    f"{output[-3000:]}")


def launch_two_ranks(driver, config, out, ref, timeout):
    """``driver --config config --out out --ref ref`` on 2 ranks; returns the [rank0, rank1]
    results (``out/rank<r>.json``)."""
    import json

    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_dir",
           os.path.join(out, "log"), "--nproc_per_node", "2", driver, "--config", config,
           "--out", out, "--ref", ref]
    run(cmd, out, f"{config} (2 ranks)", timeout)
    results = []
    for rank in (0, 1):
        path = os.path.join(out, f"rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote no result{logs(out)}"
        with open(path) as f:
            results.append(json.load(f))
    return results
