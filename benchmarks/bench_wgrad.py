"""Weight-gradient accumulation speed: our op vs Paddle's unfused path vs plain sgemm.

For llama-like shapes ``dW[K, N] += xᵀ[K, T] · dy[T, N]`` (T tokens), fp32 and
bf16 inputs, fp32 accumulator (``main_grad``):

* ``ours``     -- ``paddle_mgrad.ops.fused_linear_param_grad_add`` (beta = 1, in place)
* ``unfused``  -- what Paddle does without the fusion: ``matmul`` (inputs cast to
  fp32 first for bf16: Paddle has no CPU bf16 matmul) then ``cast`` + ``add_``
* ``sgemm``    -- numpy's fp32 GEMM of the same product (the fastest plain GEMM
  reachable without our op; it does not accumulate)

All at the same thread count (``OMP_NUM_THREADS``, default: all cores), in one
run; ratios are printed against ``sgemm`` and ``unfused``.

    python benchmarks/bench_wgrad.py [--tokens 4096] [--repeat 3]
"""
import argparse
import os
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--shapes", default="1024x4096,4096x4096", help="KxN list")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"paddle {paddle.__version__}, op backend {ops.backend()}, threads {_threads}, "
          f"tokens {args.tokens}")
    rows = []
    for shape in args.shapes.split(","):
        K, N = map(int, shape.split("x"))
        T = args.tokens
        flop = 2.0 * T * K * N
        rs = np.random.RandomState(0)
        xn = rs.standard_normal([T, K]).astype("float32")
        yn = rs.standard_normal([T, N]).astype("float32")
        sgemm = bench(lambda: xn.T @ yn, args.repeat)
        for dtype in ("float32", "bfloat16"):
            x = paddle.to_tensor(xn).astype(dtype)
            dy = paddle.to_tensor(yn).astype(dtype)
            mg = paddle.zeros([K, N], "float32")

            def ours():
                ops.fused_linear_param_grad_add(x, dy, mg, None, True, False)

            def unfused():
                a, b = (x, dy) if dtype == "float32" else (x.astype("float32"), dy.astype("float32"))
                g = paddle.matmul(a, b, transpose_x=True)
                mg.add_(g.astype("float32"))

            t_ours, t_unf = bench(ours, args.repeat), bench(unfused, args.repeat)
            rows.append((f"{T}x{K}x{N}", dtype, flop / t_ours / 1e9, flop / t_unf / 1e9,
                         flop / sgemm / 1e9, t_ours / sgemm, t_unf / t_ours))
    print(f"{'T x K x N':>16s} {'input':>9s} {'ours GF/s':>10s} {'unfused':>9s} {'np sgemm':>9s} "
          f"{'ours/sgemm time':>16s} {'unfused/ours time':>18s}")
    for r in rows:
        print(f"{r[0]:>16s} {r[1]:>9s} {r[2]:10.1f} {r[3]:9.1f} {r[4]:9.1f} {r[5]:16.2f} {r[6]:18.2f}")
    by = {(r[0], r[1]): r for r in rows}
    for shape in sorted({r[0] for r in rows}):
        if (shape, "bfloat16") in by:
            print(f"{shape}: bf16-input op throughput / fp32 op throughput = "
                  f"{by[(shape, 'bfloat16')][2] / by[(shape, 'float32')][2]:.2f}")


if __name__ == "__main__":
    main()
