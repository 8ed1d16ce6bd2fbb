"""What each row runs: shapes, speed targets, and the float64 error bounds the results must meet."""

from __future__ import annotations

from .capi import ELEM

# (tokens, K, N): llama-7B/13B-like projections (the README's four shapes)
BENCH_SHAPES = [(8192, 4096, 4096), (8192, 4096, 11008), (16384, 4096, 14336), (16384, 14336, 4096)]
# (tokens, K, N) where the bias path matters: small K*N with large M, where
# cuBLASLt's plain GEMM splits K and the split-K-free epilogue cannot, and the bias kernel's
# share of the time is largest.  Timed against the bare GEMM, per bias path.
BIAS_PATH_SHAPES = [
    ("lora-A", (16384, 4096, 16)),  # LoRA rank 16: x[T, 4096] -> 16 (LoRA-narrow N)
    ("lora-B", (16384, 16, 4096)),  # rank 16 -> 4096 (K = 16)
    ("moe-expert", (512, 4096, 1408)),  # one expert's tokens (small M*N)
    ("moe-small", (128, 2048, 768)),  # a cold expert
    ("large-M", (131072, 1024, 1024)),  # long sequences x a narrow projection
]
CHECK_SHAPES = [(4095, 1023, 517), (257, 64, 96), (8192, 4096, 4096), (3, 5, 7)]
OFFSET_SHAPES = [(1000, 520, 264), (333, 130, 66)]
OFFSETS = (2, 4, 8, 16)
TARGET_VS_GEMM = 1.05  # ours / bare bf16 GEMM
TARGET_BIAS = 1.03  # ours with bias / ours


def error_bound(abs_x_t_abs_dy, start_abs, k, out_dtype, in_dtype):
    """Elementwise bound on |ours - float64 reference| for one accumulation.

    Inputs are exact in fp32 (bf16/fp16 products are exact in fp32), so the
    accumulation error is at most ~k * 2^-24 of sum|x||dy| (we allow 2 * k * u,
    with u = 2^-24, capped below by 1e-6 relative); storing in bf16/fp16 adds
    one rounding of the result, at most half an ulp (2^-8 / 2^-11 relative), which we
    double: with a handful of terms the rounding alone reaches 0.9 of half an ulp
    (seen in --simulate-cpu).  fp32 inputs use fp32 FMA (compute type 32F, no TF32).
    """
    if in_dtype == "float64":  # fp64 in, fp64 compute and out (Paddle's MPTypeTrait<double>)
        u, floor = 2.0**-53, 1e-15
    else:
        u, floor = 2.0**-24, 1e-6
    acc = max(2 * k * u, floor) * (abs_x_t_abs_dy + start_abs)
    rnd = {"float32": 0.0, "float64": 0.0, "bfloat16": 2.0**-7, "float16": 2.0**-10}[out_dtype]
    return acc + rnd * (abs_x_t_abs_dy + start_abs) + 1e-30


def check_result(got, want, bound):
    """Returns (ok, max |err|/bound, max relative error) for numpy arrays."""
    import numpy as np

    err = np.abs(got.astype("float64") - want)
    ratio = float((err / bound).max()) if err.size else 0.0
    rel = float(err.max() / max(np.abs(want).max(), 1e-30)) if err.size else 0.0
    return bool(np.isfinite(got).all() and ratio <= 1.0), ratio, rel


def offset_cases(dtypes=("bfloat16", "float16", "float32", "float64"), offsets=OFFSETS):
    """(in_dtype, offset, which tensors get it) for the offset-view checks: a view can only start
    at a multiple of its element size, so +2 applies to bf16/fp16 inputs only, and main_grad
    (fp32, or fp64 for fp64 inputs) and the bias gradient take the offsets that fit them."""
    out = []
    for dt in dtypes:
        acc = "float64" if dt == "float64" else "float32"
        for off in offsets:
            moved = [
                n
                for n, t in (("x", dt), ("dy", dt), ("main_grad", acc), ("bias", acc))
                if off % ELEM[t] == 0
            ]
            if moved:
                out.append((dt, off, moved))
    return out
