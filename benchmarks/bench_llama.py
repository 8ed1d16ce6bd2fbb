"""Tokens/s of the llama example with and without paddle_mgrad, same flags otherwise.

    python benchmarks/bench_llama.py [--steps 30] [--rounds 2] [--threads N] [extra example flags...]

"with": --recompute --amp_master_grad --bf16 O2 + paddle_mgrad's recompute and fused linear.
"without": the same training flags, Paddle's own recompute, plain linear
(``--mgrad_fix_recompute false --enable_linear_fused_grad_add false``).  On Paddle 2.6
"without" fails on CPU (Paddle's recompute cannot preserve CPU RNG), which is reported.
Rounds are interleaved; medians are printed with the ratio.  Both cases run with the
same ``OMP_NUM_THREADS``, set here: ``--threads`` (default: the number of CPUs this
process may use), since Paddle silently forces 1 thread at import when it is unset.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(out, steps, extra, threads):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "examples", "llama", "run_pretrain.py"),
        os.path.join(ROOT, "examples", "llama", "pretrain_cpu.json"),
        "--output_dir",
        out,
        "--max_steps",
        str(steps),
        "--save_steps",
        "100000",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if r.returncode != 0:
        return None, (r.stdout + r.stderr).strip().splitlines()[-1:]
    with open(os.path.join(out, "mgrad_summary.json")) as f:
        return json.load(f), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else (os.cpu_count() or 1),
    )
    args, extra = ap.parse_known_args()
    cases = {
        "with paddle_mgrad": [],
        "without": ["--mgrad_fix_recompute", "false", "--enable_linear_fused_grad_add", "false"],
    }
    res = {k: [] for k in cases}
    errors = {}
    paddle_version = "?"
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, flags in cases.items():
                s, err = run(
                    os.path.join(tmp, f"{r}-{len(res[name])}-{name[:4]}"),
                    args.steps,
                    flags + extra,
                    args.threads,
                )
                if s is None:
                    errors[name] = err
                else:
                    res[name].append(s["tokens_per_second"])
                    paddle_version = s["paddle"]
    print(
        f"paddle {paddle_version}, OMP_NUM_THREADS={args.threads} (both cases), "
        f"{args.steps} steps, median of {args.rounds} rounds"
    )
    med = {k: statistics.median(v) for k, v in res.items() if v}
    for name in cases:
        if name in med:
            print(f"{name:20s} {med[name]:10.1f} tokens/s")
        else:
            print(f"{name:20s} failed: {errors.get(name)}")
    if len(med) == 2:
        print(f"ratio with/without: {med['with paddle_mgrad'] / med['without']:.3f}")


if __name__ == "__main__":
    main()
