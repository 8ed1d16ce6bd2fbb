"""``benchmarks/bench_recompute_policy.py``, the script whose figures judge the recompute
policies (docs/benchmarks.md), run as its users run it on a model small enough for CI: it
trains PaddleNLP's ``LlamaForCausalLM`` under every mode, interleaved in one process, and exits
1 unless every mode's losses and ``main_grad`` bits equal no recompute's -- the policies
bit-identical on the model the figures are of, and a broken script seen before anyone measures
with it."""

import os
import re
import subprocess
import sys

from script_runs import ROOT, script_env

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_recompute_policy.py")
POLICIES = ("gemm", "save:*MLP", "budget:0.5")
GRANULARITIES = ("full_attn",)


def test_every_mode_trains_to_no_recomputes_losses_and_reports(tmp_path):
    """2 decoder layers, seq 64, the warm-up round and one more of 2 steps each: a ``budget:``
    plan is made (3 measured block calls and a backward), so its plan line is printed; each
    mode has its row; ``gemm`` recomputed no GEMM."""
    env = script_env()  # (no PADDLE_MGRAD variable: the script switches on what it measures)
    env["PYTHONPATH"] = ROOT
    args = ["--model", "small", "--layers", "2", "--seq", "64", "--rounds", "1", "--steps", "2"]
    args += ["--policies", *POLICIES, "--granularities", *GRANULARITIES]
    run = subprocess.run(
        [sys.executable, SCRIPT, *args],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout
    assert run.returncode == 0, (out + run.stderr)[-5000:]
    assert "losses and main_grad of the last round bit-identical in all modes: True" in out, out
    modes = ("none", "full", *("nlp:" + g for g in GRANULARITIES), *POLICIES)
    rows = {line.split()[0] for line in out.splitlines() if line.split()}
    assert set(modes) <= rows, out
    assert re.search(r"gemm: over \d+ block calls .* [1-9]\d* GEMMs", out), out
    assert "budget:0.5: over" in out and "plan for LlamaDecoderLayer: keep" in out, out
