"""How much memory the CPU op keeps per calling thread (the widen workspace and friends).

bf16/fp16 inputs on the widen path are converted to fp32 in row chunks held in a per-thread
workspace that stays allocated between calls (a fresh 10-80 MiB buffer per call costs a page
fault per 4 KiB); a same-precision weight gradient (``multi_precision=False``) also keeps an
fp32 product buffer.  oneDNN keeps its own per-thread packing buffers.  This script measures,
in one fresh process per case, the resident memory (VmRSS) a thread adds by its first op call,
all inputs and accumulators allocated and touched beforehand, and prints it next to the bytes
the op library says it keeps for that thread (``pmg_cpu_thread_scratch_bytes``, C ABI of
``csrc/wgrad_capi.cc``: the sizes ``csrc/wgrad_cpu.cc`` allocated, page-rounded; the sizing
rule is in docs/limits.md).  The rest of the RSS is oneDNN's buffers and allocator caching.

When the C++ op is not in use (the pure-Paddle fallback: it did not build, or
``PADDLE_MGRAD_OPS=python``), the RSS column is Paddle's own temporaries: the row says so and
shows no buffers of ours.

    python benchmarks/mem_widen_workspace.py [--shapes 4096x4096x4096,...]
"""

import argparse
import json
import os
import subprocess
import sys

CASE = r"""
import ctypes, json, os, sys, threading, zlib
import paddle
from paddle_mgrad import ops
from paddle_mgrad.ops import _build

T, K, N, dtype, mp, path, second = sys.argv[1:8]
T, K, N, mp, second = int(T), int(K), int(N), mp == "1", second == "1"
os.environ["PADDLE_MGRAD_CPU_BF16"] = path
module = ops.load()
kept = None  # the pure-Paddle fallback keeps nothing of ours
if module is not None:
    kept = ctypes.CDLL(_build.library_path(module)).pmg_cpu_thread_scratch_bytes
    kept.restype = ctypes.c_uint64

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

x = paddle.randn([T, K]).astype(dtype)
dy = paddle.randn([T, N]).astype(dtype)
acc = paddle.zeros([K, N], "float32" if mp else dtype)
(acc + 1).numpy(); x.astype("float32").numpy(); dy.astype("float32").numpy()  # touch
paddle.zeros([8, 8])  # allocator warm
small = paddle.ones([8, 8]).astype(dtype)
ops.fused_linear_param_grad_add(small, small, None, None, mp, False)  # op + threads warm
out = {"backend": ops.backend()}
def first_call(tag):
    before = rss()
    ops.fused_linear_param_grad_add(x, dy, acc, None, mp, False)
    mid = rss()
    ops.fused_linear_param_grad_add(x, dy, acc, None, mp, False)
    out[tag] = (mid - before, rss() - before, None if kept is None else kept())
first_call("main thread")
if second:
    t = threading.Thread(target=first_call, args=("second thread",)); t.start(); t.join()
print("RESULT", json.dumps(out))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096x4096,4096x1024x4096,4096x4096x32000")
    args = ap.parse_args()
    MiB = 1 << 20
    print(
        "| T x K x N | dtype | path | multi_precision | op backend | our kept buffers (MiB) | "
        "RSS added, 1st call (MiB) | after a 2nd call | 2nd thread, 1st call |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        T, K, N = map(int, shape.split("x"))
        for dtype, path, mp in (
            ("bfloat16", "widen", True),
            ("bfloat16", "widen", False),
            ("float16", "widen", True),
            ("bfloat16", "native", True),
        ):
            r = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    CASE,
                    str(T),
                    str(K),
                    str(N),
                    dtype,
                    "1" if mp else "0",
                    path,
                    "1",
                ],
                capture_output=True,
                text=True,
                env=dict(os.environ),
            )
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
            if r.returncode != 0 or not line:
                print(f"| {shape} | {dtype} | {path} | {mp} | | failed: {r.stderr[-300:]} |")
                continue
            res = json.loads(line[0][6:])
            main_, second = res["main thread"], res.get("second thread", (0, 0, None))
            if main_[2] is None:
                kept = "none (pure-Paddle fallback: the RSS is Paddle's)"
            else:
                kept = f"{main_[2] / MiB:.1f}"
                if second[2] is not None and second[2] != main_[2]:
                    kept += f" (2nd thread {second[2] / MiB:.1f})"
            print(
                f"| {shape} | {dtype} | {path} | {mp} | {res['backend']} | {kept}"
                f" | {main_[0] / MiB:.1f} | {main_[1] / MiB:.1f} | {second[0] / MiB:.1f} |"
            )


if __name__ == "__main__":
    main()
