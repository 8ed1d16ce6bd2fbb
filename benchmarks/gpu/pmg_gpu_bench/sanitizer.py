"""compute-sanitizer memcheck on small cases, in a child process of the script."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

from .build import toolkit
from .capi import ELEM, Core, CoreError

SCRIPT = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench_wgrad_gpu.py")
)


def sanitizer_summary(text):
    """(errors, ok) from compute-sanitizer's output: 'ERROR SUMMARY: N errors'."""
    m = re.findall(r"ERROR SUMMARY:\s*(\d+)\s+error", text or "")
    if not m:
        return None, False
    n = int(m[-1])
    return n, n == 0


def find_sanitizer(tk=None):
    """compute-sanitizer: on PATH, else next to nvcc."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    homes = [tk.home] if tk is not None and tk.home else []
    for home in homes + ["/usr/local/cuda"]:
        p = os.path.join(home, "bin", "compute-sanitizer")
        if os.access(p, os.X_OK):
            return p
    return None


def run_sanitizer(bench, lib, budget_s):
    """compute-sanitizer --tool memcheck on `--sanitize-case` (a child of this script)."""
    tool = find_sanitizer(toolkit())
    if tool is None:
        return bench.skip("sanitizer", "compute-sanitizer not found (PATH, toolkit bin/)")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")  # one allocation per tensor
    out = os.path.join(bench.args.out, "sanitizer")
    os.makedirs(out, exist_ok=True)
    cmd = [
        tool,
        "--tool",
        "memcheck",
        "--error-exitcode",
        "9",
        "--print-limit",
        "20",
        sys.executable,
        SCRIPT,
        "--sanitize-case",
        "--lib",
        lib,
        "--out",
        out,
    ]
    t0 = time.time()
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=max(60.0, budget_s), env=env
        )
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"timed out after {e.timeout:.0f} s", -1
    with open(os.path.join(out, "sanitizer.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + text)
    n, clean = sanitizer_summary(text)
    cases = re.search(r"SANITIZE-CASES (\d+)/(\d+)", text)
    ok = rc == 0 and clean and cases is not None and cases.group(1) == cases.group(2)
    bench.add(
        "sanitizer",
        "memcheck, small cases",
        ok,
        f"{n} errors, cases {cases.group(0) if cases else '?'}, rc {rc}, "
        f"{time.time() - t0:.0f} s" + ("" if ok else f"; {text[-300:]!r}"),
    )


def sanitize_case(args):
    """Small cases under compute-sanitizer: every dtype, views that end at their allocation's
    end (offsets at the front), both bias paths, the three workspace sources, M = 0 and K = 0."""
    import torch

    from .checks import Bench

    core = Core(args.lib, cuda=True)
    report = {"checks": [], "bench": []}
    b = Bench(args, torch, core, False, report)
    n_ok = n = 0
    for in_dtype in ("bfloat16", "float16", "float32", "float64"):
        acc = "float64" if in_dtype == "float64" else "float32"
        for mode in ("auto", "kernel"):
            for (M, K, N), off in (
                ((67, 40, 24), 2),
                ((130, 33, 17), 16),
                ((0, 8, 8), 0),
                ((9, 0, 8), 0),
            ):
                o_in = off if off % ELEM[in_dtype] == 0 else 0
                o_acc = off if off % ELEM[acc] == 0 else 0
                _, x = b.offset_view((M, K), in_dtype, o_in, b.randn((M, K), in_dtype), tail=0)
                _, dy = b.offset_view((M, N), in_dtype, o_in, b.randn((M, N), in_dtype), tail=0)
                _, mg = b.offset_view((K, N), acc, o_acc, b.randn((K, N), acc), tail=0)
                _, db = b.offset_view((N,), acc, o_acc, b.randn((N,), acc), tail=0)
                for ws in ("stream-ordered", "allocator"):
                    n += 1
                    ex = {"bias_mode": mode}
                    if ws == "allocator":
                        ex["alloc"] = b.torch_alloc()
                    try:
                        b.call(x, dy, mg, db, 1.0, 1.0, in_dtype, shape=(M, K), n=N, **ex)
                        torch.cuda.synchronize()
                        n_ok += 1
                    except CoreError as e:
                        print("case failed:", in_dtype, mode, (M, K, N), ws, e, flush=True)
                    b.keep.clear()
    print(f"SANITIZE-CASES {n_ok}/{n}", flush=True)
    return 0 if n_ok == n else 1
