"""What the native bf16 path's exactness check costs, as a fraction of the GEMM it guards.

The hardware bf16 dot products (avx512_bf16 VDPBF16PS, AMX) read subnormal bf16 inputs as
zero and flush subnormal fp32 results to zero.  Before each oneDNN bf16 GEMM the op makes one
pass over x and dy (``pmg::bf16_native_is_exact``: smallest nonzero magnitudes) and widens the
call to the fp32 GEMM when a subnormal could appear.  This script times, in interleaved rounds
of one run (same threads, same data, so the ratios hold on a shared, noisy machine):

* ``gemm``  -- raw ``dnnl_gemm_bf16bf16f32`` through ctypes, ``C[K, N] += xᵀ · dy`` (beta = 1);
* ``scan``  -- the exactness check alone, through the test/benchmark library's C ABI
  (``pmg_bf16_native_is_exact_c``, csrc/wgrad_capi_testing.cc; built once into the op cache by
  benchmarks/gpu/pmg_gpu_bench/build.py with the same wgrad_bf16_scan.cc and flags);
* ``op native`` / ``op widen`` -- ``paddle_mgrad.ops.fused_linear_param_grad_add`` on the same
  bf16 data with ``PADDLE_MGRAD_CPU_BF16=native`` (check + GEMM) and ``=widen``.

and prints ``scan / gemm`` (the target is <= 2 %) and ``op native / gemm``.  On a CPU without
native bf16 the "gemm" is oneDNN's reference kernel (~0.5 GFLOP/s): pass ``--allow-reference``
to time it anyway (the ratio then says nothing about the hardware path).

    python benchmarks/bench_bf16_scan.py [--shapes 4096x4096x4096,4096x1024x4096] [--repeat 7]
"""

import argparse
import ctypes
import functools
import os
import time

_threads = os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

import zlib  # noqa: E402,F401  (before paddle on 2.6)

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from paddle_mgrad import ops  # noqa: E402
from paddle_mgrad.ops import _build  # noqa: E402


def bf16_bits(a):
    """float32 array -> bf16 bit patterns (round to nearest even), uint16."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def with_env(name, value, fn):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _test_library():
    """The test/benchmark library (it carries the scan's probe; the op library does not)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
    try:
        from pmg_gpu_bench.build import cached_cpu_library
    finally:
        sys.path.pop(0)
    return cached_cpu_library(_build.cache_root())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--shapes",
        default="4096x4096x4096,4096x1024x4096,4096x4096x1024",
        help="TxKxN list (T tokens: the GEMM's reduction dim)",
    )
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument(
        "--allow-reference",
        action="store_true",
        help="run even when oneDNN's bf16 GEMM is its reference kernel here",
    )
    args = ap.parse_args()
    info = ops.cpu_info()
    if not info["native_bf16"] and not args.allow_reference:
        raise SystemExit(
            f"no native bf16 here ({info}); the guarded GEMM would be oneDNN's "
            "reference kernel: pass --allow-reference to time it anyway"
        )
    lib = ctypes.CDLL(_test_library())
    scan = lib.pmg_bf16_native_is_exact_c
    scan.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    scan.restype = ctypes.c_int
    dnnl = ctypes.CDLL(os.path.join(os.path.dirname(paddle.__file__), "libs", "libdnnl.so.3"))
    gemm = dnnl.dnnl_gemm_bf16bf16f32
    i64, fl, vp = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    gemm.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, fl, vp, i64, vp, i64, fl, vp, i64]
    gemm.restype = ctypes.c_int
    print(f"paddle {paddle.__version__}, op {ops.backend()}, threads {_threads}, cpu {info}")
    print(
        "| T x K x N | gemm ms | scan ms | scan / gemm | op native ms | op native / gemm "
        "| op widen ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        T, K, N = map(int, shape.split("x"))
        rs = np.random.RandomState(0)
        xb = bf16_bits(rs.standard_normal([T, K]).astype(np.float32))
        yb = bf16_bits(rs.standard_normal([T, N]).astype(np.float32) * 1e-3)
        c = np.zeros([K, N], np.float32)
        assert scan(xb.ctypes.data, xb.size, yb.ctypes.data, yb.size) == 1  # normal data
        # bf16 tensors holding exactly those bits (the float32 values are bf16 values)
        x = paddle.to_tensor((xb.astype(np.uint32) << 16).view(np.float32)).astype("bfloat16")
        y = paddle.to_tensor((yb.astype(np.uint32) << 16).view(np.float32)).astype("bfloat16")
        mg = paddle.zeros([K, N], "float32")
        # Bound now (partial, default arguments): each closure keeps this shape's arrays.
        op = functools.partial(ops.fused_linear_param_grad_add, x, y, mg, None, True, False)
        variants = {
            "gemm": functools.partial(
                gemm,
                b"T",
                b"N",
                K,
                N,
                T,
                1.0,
                xb.ctypes.data,
                K,
                yb.ctypes.data,
                N,
                1.0,
                c.ctypes.data,
                N,
            ),
            "scan": functools.partial(scan, xb.ctypes.data, xb.size, yb.ctypes.data, yb.size),
            "op native": functools.partial(with_env, "PADDLE_MGRAD_CPU_BF16", "native", op),
            "op widen": functools.partial(with_env, "PADDLE_MGRAD_CPU_BF16", "widen", op),
        }
        before = ops.cpu_info()["bf16_exact_fallbacks"]
        for fn in variants.values():
            fn()  # warm-up
        times = {k: [] for k in variants}
        for _ in range(args.repeat):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        assert ops.cpu_info()["bf16_exact_fallbacks"] == before  # the op really ran native
        best = {k: min(v) for k, v in times.items()}
        print(
            f"| {shape} | {best['gemm'] * 1e3:.2f} | {best['scan'] * 1e3:.3f} | "
            f"{best['scan'] / best['gemm']:.2%} | {best['op native'] * 1e3:.2f} | "
            f"{best['op native'] / best['gemm']:.3f} | {best['op widen'] * 1e3:.2f} |"
        )
    print(f"(best of {args.repeat} interleaved rounds)")


if __name__ == "__main__":
    main()
