"""Running the fleet drivers from a test: one process or ``paddle.distributed.launch`` with 2
ranks, in its own process group (a timeout kills the launcher's ranks too), failing with the
rank logs.  Shared by test_hybrid_parallel.py and test_zero_bubble_pipeline.py."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from script_runs import launch_ports, rendezvous_failed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def env():
    # paddle_mgrad as the test process sees it (installed, or PYTHONPATH=<worktree>)
    return launch_ports(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


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
    processes too) and fail with the rank logs; fail likewise on a non-zero exit.

    One retry, for one failure only: a rank whose rendezvous failed while the process group was
    created, before it wrote a result (``script_runs.rendezvous_failed``: a port taken between
    the launcher's choice and the rank's bind, or gloo's connection timed out).  The failed
    run's logs are kept in ``out/log.refused``."""
    code, output = _run_once(cmd, out, what, timeout)
    if code != 0 and _rendezvous_failed_at_start(out):
        kept = os.path.join(out, "log.refused")
        shutil.rmtree(kept, ignore_errors=True)
        os.rename(os.path.join(out, "log"), kept)
        print(
            f"\n--- NOTE: {what}: a rank's rendezvous failed before training (Paddle's process "
            f"group creation: a port taken between the launcher's choice and the rank's bind, "
            f"or gloo's connection timed out); repeated once, first logs in {kept}"
        )
        code, output = _run_once(cmd, out, what, timeout)
    if code != 0:
        pytest.fail(f"{what} exited {code}{logs(out)}\n--- launcher (last 3000)\n{output[-3000:]}")


def _rendezvous_failed_at_start(out):
    """A rank's log shows a failed rendezvous, and that rank wrote no result."""
    for r in (0, 1):
        log = os.path.join(out, "log", f"workerlog.{r}")
        if os.path.isfile(log) and not os.path.exists(os.path.join(out, f"rank{r}.json")):
            with open(log, errors="replace") as f:
                if rendezvous_failed([f.read()]):
                    return True
    return False


def _run_once(cmd, out, what, timeout):
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(
            f"{what} timed out after {timeout}s{logs(out)}\n--- launcher (last 3000)\n"
            f"{output[-3000:]}"
        )
    return proc.returncode, output


def launch_two_ranks(driver, config, out, ref, timeout, extra=()):
    """``driver --config config --out out --ref ref *extra`` on 2 ranks; returns the [rank0,
    rank1] results (``out/rank<r>.json``)."""
    import json

    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--log_dir",
        os.path.join(out, "log"),
        "--nproc_per_node",
        "2",
        driver,
        "--config",
        config,
        "--out",
        out,
        "--ref",
        ref,
        *extra,
    ]
    run(cmd, out, f"{config} (2 ranks)", timeout)
    results = []
    for rank in (0, 1):
        path = os.path.join(out, f"rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote no result{logs(out)}"
        with open(path) as f:
            results.append(json.load(f))
    return results
