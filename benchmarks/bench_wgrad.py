"""Weight-gradient accumulation speed: our op vs plain GEMMs vs Paddle's unfused path.

For llama-like shapes ``dW[K, N] += xᵀ[K, T] · dy[T, N]`` (T tokens), fp32 accumulator
(``main_grad``), all at the same thread count (``OMP_NUM_THREADS``, default: all
cores), in one run; every figure is also printed as a ratio against a baseline
measured in the same run:

* ``ours fp32``   -- ``paddle_mgrad.ops.fused_linear_param_grad_add`` on fp32 inputs
  (beta = 1, in place), against the fastest plain sgemm of the same product:
  numpy's BLAS (``xᵀ @ dy``, no accumulation) and raw oneDNN ``dnnl_sgemm`` called
  through ctypes (beta = 1, the GEMM our op uses);
* ``ours bf16``   -- the op on bf16 inputs along the path the CPU gets at run time
  (``ops.cpu_info()``), and both forced paths (``PADDLE_MGRAD_CPU_BF16=native|widen``),
  as throughput / ``ours fp32``;
* ``unfused``     -- what Paddle does without the fusion (``matmul`` of fp32 copies,
  then ``cast`` + ``add_``).

Targets (issue 10): bf16 throughput >= 0.85x fp32 without native bf16, >= 1.8x with
it; ``ours fp32`` time <= 1.1x the fastest plain sgemm.  ``--fp64`` adds float64 (our
blocked DGEMM) against numpy's dgemm.

    python benchmarks/bench_wgrad.py [--tokens 4096] [--repeat 3] [--fp64]
"""
import argparse
import ctypes
import os
import platform
import statistics
import time

_threads = os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
os.environ.setdefault("OPENBLAS_NUM_THREADS", _threads)
os.environ.setdefault("MKL_NUM_THREADS", _threads)

import zlib  # noqa: E402,F401  (before paddle on 2.6)

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from paddle_mgrad import ops  # noqa: E402


def bench(fn, repeat):
    fn()  # warm-up (and JIT build)
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def dnnl_sgemm():
    """Raw oneDNN sgemm from the Paddle wheel, or None."""
    path = os.path.join(os.path.dirname(paddle.__file__), "libs", "libdnnl.so.3")
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    f = lib.dnnl_sgemm
    i64, fl, vp = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    f.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, fl, vp, i64, vp, i64, fl, vp, i64]
    f.restype = ctypes.c_int
    return f


def with_bf16_path(path, fn):
    old = os.environ.get("PADDLE_MGRAD_CPU_BF16")
    os.environ["PADDLE_MGRAD_CPU_BF16"] = path
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["PADDLE_MGRAD_CPU_BF16"]
        else:
            os.environ["PADDLE_MGRAD_CPU_BF16"] = old


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--shapes", default="1024x4096,4096x4096", help="KxN list")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-native", action="store_true",
                    help="skip the forced oneDNN-bf16 path (slow on CPUs without native bf16)")
    ap.add_argument("--no-unfused", action="store_true", help="skip Paddle's unfused path")
    ap.add_argument("--fp64", action="store_true", help="also time float64 against numpy dgemm")
    args = ap.parse_args()
    info = ops.cpu_info()
    print(f"CPU {cpu_model()}; ISA: {info['isa']}; native bf16: {info['native_bf16']}; "
          f"bf16 path chosen at run time: {info['bf16_path']}")
    print(f"paddle {paddle.__version__}, op backend {ops.backend()}, threads {_threads}, "
          f"tokens {args.tokens}, numpy {np.__version__}")
    sg = dnnl_sgemm()
    rows, summary = [], []
    for shape in args.shapes.split(","):
        K, N = map(int, shape.split("x"))
        T = args.tokens
        flop = 2.0 * T * K * N
        name = f"{T}x{K}x{N}"
        rs = np.random.RandomState(0)
        xn = rs.standard_normal([T, K]).astype("float32")
        yn = rs.standard_normal([T, N]).astype("float32")
        t_np = bench(lambda: xn.T @ yn, args.repeat)
        t_dnnl = float("inf")
        if sg is not None:
            cn = np.zeros([K, N], "float32")
            t_dnnl = bench(lambda: sg(b"T", b"N", K, N, T, 1.0, xn.ctypes.data, K, yn.ctypes.data,
                                      N, 1.0, cn.ctypes.data, N), args.repeat)
        t_plain = min(t_np, t_dnnl)
        mg = paddle.zeros([K, N], "float32")
        x32, y32 = paddle.to_tensor(xn), paddle.to_tensor(yn)
        t32 = bench(lambda: ops.fused_linear_param_grad_add(x32, y32, mg, None, True, False),
                    args.repeat)
        rows.append((name, "fp32", "ours (dnnl_sgemm)", t32, t32 / t_plain, 1.0))
        rows.append((name, "fp32", "numpy sgemm", t_np, t_np / t_plain, t32 / t_np))
        if sg is not None:
            rows.append((name, "fp32", "raw dnnl_sgemm", t_dnnl, t_dnnl / t_plain, t32 / t_dnnl))
        xb, yb = x32.astype("bfloat16"), y32.astype("bfloat16")
        paths = [("auto", f"ours bf16 ({info['bf16_path']}, auto)")]
        paths.append(("widen", "ours bf16 (widen-sgemm, forced)"))
        if not args.no_native:
            paths.append(("native", "ours bf16 (onednn-bf16, forced)"))
        for path, label in paths:
            tb = with_bf16_path(path, lambda: bench(
                lambda: ops.fused_linear_param_grad_add(xb, yb, mg, None, True, False), args.repeat))
            rows.append((name, "bf16", label, tb, tb / t_plain, t32 / tb))
            if path == "auto":
                summary.append((name, t32 / tb, t32 / t_plain))
        xh, yh = x32.astype("float16"), y32.astype("float16")
        th = bench(lambda: ops.fused_linear_param_grad_add(xh, yh, mg, None, True, False), args.repeat)
        rows.append((name, "fp16", "ours fp16 (widen-sgemm)", th, th / t_plain, t32 / th))
        if not args.no_unfused:
            def unfused():
                g = paddle.matmul(xb.astype("float32"), yb.astype("float32"), transpose_x=True)
                mg.add_(g.astype("float32"))
            tu = bench(unfused, args.repeat)
            rows.append((name, "bf16", "Paddle unfused (cast+matmul+add_)", tu, tu / t_plain, t32 / tu))
        if args.fp64:
            x64, y64 = xn.astype("float64"), yn.astype("float64")
            t_np64 = bench(lambda: x64.T @ y64, args.repeat)
            xd, yd = paddle.to_tensor(x64), paddle.to_tensor(y64)
            md = paddle.zeros([K, N], "float64")
            td = bench(lambda: ops.fused_linear_param_grad_add(xd, yd, md, None, True, False),
                       args.repeat)
            rows.append((name, "fp64", "ours fp64 (blocked DGEMM)", td, td / t_np64, t32 / td))
            rows.append((name, "fp64", "numpy dgemm", t_np64, 1.0, t32 / t_np64))
    print()
    print("| T x K x N | input | what | GFLOP/s | time / fastest plain sgemm | throughput / ours fp32 |")
    print("|---|---|---|---|---|---|")
    for name, dt, what, t, vs_plain, vs32 in rows:
        T, K, N = map(int, name.split("x"))
        print(f"| {name} | {dt} | {what} | {2.0 * T * K * N / t / 1e9:.1f} | {vs_plain:.2f} | "
              f"{vs32:.2f} |")
    print("(fp64 rows: 'time / fastest plain' is against numpy's dgemm)" if args.fp64 else "")
    target = ">= 1.8" if info["native_bf16"] else ">= 0.85"
    for name, ratio, fp32_vs_plain in summary:
        print(f"{name}: bf16 (auto path) throughput / fp32 op = {ratio:.2f} (target {target}); "
              f"fp32 op time / fastest plain sgemm = {fp32_vs_plain:.2f} (target <= 1.10)")


if __name__ == "__main__":
    main()
