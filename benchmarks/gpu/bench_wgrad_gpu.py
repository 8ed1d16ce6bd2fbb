"""Check and time the CUDA weight-gradient core on a machine with CUDA + torch and no Paddle.

    python benchmarks/gpu/bench_wgrad_gpu.py            # build, check, time; < 5 min on one H200
    python benchmarks/gpu/bench_wgrad_gpu.py --quick    # fewer shapes/repeats
    python benchmarks/gpu/bench_wgrad_gpu.py --cpu-core # Paddle-free CPU core only (no GPU needed)

1. Builds ``csrc/wgrad_cuda.cu`` + ``wgrad_cpu.cc`` + ``wgrad_capi.cc`` into a shared
   library with nvcc (sm_80, sm_90 and PTX) and loads it with ctypes.
2. Checks it against a float64 reference on fresh random data: bf16, fp16,
   fp32 and fp64 inputs (fp64 accumulates in fp64, as Paddle's kernel:
   MPTypeTrait<double> is double); shapes including odd ones (4095 x 1023);
   three in-place accumulations (beta = 1) into fp32 (fp64) and, for a fresh buffer (beta = 0), an
   output poisoned with NaN beforehand; with and without bias.
3. Times it with CUDA events (warm-up, median of many) against (a) a plain
   bf16 GEMM of the same shape (``torch.matmul``) and (b) the unfused path
   (``torch.matmul`` -> ``.float()`` -> ``add_``), for llama-like shapes.

Prints a short table last and writes everything as JSON to ``$OUT`` (or
``--out``).  Targets: ours <= 1.05x (a); (b) >= 1.3x ours.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.normpath(os.path.join(HERE, "..", "..", "csrc"))


def _load_build_config():
    """paddle_mgrad/ops/build_config.py by file path (it imports nothing from Paddle; the package's
    __init__ does): the same flags, sources and toolkit discovery as the Paddle build."""
    path = os.path.normpath(os.path.join(HERE, "..", "..", "paddle_mgrad", "ops", "build_config.py"))
    spec = importlib.util.spec_from_file_location("pmg_build_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bc = _load_build_config()
DTYPE_CODE = {"float32": 0, "bfloat16": 1, "float16": 2, "float64": 3}
# (tokens, K, N): llama-7B/13B-like projections
BENCH_SHAPES = [(8192, 4096, 4096), (8192, 4096, 11008), (16384, 4096, 14336),
                (16384, 14336, 4096)]
CHECK_SHAPES = [(4095, 1023, 517), (257, 64, 96), (8192, 4096, 4096), (3, 5, 7)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--compile-only", action="store_true",
                    help="nvcc-compile the CUDA core and C API (no GPU needed; CI)")
    ap.add_argument("--simulate-cpu", action="store_true",
                    help="run the GPU path's logic on the CPU core with CPU torch (tiny shapes)")
    ap.add_argument("--paddle-include", default=None,
                    help="with --compile-only: also syntax-check the Paddle binding's CUDA branch")
    ap.add_argument("--cpu-core", action="store_true",
                    help="build/check the CPU core only (no CUDA, no torch needed)")
    ap.add_argument("--repeat", type=int, default=None, help="timed runs per case (median)")
    ap.add_argument("--shapes", default=None, help="benchmark shapes T:K:N,T:K:N")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    ap.add_argument("--build-dir", default=None)
    args = ap.parse_args(argv)
    if args.repeat is None:
        args.repeat = 10 if args.quick else 30
    if args.simulate_cpu and not args.shapes:
        args.shapes = "256:64:96"
    if args.shapes:
        args.bench_shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    else:
        args.bench_shapes = BENCH_SHAPES[:2] if args.quick else BENCH_SHAPES
    return args


# ----------------------------------------------------------------- reference math
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
        u, floor = 2.0 ** -53, 1e-15
    else:
        u, floor = 2.0 ** -24, 1e-6
    acc = max(2 * k * u, floor) * (abs_x_t_abs_dy + start_abs)
    rnd = {"float32": 0.0, "float64": 0.0, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}[out_dtype]
    return acc + rnd * (abs_x_t_abs_dy + start_abs) + 1e-30


def check_result(got, want, bound):
    """Returns (ok, max |err|/bound, max relative error) for numpy arrays."""
    import numpy as np

    err = np.abs(got.astype("float64") - want)
    ratio = float((err / bound).max()) if err.size else 0.0
    rel = float(err.max() / max(np.abs(want).max(), 1e-30)) if err.size else 0.0
    return bool(np.isfinite(got).all() and ratio <= 1.0), ratio, rel


# ----------------------------------------------------------------------- building
def toolkit(need_thrust=False):
    """The CUDA toolkit (nvcc, headers, cuBLASLt) as build_config finds it for the Paddle build."""
    return bc.find_cuda(need_thrust=need_thrust)


def cuda_include_dirs(tk=None):
    """Directories holding cuda_runtime.h and cublasLt.h (toolkit or pip wheels)."""
    tk = tk or toolkit()
    return ([os.path.join(tk.home, "include")] if tk.home else []) + list(tk.include_dirs)


def cublas_lib_dirs(tk=None):
    tk = tk or toolkit()
    return [os.path.dirname(tk.libs["cublasLt"])] if "cublasLt" in tk.libs else []


NVCC_ARCH = bc.NVCC_ARCH


def _require(tk):
    if not tk.ok:
        raise RuntimeError(f"CUDA toolkit incomplete: {tk.problem()}")
    return tk


def check_paddle_binding(paddle_include, python_include):
    """Syntax-check the Paddle binding's GPU branch (PADDLE_WITH_CUDA + PMG_WITH_CUDA) against a
    Paddle wheel's headers; a CPU wheel suffices (Paddle 2.6's: 3.x's CUDA headers want ATen)."""
    tk = _require(toolkit(need_thrust=True))  # Paddle 2.6's extension.h includes thrust
    incs = [paddle_include, os.path.join(paddle_include, "third_party"), python_include, CSRC]
    incs += cuda_include_dirs(tk)
    cmd = ["g++", "-fsyntax-only", *bc.CXX_FLAGS[1:2], "-DPADDLE_WITH_CUDA", bc.CUDA_DEFINE,
           *[f"-I{d}" for d in incs if os.path.isdir(d)], os.path.join(CSRC, "wgrad_op.cc")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(" ".join(cmd), "\n", r.stdout, r.stderr[-6000:])
        raise RuntimeError("the Paddle binding's CUDA branch does not compile")
    print("checked wgrad_op.cc (CUDA branch) against", paddle_include, flush=True)


def compile_only(build_dir):
    """Compile (no link) the CUDA core and the C API for sm_80/sm_90/PTX."""
    os.makedirs(build_dir, exist_ok=True)
    tk = _require(toolkit())
    print(f"toolkit: {tk.summary()}", flush=True)
    incs = [f"-I{d}" for d in tk.include_dirs]
    for src in bc.CUDA_SOURCES + bc.CAPI_SOURCES:
        cmd = [tk.nvcc, "-c", "-x", "cu" if src.endswith(".cu") else "c++", *bc.NVCC_FLAGS,
               "-Xcompiler", "-fPIC,-Wall", f"-I{CSRC}", *incs,
               os.path.join(CSRC, src), "-o", os.path.join(build_dir, src + ".o")]
        if not src.endswith(".cu"):
            cmd = [c for c in cmd if not c.startswith("-gencode")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or "warning" in (r.stderr or "").lower():
            print(" ".join(cmd), "\n", r.stdout, r.stderr)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src}")
        print(f"compiled {src}", flush=True)
    if tk.libs.get("cublasLt"):
        # Link the whole library as the GPU run will, load it, and call it with empty
        # shapes (touches no memory): without a GPU it must fail cleanly, naming the call.
        core = Core(build(build_dir, cuda=True), cuda=True)
        err = ctypes.create_string_buffer(512)
        rc = core.lib.pmg_wgrad_cuda_c(None, None, 1, 0, 0, 0, None, 0, 1.0, None, 0, 1.0,
                                       None, 0, err, len(err))
        msg = err.value.decode()
        print(f"linked and loaded; CUDA call rc={rc} {msg!r}", flush=True)
        if rc != 0 and "cuda" not in msg.lower():
            raise RuntimeError(f"unexpected error text from the CUDA core: {msg!r}")


def build(build_dir, cuda=True):
    os.makedirs(build_dir, exist_ok=True)
    out = os.path.join(build_dir, "libpmg_wgrad_cuda.so" if cuda else "libpmg_wgrad_cpu.so")
    srcs = [os.path.join(CSRC, f) for f in bc.CORE_SOURCES + bc.CAPI_SOURCES]
    if not cuda:
        cmd = ["g++", *bc.CXX_FLAGS, "-fPIC", "-shared", f"-I{CSRC}", *srcs, "-o", out]
    else:
        tk = _require(toolkit())
        # the CXX flags go to the host compiler (-fopenmp etc.); cudart is linked statically by
        # nvcc; cuBLASLt by file name when only libcublasLt.so.<major> exists (wheels), + rpath
        cmd = [tk.nvcc, *bc.NVCC_FLAGS, "-shared", "-Xcompiler", ",".join(["-fPIC"] + bc.CXX_FLAGS[2:]),
               f"-I{CSRC}", *[f"-I{d}" for d in tk.include_dirs],
               *[os.path.join(CSRC, f) for f in bc.CUDA_SOURCES], *srcs, *tk.nvcc_link_args(),
               "-lgomp", "-o", out]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("build failed:\n" + " ".join(cmd) + "\n" + r.stdout + r.stderr)
    print(f"built {out} in {time.time() - t0:.1f} s", flush=True)
    return out


class Core:
    """ctypes wrapper of csrc/wgrad_capi.cc."""

    def __init__(self, path, cuda=True):
        self.lib = ctypes.CDLL(path)
        i64, vp, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        common = [vp, vp, i32, i64, i64, i64, vp, i32, f32, vp, i32, f32]
        self.lib.pmg_wgrad_cpu_c.argtypes = common + [ctypes.c_char_p, i32]
        self.lib.pmg_wgrad_cpu_c.restype = i32
        self.lib.pmg_cpu_gemm_backend.restype = ctypes.c_char_p
        self.cuda = cuda
        if cuda:
            self.lib.pmg_wgrad_cuda_c.argtypes = common + [vp, i32, ctypes.c_char_p, i32]
            self.lib.pmg_wgrad_cuda_c.restype = i32

    def _call(self, fn, extra, x, dy, in_dtype, M, K, N, dw, dw_dtype, dw_beta, db, db_dtype,
              db_beta):
        err = ctypes.create_string_buffer(2048)
        rc = fn(x, dy, DTYPE_CODE[in_dtype], M, K, N, dw, DTYPE_CODE[dw_dtype], dw_beta, db,
                DTYPE_CODE[db_dtype], db_beta, *extra, err, len(err))
        if rc != 0:
            raise RuntimeError(err.value.decode())

    def cpu(self, *a):
        self._call(self.lib.pmg_wgrad_cpu_c, (), *a)

    def gpu(self, stream, device, *a):
        self._call(self.lib.pmg_wgrad_cuda_c, (stream, device), *a)


# ----------------------------------------------------------------- CPU-core check
def check_cpu_core(core):
    """Paddle-free check of the CPU core with numpy (fp32 in, fp32 out; bias)."""
    import numpy as np

    results = []
    rs = np.random.RandomState(0)
    for (M, K, N) in [(37, 19, 23), (600, 70, 530), (0, 4, 5)]:
        x = rs.standard_normal([M, K]).astype("float32")
        dy = rs.standard_normal([M, N]).astype("float32")
        dw = rs.standard_normal([K, N]).astype("float32")
        db = rs.standard_normal([N]).astype("float32")
        w0, b0 = dw.astype("f8"), db.astype("f8")
        for _ in range(3):
            core.cpu(x.ctypes.data, dy.ctypes.data, "float32", M, K, N, dw.ctypes.data, "float32",
                     1.0, db.ctypes.data, "float32", 1.0)
        ref_w = w0 + 3 * x.astype("f8").T @ dy.astype("f8")
        ref_b = b0 + 3 * dy.astype("f8").sum(0)
        bw = error_bound(3 * np.abs(x.astype("f8")).T @ np.abs(dy.astype("f8")), np.abs(w0),
                         max(M, 1), "float32", "float32")
        bb = error_bound(3 * np.abs(dy.astype("f8")).sum(0), np.abs(b0), max(M, 1), "float32",
                         "float32")
        okw, rw, _ = check_result(dw, ref_w, bw)
        okb, rb, _ = check_result(db, ref_b, bb)
        results.append({"shape": [M, K, N], "ok": okw and okb, "err/bound": max(rw, rb)})
    return results


# ----------------------------------------------------------------------- GPU part
class _CpuEvent:
    """Stand-in for torch.cuda.Event in --simulate-cpu runs."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def gpu_main(args):
    import numpy as np
    import torch

    sim = args.simulate_cpu
    dev = torch.device("cpu" if sim else "cuda")
    if sim:  # exercise this function's logic with the CPU core and CPU torch
        report = {"device": "cpu (simulation)", "torch": torch.__version__, "cuda": None,
                  "date": time.strftime("%Y-%m-%d"), "checks": [], "bench": []}
        core = Core(build(args.build_dir or os.path.join(args.out, "build"), cuda=False), cuda=False)
        stream, sync, Event = None, (lambda: None), _CpuEvent
    else:
        props = torch.cuda.get_device_properties(dev)
        report = {"device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
                  "date": time.strftime("%Y-%m-%d"), "checks": [], "bench": []}
        core = Core(build(args.build_dir or os.path.join(args.out, "build")), cuda=True)
        stream, sync = torch.cuda.current_stream().cuda_stream, torch.cuda.synchronize
        Event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}
    gen = torch.Generator(device=dev).manual_seed(1234)

    def run(x, dy, dw, db, dw_beta, db_beta, in_dtype):
        M, K = x.shape
        N = dy.shape[1]
        call = (x.data_ptr(), dy.data_ptr(), in_dtype, M, K, N,
                dw.data_ptr(), str(dw.dtype).split(".")[-1], dw_beta,
                db.data_ptr() if db is not None else None,
                str(db.dtype).split(".")[-1] if db is not None else "float32", db_beta)
        if sim:
            core.cpu(*call)
        else:
            core.gpu(stream, dev.index or 0, *call)

    # ---- correctness
    for (M, K, N) in (CHECK_SHAPES[: (3 if args.quick else None)] if not sim else CHECK_SHAPES[1::2]):
        for in_dtype in ("bfloat16", "float16", "float32", "float64"):
            # accumulator: fp32 master gradient, fp64 for fp64 inputs (MPTypeTrait<double>)
            out = "float64" if in_dtype == "float64" else "float32"
            for with_bias in (True, False):
                x = torch.randn(M, K, device=dev, generator=gen, dtype=torch.float64).to(tdt[in_dtype])
                dy = torch.randn(M, N, device=dev, generator=gen, dtype=torch.float64).to(tdt[in_dtype])
                x64, dy64 = x.double(), dy.double()
                prod, absprod = x64.T @ dy64, x64.abs().T @ dy64.abs()
                # fresh accumulator (beta = 0) poisoned with NaN
                dw = torch.full((K, N), float("nan"), device=dev, dtype=tdt[out])
                db = torch.full((N,), float("nan"), device=dev, dtype=tdt[out]) if with_bias else None
                run(x, dy, dw, db, 0.0, 0.0, in_dtype)
                # then accumulate three times in place (beta = 1)
                start = dw.double().clone()
                ptr = dw.data_ptr()
                for _ in range(3):
                    run(x, dy, dw, db, 1.0, 1.0, in_dtype)
                sync()
                assert dw.data_ptr() == ptr
                want = (start + 3 * prod).cpu().numpy()
                bound = error_bound(3 * absprod.cpu().numpy(), np.abs(start.cpu().numpy()), M,
                                    out, in_dtype) + error_bound(
                    absprod.cpu().numpy(), 0, M, out, in_dtype)
                ok, ratio, rel = check_result(dw.double().cpu().numpy(), want, bound)
                entry = {"shape": [M, K, N], "in": in_dtype, "out": out, "bias": with_bias,
                         "ok": ok, "err/bound": ratio, "rel_err": rel}
                if with_bias:
                    wb = (4 * dy64.sum(0)).cpu().numpy()
                    bb = error_bound(4 * dy64.abs().sum(0).cpu().numpy(), 0, M, out, in_dtype)
                    okb, rb, relb = check_result(db.double().cpu().numpy(), wb, bb)
                    entry.update(ok=ok and okb, bias_err_bound=rb, bias_rel_err=relb)
                report["checks"].append(entry)
                # same-precision output (multi_precision=False): bf16/fp16 C
                if in_dtype not in ("float32", "float64"):
                    dwl = torch.full((K, N), float("nan"), device=dev).to(tdt[in_dtype])
                    run(x, dy, dwl, None, 0.0, 0.0, in_dtype)
                    sync()
                    okl, rl, rell = check_result(dwl.double().cpu().numpy(), prod.cpu().numpy(),
                                                 error_bound(absprod.cpu().numpy(), 0, M, in_dtype,
                                                             in_dtype))
                    report["checks"].append({"shape": [M, K, N], "in": in_dtype, "out": in_dtype,
                                             "bias": False, "ok": okl, "err/bound": rl,
                                             "rel_err": rell})
                print(f"check {M}x{K}x{N} {in_dtype} bias={with_bias}: "
                      f"{'ok' if entry['ok'] else 'FAIL'} (err/bound {ratio:.3f})", flush=True)
                x = dy = dw = db = None
    if not sim:
        torch.cuda.empty_cache()

    # ---- timing
    def time_fn(fn):
        for _ in range(3):
            fn()
        sync()
        ts = []
        for _ in range(args.repeat):
            a, b = Event(), Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    for (T, K, N) in args.bench_shapes:
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
        mg = torch.zeros(K, N, device=dev, dtype=torch.float32)
        flop = 2.0 * T * K * N
        t_ours = time_fn(lambda: run(x, dy, mg, None, 1.0, 1.0, "bfloat16"))
        t_gemm = time_fn(lambda: torch.matmul(x.T, dy))
        t_unf = time_fn(lambda: mg.add_(torch.matmul(x.T, dy).float()))
        db = torch.zeros(N, device=dev)
        t_bias = time_fn(lambda: run(x, dy, mg, db, 1.0, 1.0, "bfloat16"))
        row = {"shape": [T, K, N], "ours_ms": t_ours, "ours_with_bias_ms": t_bias,
               "bf16_gemm_ms": t_gemm, "unfused_ms": t_unf,
               "ours_tflops": flop / t_ours / 1e9, "ours_vs_gemm": t_ours / t_gemm,
               "unfused_vs_ours": t_unf / t_ours}
        report["bench"].append(row)
        print(f"bench {T}x{K}x{N}: ours {t_ours:.3f} ms, gemm {t_gemm:.3f} ms, "
              f"unfused {t_unf:.3f} ms", flush=True)
        x = dy = mg = db = None
        if not sim:
            torch.cuda.empty_cache()
    return report


def print_table(report):
    print()
    print(f"device: {report.get('device')}  torch {report.get('torch')}  CUDA {report.get('cuda')}  "
          f"{report.get('date')}")
    checks = report.get("checks", [])
    bad = [c for c in checks if not c["ok"]]
    print(f"correctness: {len(checks) - len(bad)}/{len(checks)} cases within bound; "
          f"worst err/bound {max((c['err/bound'] for c in checks), default=0):.3f}")
    if report.get("bench"):
        print(f"{'T x K x N':>18s} {'ours ms':>8s} {'+bias ms':>9s} {'bf16 gemm':>10s} "
              f"{'unfused':>8s} {'TFLOP/s':>8s} {'ours/gemm':>10s} {'unfused/ours':>13s}")
        for r in report["bench"]:
            print(f"{'x'.join(map(str, r['shape'])):>18s} {r['ours_ms']:8.3f} "
                  f"{r['ours_with_bias_ms']:9.3f} {r['bf16_gemm_ms']:10.3f} {r['unfused_ms']:8.3f} "
                  f"{r['ours_tflops']:8.1f} {r['ours_vs_gemm']:10.3f} {r['unfused_vs_ours']:13.3f}")


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.compile_only:
        compile_only(args.build_dir or os.path.join(args.out, "build"))
        if args.paddle_include:
            import sysconfig

            check_paddle_binding(args.paddle_include, sysconfig.get_paths()["include"])
        return 0
    if args.cpu_core:
        core = Core(build(args.build_dir or os.path.join(args.out, "build"), cuda=False), cuda=False)
        res = check_cpu_core(core)
        report = {"cpu_core": res, "backend": core.lib.pmg_cpu_gemm_backend().decode()}
        print(json.dumps(report))
        ok = all(r["ok"] for r in res)
    else:
        report = gpu_main(args)
        ok = all(c["ok"] for c in report["checks"])
        print_table(report)
    with open(os.path.join(args.out, "gpu_wgrad.json" if not args.cpu_core else "cpu_core.json"),
              "w") as f:
        json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
