"""Weight-gradient accumulation speed: our op vs plain GEMMs vs Paddle's unfused path.

For llama-like shapes ``dW[K, N] += xᵀ[K, T] · dy[T, N]`` (T tokens), fp32 accumulator
(``main_grad``), all at the same thread count (``OMP_NUM_THREADS``, default: all
cores), in one run; every figure is also printed as a ratio against a baseline
measured in the same run:

* ``ours fp32``   -- ``paddle_mgrad.ops.fused_linear_param_grad_add`` on fp32 inputs
  (beta = 1, in place), labelled with the GEMM the op's backend runs (``dnnl_sgemm`` for
  ``cpp-onednn``, the portable OpenMP sgemm for ``cpp-portable``, Paddle's matmul for the
  pure-Paddle fallback), against the fastest plain sgemm of the same product: numpy's BLAS
  (``xᵀ @ dy``, no accumulation) and raw oneDNN ``dnnl_sgemm`` called through ctypes
  (beta = 1);
* ``ours bf16``   -- the op on bf16 inputs along the path the CPU gets at run time
  (``ops.cpu_info()``), and both forced paths (``PADDLE_MGRAD_CPU_BF16=native|widen``),
  as throughput / ``ours fp32``;
* ``unfused``     -- what Paddle does on CPU without the fusion for a bf16 weight under
  O2 AMP with ``main_grad``: ``matmul`` of fp32 copies (Paddle's CPU matmul has no bf16
  kernel), the weight gradient cast down to the bf16 parameter's dtype (the ``cast`` op's
  backward), then cast up and ``add_`` into the fp32 ``main_grad`` (MixPrecisionLayer's hook).

Targets: bf16 throughput >= 0.85x fp32 without native bf16, >= 1.8x with
it; ``ours fp32`` time <= 1.1x the fastest plain sgemm.  ``--fp64`` adds float64 (our
blocked DGEMM) against numpy's dgemm.

    python benchmarks/bench_wgrad.py [--tokens 4096] [--repeat 3] [--fp64]
"""

import argparse
import ctypes
import functools
import os
import time

_threads = os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
os.environ.setdefault("OPENBLAS_NUM_THREADS", _threads)
os.environ.setdefault("MKL_NUM_THREADS", _threads)

import zlib  # noqa: E402,F401  (before paddle on 2.6)

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

from paddle_mgrad import ops  # noqa: E402


def bench_all(variants, repeat):
    """Times {name: fn} in interleaved rounds (every variant once per round, so load from
    other processes hits them alike); returns {name: best time} (min: the least disturbed)."""
    for fn in variants.values():
        fn()  # warm-up (and JIT build)
    ts = {name: [] for name in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    return {name: min(v) for name, v in ts.items()}


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


# The GEMM each CPU tier of the op (``ops.backends()["cpu"]``) runs for fp32 inputs.
FP32_GEMM = {
    "cpp-onednn": "dnnl_sgemm",
    "cpp-portable": "portable OpenMP sgemm",
    "python": "pure-Paddle fallback: Paddle's matmul",
}


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
    ap.add_argument(
        "--no-native",
        action="store_true",
        help="skip the forced oneDNN-bf16 path (slow on CPUs without native bf16)",
    )
    ap.add_argument("--no-unfused", action="store_true", help="skip Paddle's unfused path")
    ap.add_argument("--fp64", action="store_true", help="also time float64 against numpy dgemm")
    ap.add_argument(
        "--allow-fallback",
        action="store_true",
        help="time the pure-Paddle fallback when the C++ op did not build",
    )
    args = ap.parse_args()
    if not ops.backend().startswith("cpp-") and not args.allow_fallback:
        # the figures would be Paddle's matmul labelled as ours
        raise SystemExit(
            f"the C++ op is not in use (backend {ops.backend()}: "
            f"{ops.fallback_reason()}); pass --allow-fallback to time it anyway"
        )
    info = ops.cpu_info()
    print(
        f"CPU {cpu_name()}; ISA: {info['isa']}; native bf16: {info['native_bf16']}; "
        f"bf16 path chosen at run time: {info['bf16_path']}"
    )
    print(
        f"paddle {paddle.__version__}, op backend {ops.backend()}, threads {_threads}, "
        f"tokens {args.tokens}, numpy {np.__version__}"
    )
    sg = dnnl_sgemm()
    fallback = ops.backends()["cpu"] == "python"
    ours32 = f"ours fp32 ({FP32_GEMM[ops.backends()['cpu']]})"
    rows, summary = [], []
    for shape in args.shapes.split(","):
        K, N = map(int, shape.split("x"))
        T = args.tokens
        name = f"{T}x{K}x{N}"
        rs = np.random.RandomState(0)
        xn = rs.standard_normal([T, K]).astype("float32")
        yn = rs.standard_normal([T, N]).astype("float32")
        cn = np.zeros([K, N], "float32")
        mg = paddle.zeros([K, N], "float32")
        x32, y32 = paddle.to_tensor(xn), paddle.to_tensor(yn)
        xb, yb = x32.astype("bfloat16"), y32.astype("bfloat16")
        xh, yh = x32.astype("float16"), y32.astype("float16")

        def op(x, dy, acc=mg, path=None):
            if path is None:
                return lambda: ops.fused_linear_param_grad_add(x, dy, acc, None, True, False)
            return lambda: with_bf16_path(
                path, lambda: ops.fused_linear_param_grad_add(x, dy, acc, None, True, False)
            )

        # Closures bind this shape's arrays now (default arguments, partial).
        v = {ours32: op(x32, y32), "numpy sgemm": lambda xn=xn, yn=yn: xn.T @ yn}
        if sg is not None:
            v["raw dnnl_sgemm"] = functools.partial(
                sg,
                b"T",
                b"N",
                K,
                N,
                T,
                1.0,
                xn.ctypes.data,
                K,
                yn.ctypes.data,
                N,
                1.0,
                cn.ctypes.data,
                N,
            )
        v[f"ours bf16 ({info['bf16_path']}, auto)"] = op(xb, yb)
        if not fallback:  # the fallback has no bf16 paths to force
            v["ours bf16 (widen-sgemm, forced)"] = op(xb, yb, path="widen")
            if not args.no_native and ops.backends()["cpu"] == "cpp-onednn":  # needs oneDNN
                v["ours bf16 (onednn-bf16, forced)"] = op(xb, yb, path="native")
        v[f"ours fp16 ({FP32_GEMM['python'] if fallback else 'widen-sgemm'})"] = op(xh, yh)
        if not args.no_unfused:

            def unfused(xb=xb, yb=yb, mg=mg):
                g = paddle.matmul(xb.astype("float32"), yb.astype("float32"), transpose_x=True)
                mg.add_(g.astype("bfloat16").astype("float32"))

            v["Paddle unfused bf16 (cast+matmul+cast to bf16+cast+add_)"] = unfused
        if args.fp64:
            x64, y64 = xn.astype("float64"), yn.astype("float64")
            xd, yd = paddle.to_tensor(x64), paddle.to_tensor(y64)
            md = paddle.zeros([K, N], "float64")
            v[f"ours fp64 ({FP32_GEMM['python'] if fallback else 'blocked DGEMM'})"] = op(
                xd, yd, md
            )
            v["numpy dgemm"] = lambda x64=x64, y64=y64: x64.T @ y64
        t = bench_all(v, args.repeat)
        t32 = t[ours32]
        t_plain = min(t["numpy sgemm"], t.get("raw dnnl_sgemm", float("inf")))
        for what, tw in t.items():
            dt = (
                what.split()[1]
                if what.startswith("ours")
                else ("fp64" if "dgemm" in what else ("bf16" if "bf16" in what else "fp32"))
            )
            base = t["numpy dgemm"] if dt == "fp64" else t_plain
            rows.append((name, dt, what, tw, tw / base, t32 / tw))
        summary.append((name, t32 / t[f"ours bf16 ({info['bf16_path']}, auto)"], t32 / t_plain))
    print()
    print(
        "| T x K x N | input | what | GFLOP/s | time / fastest plain sgemm | throughput / ours fp32 |"
    )
    print("|---|---|---|---|---|---|")
    for name, dt, what, t, vs_plain, vs32 in rows:
        T, K, N = map(int, name.split("x"))
        print(
            f"| {name} | {dt} | {what} | {2.0 * T * K * N / t / 1e9:.1f} | {vs_plain:.2f} | "
            f"{vs32:.2f} |"
        )
    print(
        f"(best of {args.repeat} interleaved rounds; fp64 rows: 'time / fastest plain' is "
        "against numpy's dgemm)"
    )
    target = ">= 1.8" if info["native_bf16"] else ">= 0.85"
    for name, ratio, fp32_vs_plain in summary:
        print(
            f"{name}: bf16 (auto path) throughput / fp32 op = {ratio:.2f} (target {target}); "
            f"fp32 op time / fastest plain sgemm = {fp32_vs_plain:.2f} (target <= 1.10)"
        )


if __name__ == "__main__":
    main()
