"""Running examples/llama/run_pretrain.py as a user does (its own process, optionally 2 ranks
through ``paddle.distributed.launch``), for tests/nlp: the ``example`` fixture and test modules
import it."""

import json
import os
import subprocess
import sys
import zlib  # noqa: F401  (before paddle)

import cpu_nlp_standins

from script_runs import launch_ports  # tests/

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "llama", "run_pretrain.py")
CONFIG = os.path.join(ROOT, "examples", "llama", "pretrain_cpu.json")
EVIDENCE = os.path.join(ROOT, "tests", "nlp", "evidence")


def run_example(out_dir, *flags, nproc=1, timeout=900, cpu_sync_standin=None):
    """Run the llama example (optionally under paddle.distributed.launch); returns
    (returncode, stdout+stderr, summary dict or None).  ``cpu_sync_standin`` (default: when this
    PaddleNLP needs it, 2.7.x): see cpu_nlp_standins.py."""
    env = launch_ports(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    if cpu_sync_standin is None:
        cpu_sync_standin = cpu_nlp_standins.needs_cpu_sync_standin()
    if cpu_sync_standin:
        cpu_nlp_standins.request(env, EVIDENCE)
    base = [
        EXAMPLE,
        CONFIG,
        "--output_dir",
        str(out_dir),
        "--logging_steps",
        "1",
        "--save_steps",
        "1000",
        *map(str, flags),
    ]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            "--log_dir",
            os.path.join(str(out_dir), "log"),
            "--nproc_per_node",
            str(nproc),
            *base,
        ]
    else:
        cmd = [sys.executable, *base]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    out = r.stdout + r.stderr
    if nproc > 1 and os.path.isdir(os.path.join(str(out_dir), "log")):
        workers = ""
        for name in sorted(os.listdir(os.path.join(str(out_dir), "log"))):
            with open(os.path.join(str(out_dir), "log", name), errors="replace") as f:
                workers += f"\n--- {name}\n" + f.read()[-2500:]
        out = workers + "\n--- launcher\n" + out[-2000:]  # the launcher's verdict last
    path = os.path.join(str(out_dir), "mgrad_summary.json")
    summary = None
    if r.returncode == 0 and os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
    return r.returncode, out, summary
