"""How much memory the CPU op keeps per calling thread (the widen workspace and friends).

bf16/fp16 inputs on the widen path are converted to fp32 in row chunks held in a per-thread
workspace that stays allocated between calls (a fresh 10-80 MiB buffer per call costs a page
fault per 4 KiB); a same-precision weight gradient (``multi_precision=False``) also keeps an
fp32 product buffer.  oneDNN keeps its own per-thread packing buffers.  This script measures,
in one fresh process per case, the resident memory (VmRSS) a thread adds by its first op call,
all inputs and accumulators allocated and touched beforehand, and prints it next to what
``csrc/wgrad_cpu.cc`` computes for its own buffers:

    widen workspace  = rows * (K + N) * 4 bytes, rows = min(M, max(256, 64 MiB / ((K + N) * 4)))
                       split into equal chunks (M = 4096 at a 2048-row budget: 2 x 2048)
    product buffer   = K * N * 4 bytes (multi_precision=False; kept only when <= 64 MiB)

    python benchmarks/mem_widen_workspace.py [--shapes 4096x4096x4096,...]
"""
import argparse
import json
import os
import subprocess
import sys

CASE = r"""
import json, os, sys, threading, zlib
import paddle
from paddle_mgrad import ops

T, K, N, dtype, mp, path, second = sys.argv[1:8]
T, K, N, mp, second = int(T), int(K), int(N), mp == "1", second == "1"
os.environ["PADDLE_MGRAD_CPU_BF16"] = path
ops.load()

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
out = {}
def first_call(tag):
    before = rss()
    ops.fused_linear_param_grad_add(x, dy, acc, None, mp, False)
    mid = rss()
    ops.fused_linear_param_grad_add(x, dy, acc, None, mp, False)
    out[tag] = (mid - before, rss() - before)
first_call("main thread")
if second:
    t = threading.Thread(target=first_call, args=("second thread",)); t.start(); t.join()
print("RESULT", json.dumps(out))
"""


def ours(T, K, N, mp, path, dtype):
    """Bytes of our own kept buffers for this call (csrc/wgrad_cpu.cc's arithmetic)."""
    budget, widen = 64 << 20, dtype == "float16" or path == "widen"
    total = 0
    if widen:
        rows = min(T, max(256, budget // ((K + N) * 4)))
        chunks = -(-T // rows)
        rows = -(-T // chunks)
        total += rows * (K + N) * 4
    if not mp and K * N * 4 <= budget:
        total += K * N * 4
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096x4096,4096x1024x4096,4096x4096x32000")
    args = ap.parse_args()
    MiB = 1 << 20
    print("| T x K x N | dtype | path | multi_precision | our buffers (MiB) | RSS added, "
          "1st call (MiB) | after a 2nd call | 2nd thread, 1st call |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        T, K, N = map(int, shape.split("x"))
        for dtype, path, mp in (("bfloat16", "widen", True), ("bfloat16", "widen", False),
                                ("float16", "widen", True), ("bfloat16", "native", True)):
            r = subprocess.run([sys.executable, "-c", CASE, str(T), str(K), str(N), dtype,
                                "1" if mp else "0", path, "1"], capture_output=True, text=True,
                               env=dict(os.environ))
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
            if r.returncode != 0 or not line:
                print(f"| {shape} | {dtype} | {path} | {mp} | failed: {r.stderr[-300:]} |")
                continue
            res = json.loads(line[0][6:])
            main_, second = res["main thread"], res.get("second thread", (0, 0))
            kept = ours(T, K, N, mp, path, dtype) / MiB
            print(f"| {shape} | {dtype} | {path} | {mp} | {kept:.1f}"
                  f" | {main_[0] / MiB:.1f} | {main_[1] / MiB:.1f} | {second[0] / MiB:.1f} |")


if __name__ == "__main__":
    main()
