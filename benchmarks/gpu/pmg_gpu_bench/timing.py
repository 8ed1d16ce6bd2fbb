"""The speed rows: median CUDA-event times of ours against the bare GEMM in the same process."""

from __future__ import annotations

import re
import statistics
import time

from .capi import CoreError, info_field
from .report import speed_verdict
from .shapes import BIAS_PATH_SHAPES


class _CpuEvent:
    """Stand-in for torch.cuda.Event in --simulate-cpu runs."""

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def time_fn(bench, fn, stream=None):
    """Median GPU time of fn (ms).  A short spin kernel before the first event keeps the GPU
    busy while the host enqueues the call, so the events time the GPU work, not our ctypes
    and descriptor overhead (both sides get the same treatment)."""
    Event = _CpuEvent if bench.sim else (lambda: bench.torch.cuda.Event(enable_timing=True))
    spin = getattr(bench.torch.cuda, "_sleep", None) if not bench.sim else None
    for _ in range(3):
        fn()
    bench.sync()
    ts = []
    for _ in range(bench.args.repeat):
        a, b = Event(), Event()
        if spin is not None:
            spin(1_000_000)  # ~0.5 ms of clock cycles
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def speed(bench):
    torch = bench.torch
    wbuf = None if bench.sim else torch.empty(64 << 20, dtype=torch.uint8, device=bench.dev)
    ws = {} if bench.sim else {"workspace": wbuf.data_ptr(), "workspace_bytes": wbuf.numel()}
    for T, K, N in bench.args.bench_shapes:
        x = torch.randn(T, K, device=bench.dev, dtype=torch.bfloat16)
        dy = torch.randn(T, N, device=bench.dev, dtype=torch.bfloat16)
        mg = torch.zeros(K, N, device=bench.dev, dtype=torch.float32)
        db = torch.zeros(N, device=bench.dev)
        flop = 2.0 * T * K * N
        t_gemm = time_fn(bench, lambda x=x, dy=dy: torch.matmul(x.T, dy))
        t_ours = time_fn(
            bench, lambda x=x, dy=dy, mg=mg: bench.call(x, dy, mg, None, 1.0, 1.0, "bfloat16", **ws)
        )
        t_bias = time_fn(
            bench,
            lambda x=x, dy=dy, mg=mg, db=db: bench.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", **ws),
        )
        info = bench.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", **ws)
        t_kern = (
            t_bias
            if bench.sim
            else time_fn(
                bench,
                lambda x=x, dy=dy, mg=mg, db=db: bench.call(
                    x, dy, mg, db, 1.0, 1.0, "bfloat16", bias_mode="kernel", **ws
                ),
            )
        )
        t_unf = time_fn(bench, lambda x=x, dy=dy, mg=mg: mg.add_(torch.matmul(x.T, dy).float()))
        row = {
            "shape": [T, K, N],
            "ours_ms": t_ours,
            "ours_with_bias_ms": t_bias,
            "ours_bias_kernel_ms": t_kern,
            "bf16_gemm_ms": t_gemm,
            "unfused_ms": t_unf,
            "ours_tflops": flop / t_ours / 1e9,
            "ours_vs_gemm": t_ours / t_gemm,
            "bias_vs_ours": t_bias / t_ours,
            "bias_kernel_vs_ours": t_kern / t_ours,
            "unfused_vs_ours": t_unf / t_ours,
            "bias_path": "cpu" if bench.sim else info_field(info, "bias"),
        }
        g_ok, b_ok = speed_verdict(row)
        row["targets_met"] = g_ok and b_ok
        bench.report["bench"].append(row)
        print(
            f"speed      {T}x{K}x{N}: ours {t_ours:.3f} ms, +bias {t_bias:.3f} "
            f"({row['bias_path']}), +bias kernel {t_kern:.3f}, gemm {t_gemm:.3f}, "
            f"unfused {t_unf:.3f}",
            flush=True,
        )
        x = dy = mg = db = None
        if not bench.sim:
            torch.cuda.empty_cache()


def bias_paths(bench):
    """The bias-path shapes (LoRA-narrow N, MoE-small M*N, large M): ours with a bias gradient on
    each path (auto, kernel, epilogue) against ours without bias and the bare bf16 GEMM, and
    torch's fp32 column sum as the bias reduction's yardstick.  Reports which path auto took
    (and why), whether auto was within 3 % of the faster forced path, and the bias kernel's
    effective bandwidth over dY."""
    if bench.sim:
        return bench.skip("speed", "bias-path shapes: simulation (the CPU core has one bias path)")
    torch = bench.torch
    wbuf = torch.empty(64 << 20, dtype=torch.uint8, device=bench.dev)
    ws = {"workspace": wbuf.data_ptr(), "workspace_bytes": wbuf.numel()}
    for name, (T, K, N) in BIAS_PATH_SHAPES:
        x = torch.randn(T, K, device=bench.dev, dtype=torch.bfloat16)
        dy = torch.randn(T, N, device=bench.dev, dtype=torch.bfloat16)
        mg = torch.zeros(K, N, device=bench.dev, dtype=torch.float32)
        db = torch.zeros(N, device=bench.dev)
        row = {
            "name": name,
            "shape": [T, K, N],
            "bf16_gemm_ms": time_fn(bench, lambda x=x, dy=dy: torch.matmul(x.T, dy)),
            "ours_ms": time_fn(
                bench,
                lambda x=x, dy=dy, mg=mg: bench.call(x, dy, mg, None, 1.0, 1.0, "bfloat16", **ws),
            ),
            "colsum_ms": time_fn(bench, lambda dy=dy: dy.sum(0, dtype=torch.float32)),
        }
        for mode in ("auto", "kernel", "epilogue"):
            try:
                info = bench.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", bias_mode=mode, **ws)
                row[f"{mode}_ms"] = time_fn(
                    bench,
                    lambda m=mode, x=x, dy=dy, mg=mg, db=db: bench.call(
                        x, dy, mg, db, 1.0, 1.0, "bfloat16", bias_mode=m, **ws
                    ),
                )
                if mode == "auto":
                    why = re.search(r"bias=\S+ \(([^)]*)\)", info)
                    row["auto_path"] = info_field(info, "bias")
                    row["auto_why"] = why.group(1) if why else ""
            except CoreError as e:
                row[f"{mode}_ms"] = None
                row[f"{mode}_error"] = str(e)[:160]
        forced = [row[k] for k in ("kernel_ms", "epilogue_ms") if row.get(k)]
        row["ours_vs_gemm"] = row["ours_ms"] / row["bf16_gemm_ms"]
        if row.get("auto_ms"):
            row["auto_vs_ours"] = row["auto_ms"] / row["ours_ms"]
            row["auto_vs_best_forced"] = row["auto_ms"] / min(forced) if forced else None
        if row.get("kernel_ms") and row["kernel_ms"] > row["ours_ms"]:
            row["bias_kernel_GBps"] = T * N * 2 / ((row["kernel_ms"] - row["ours_ms"]) * 1e-3) / 1e9
        ok = bool(row.get("auto_ms")) and (row.get("auto_vs_best_forced") or 1.0) <= 1.03
        bench.report.setdefault("bias_paths", []).append(row)
        bench.add(
            "speed",
            f"bias paths {name} {T}x{K}x{N}",
            ok,
            f"auto {row.get('auto_path')} {row.get('auto_ms') or 0:.3f} ms, kernel "
            f"{row.get('kernel_ms') or 0:.3f}, epilogue {row.get('epilogue_ms') or 0:.3f}, "
            f"no bias {row['ours_ms']:.3f}, gemm {row['bf16_gemm_ms']:.3f}, colsum "
            f"{row['colsum_ms']:.3f}",
        )
        x = dy = mg = db = None
        torch.cuda.empty_cache()
