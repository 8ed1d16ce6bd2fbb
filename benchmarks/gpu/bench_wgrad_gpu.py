"""Check and time the CUDA weight-gradient core on a machine with CUDA + torch and no Paddle.

    python benchmarks/gpu/bench_wgrad_gpu.py                 # every check + timing, < 5 min, one GPU
    python benchmarks/gpu/bench_wgrad_gpu.py --quick         # fewer shapes and repeats
    python benchmarks/gpu/bench_wgrad_gpu.py --compile-only  # nvcc-compile + link, no GPU (CI)
    python benchmarks/gpu/bench_wgrad_gpu.py --simulate-cpu  # the checks' logic on the CPU core
    python benchmarks/gpu/bench_wgrad_gpu.py --cpu-core      # the Paddle-free CPU core (numpy only)

Everything goes through the C ABI of ``csrc/wgrad_capi.cc`` (ctypes), built here with nvcc from
the flags and toolkit discovery of ``paddle_mgrad/ops/build_config.py`` (what the Paddle build
uses), for sm_80/sm_90/compute_90 plus this GPU's capability.  Needs CUDA (nvcc, cuBLASLt),
torch and numpy; ``compute-sanitizer`` (the toolkit's) for the memcheck row.  One run checks,
each a row of the one table it prints (and JSON under ``$OUT`` or ``--out``):

  values     bf16/fp16/fp32/fp64 inputs x odd shapes x bias on/off: a fresh NaN-poisoned
             accumulator (beta = 0), then 3 in-place accumulations (same data_ptr), vs float64
  offsets    x, dy, main_grad and the bias gradient as views at +2/+4/+8/+16 bytes (those that
             are a multiple of the element size) in each dtype, 3 accumulations vs float64;
             the bytes around main_grad's view are untouched
  bias       the BGRADA epilogue, the kernel, and auto (which ran is reported) vs float64,
             accumulated over 3 calls; each path twice from the same start: bitwise equal
  streams    a non-default stream; two streams at once (interleaved, no sync in between)
  graph      CUDA-graph capture of the op, 3 replays (caller workspace, allocator, stream-ordered)
  fp64       float64 in/out through cuBLASLt's 64F compute (also in values/offsets)
  capability a simulated sm_70 with bias -> clear error, main_grad and bias untouched
  checks     too-small workspace, failing allocator, fp32 pointer at +2 bytes, refused epilogue,
             no device -> clear errors, nothing touched
  sanitizer  compute-sanitizer memcheck on small cases (views ending at their allocation's end)
  speed      ours vs a bare bf16 torch GEMM (target <= 1.05x); ours + bias vs ours
             (target <= 1.03x); median of --repeat runs, CUDA events, same process
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import json
import os
import re
import shutil
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
ELEM = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
BIAS_MODE = {"auto": 0, "epilogue": 1, "kernel": 2}
# (tokens, K, N): llama-7B/13B-like projections (the README's four shapes)
BENCH_SHAPES = [(8192, 4096, 4096), (8192, 4096, 11008), (16384, 4096, 14336),
                (16384, 14336, 4096)]
CHECK_SHAPES = [(4095, 1023, 517), (257, 64, 96), (8192, 4096, 4096), (3, 5, 7)]
OFFSET_SHAPES = [(1000, 520, 264), (333, 130, 66)]
OFFSETS = (2, 4, 8, 16)
TARGET_VS_GEMM = 1.05   # ours / bare bf16 GEMM
TARGET_BIAS = 1.03      # ours with bias / ours
ITEMS = ["build", "values", "offsets", "bias", "streams", "graph", "fp64", "capability", "checks",
         "sanitizer", "speed"]
NVCC_ARCH = bc.NVCC_ARCH


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--compile-only", action="store_true",
                    help="nvcc-compile the CUDA core and C API, link and load (no GPU needed; CI)")
    ap.add_argument("--simulate-cpu", action="store_true",
                    help="run the GPU checks' logic on the CPU core with CPU torch (tiny shapes)")
    ap.add_argument("--paddle-include", default=None,
                    help="with --compile-only: also syntax-check the Paddle binding's CUDA branch")
    ap.add_argument("--cpu-core", action="store_true",
                    help="build/check the CPU core only (no CUDA, no torch needed)")
    ap.add_argument("--repeat", type=int, default=None, help="timed runs per case (median)")
    ap.add_argument("--shapes", default=None, help="benchmark shapes T:K:N,T:K:N")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    ap.add_argument("--build-dir", default=None)
    ap.add_argument("--no-sanitizer", action="store_true", help="skip the compute-sanitizer row")
    ap.add_argument("--budget", type=float, default=285.0,
                    help="seconds for the whole run; the sanitizer gets what is left (>= 60)")
    # internal: the child that compute-sanitizer runs
    ap.add_argument("--sanitize-case", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lib", default=None, help=argparse.SUPPRESS)
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


def offset_cases(dtypes=("bfloat16", "float16", "float32", "float64"), offsets=OFFSETS):
    """(in_dtype, offset, which tensors get it) for the offset-view checks: a view can only start
    at a multiple of its element size, so +2 applies to bf16/fp16 inputs only, and main_grad
    (fp32, or fp64 for fp64 inputs) and the bias gradient take the offsets that fit them."""
    out = []
    for dt in dtypes:
        acc = "float64" if dt == "float64" else "float32"
        for off in offsets:
            moved = [n for n, t in (("x", dt), ("dy", dt), ("main_grad", acc), ("bias", acc))
                     if off % ELEM[t] == 0]
            if moved:
                out.append((dt, off, moved))
    return out


def sanitizer_summary(text):
    """(errors, ok) from compute-sanitizer's output: 'ERROR SUMMARY: N errors'."""
    m = re.findall(r"ERROR SUMMARY:\s*(\d+)\s+error", text or "")
    if not m:
        return None, False
    n = int(m[-1])
    return n, n == 0


def speed_verdict(row):
    """The two speed targets of one benchmark row: (vs_gemm_ok, bias_ok)."""
    return row["ours_vs_gemm"] <= TARGET_VS_GEMM, row["bias_vs_ours"] <= TARGET_BIAS


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
    cmd = ["g++", "-fsyntax-only", "-Wall", *bc.CXX_FLAGS[1:2], "-DPADDLE_WITH_CUDA", bc.CUDA_DEFINE,
           *[f"-I{d}" for d in incs if os.path.isdir(d)], os.path.join(CSRC, "wgrad_op.cc")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(" ".join(cmd), "\n", r.stdout, r.stderr[-6000:])
        raise RuntimeError("the Paddle binding's CUDA branch does not compile")
    print("checked wgrad_op.cc (CUDA branch) against", paddle_include, flush=True)


def compile_only(build_dir):
    """Compile (no link) the CUDA core and the C API with the shipped flags, then link the whole
    library as the GPU run does, load it and call its CUDA entry point with empty shapes: without
    a GPU it must fail cleanly, naming the call."""
    os.makedirs(build_dir, exist_ok=True)
    tk = _require(toolkit())
    print(f"toolkit: {tk.summary()}", flush=True)
    incs = [f"-I{d}" for d in tk.include_dirs]
    for src in bc.CUDA_SOURCES + bc.CAPI_SOURCES + bc.CORE_SOURCES:
        cmd = [tk.nvcc, "-c", "-x", "cu" if src.endswith(".cu") else "c++", *bc.NVCC_FLAGS,
               "-Xcompiler", "-fPIC,-Wall,-fopenmp", f"-I{CSRC}", *incs,
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
        core = Core(build(build_dir, cuda=True), cuda=True)
        print(f"linked and loaded; targets {core.targets()}", flush=True)
        try:
            core.gpu_ex(None, None, "bfloat16", 0, 0, 0, None, "float32", 1.0, None, "float32", 1.0,
                        device=0, stream=None)
            print("CUDA call without a GPU returned success (a GPU is present?)", flush=True)
        except CoreError as e:
            print(f"CUDA call without a GPU failed cleanly: {e}", flush=True)
            if "cuda" not in str(e).lower():
                raise RuntimeError(f"unexpected error text from the CUDA core: {e}") from e


def build(build_dir, cuda=True, targets=None):
    """Build the C ABI library: CPU core + decisions + C API (g++), or with the CUDA core (nvcc,
    ``targets`` default: build_config's)."""
    os.makedirs(build_dir, exist_ok=True)
    out = os.path.join(build_dir, "libpmg_wgrad_cuda.so" if cuda else "libpmg_wgrad_cpu.so")
    srcs = [os.path.join(CSRC, f) for f in bc.CORE_SOURCES + bc.CAPI_SOURCES]
    if not cuda:
        cmd = ["g++", *bc.CXX_FLAGS, "-fPIC", "-shared", f"-I{CSRC}", *srcs, "-o", out]
    else:
        tk = _require(toolkit())
        flags = bc.nvcc_flags(tuple(targets)) if targets else bc.NVCC_FLAGS
        # the CXX flags go to the host compiler (-fopenmp etc.); cudart is linked statically by
        # nvcc; cuBLASLt by file name when only libcublasLt.so.<major> exists (wheels), + rpath
        # --threads=0: nvcc compiles the targets in parallel (the build is most of a run's setup)
        cmd = [tk.nvcc, *flags, "--threads=0", "-shared", "-Xcompiler", ",".join(["-fPIC"] + bc.CXX_FLAGS[2:]),
               f"-I{CSRC}", *[f"-I{d}" for d in tk.include_dirs],
               *[os.path.join(CSRC, f) for f in bc.CUDA_SOURCES], *srcs, *tk.nvcc_link_args(),
               "-lgomp", "-o", out]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("build failed:\n" + " ".join(cmd) + "\n" + r.stdout + r.stderr)
    print(f"built {out} in {time.time() - t0:.1f} s", flush=True)
    return out


class CoreError(RuntimeError):
    """A call of the C ABI failed; ``info`` says what the CUDA core did (or '')."""

    def __init__(self, msg, info=""):
        super().__init__(msg)
        self.info = info


ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class Core:
    """ctypes wrapper of csrc/wgrad_capi.cc."""

    def __init__(self, path, cuda=True):
        self.path = path
        self.lib = lib = ctypes.CDLL(path)
        i64, vp, f32, i32, cp = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_char_p
        common = [vp, vp, i32, i64, i64, i64, vp, i32, f32, vp, i32, f32]
        lib.pmg_wgrad_cpu_c.argtypes = common + [cp, i32]
        lib.pmg_wgrad_cpu_c.restype = i32
        lib.pmg_cpu_gemm_backend.restype = cp
        lib.pmg_has_cuda.restype = i32
        lib.pmg_pointer_alignment.argtypes = [ctypes.c_size_t]
        lib.pmg_pointer_alignment.restype = ctypes.c_uint32
        lib.pmg_targets_cover.argtypes = [cp, i32]
        lib.pmg_parse_bias_mode.argtypes = [cp, cp, i32]
        lib.pmg_choose_bias.argtypes = [i32, i64, i64, i64, i32, i32, i32, i32, i32, cp, i32]
        lib.pmg_plan_workspace.argtypes = [i32, i64, i64, i64, i32, ctypes.c_uint64, i32,
                                           ctypes.POINTER(i64)]
        lib.pmg_plan_workspace.restype = None
        lib.pmg_check_element_alignment.argtypes = [vp, vp, i32, i64, i64, i64, vp, i32, vp, i32, cp,
                                                    i32]
        lib.pmg_check_places.argtypes = [ctypes.POINTER(i32), ctypes.POINTER(i32), i32, cp, i32]
        lib.pmg_fake_gpu_flow.argtypes = [ctypes.POINTER(i32), ctypes.POINTER(i32), i32, i32, i32,
                                          i32, cp, i32, i32, cp, i32, cp, i32]
        self.cuda = cuda
        if cuda:
            lib.pmg_wgrad_cuda_c.argtypes = common + [vp, i32, cp, i32]
            lib.pmg_wgrad_cuda_c.restype = i32
            lib.pmg_wgrad_cuda_ex.argtypes = common + [i32, vp, vp, ctypes.c_size_t, ALLOC_FN, vp,
                                                       i32, i32, cp, i32, cp, i32]
            lib.pmg_wgrad_cuda_ex.restype = i32
            lib.pmg_cuda_targets.restype = cp
            lib.pmg_cuda_stats.argtypes = [cp, i32]
            lib.pmg_cuda_stats.restype = None

    @staticmethod
    def _args(x, dy, in_dtype, M, K, N, dw, dw_dtype, dw_beta, db, db_dtype, db_beta):
        return (x, dy, DTYPE_CODE[in_dtype], M, K, N, dw, DTYPE_CODE[dw_dtype], dw_beta, db,
                DTYPE_CODE[db_dtype], db_beta)

    def cpu(self, *a):
        err = ctypes.create_string_buffer(2048)
        if self.lib.pmg_wgrad_cpu_c(*self._args(*a), err, len(err)) != 0:
            raise CoreError(err.value.decode())
        return "cpu"

    def gpu(self, stream, device, *a):
        """The short entry point (auto bias path, stream-ordered scratch)."""
        err = ctypes.create_string_buffer(2048)
        if self.lib.pmg_wgrad_cuda_c(*self._args(*a), stream, device, err, len(err)) != 0:
            raise CoreError(err.value.decode())

    def gpu_ex(self, *a, device, stream, workspace=None, workspace_bytes=0, alloc=None,
               bias_mode="auto", sim=0):
        """The full entry point; returns the core's one-line report.  ``alloc``: a Python
        callable bytes -> device pointer (int) or 0."""
        err = ctypes.create_string_buffer(2048)
        info = ctypes.create_string_buffer(512)
        cb = ALLOC_FN(lambda n, _u: alloc(n) or None) if alloc else ALLOC_FN()
        rc = self.lib.pmg_wgrad_cuda_ex(*self._args(*a), device, stream, workspace,
                                        workspace_bytes, cb, None, BIAS_MODE[bias_mode], sim, info,
                                        len(info), err, len(err))
        if rc != 0:
            raise CoreError(err.value.decode(), info.value.decode())
        return info.value.decode()

    def targets(self):
        return self.lib.pmg_cuda_targets().decode() if self.cuda else ""

    def stats(self):
        buf = ctypes.create_string_buffer(1024)
        self.lib.pmg_cuda_stats(buf, len(buf))
        return buf.value.decode()


def info_field(info, key):
    """A field of the core's report line, e.g. info_field('cap=90 bias=epilogue ...', 'bias')."""
    m = re.search(rf"\b{key}=(\S+)", info or "")
    return m.group(1) if m else None


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

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class Bench:
    """The checks of one run.  On a GPU every call goes to the CUDA core; with --simulate-cpu the
    same code runs on the CPU core with CPU torch, and the rows that need a GPU say so."""

    def __init__(self, args, torch, core, sim, report):
        import numpy as np

        self.np, self.torch, self.core, self.sim, self.args, self.report = np, torch, core, sim, args, report
        self.dev = torch.device("cpu" if sim else "cuda")
        self.device = 0 if sim else (self.dev.index or torch.cuda.current_device())
        self.tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "float16": torch.float16, "float64": torch.float64}
        self.gen = torch.Generator(device=self.dev).manual_seed(1234)
        self.sync = (lambda: None) if sim else torch.cuda.synchronize
        self.keep = []  # allocator-callback tensors, alive until the next sync point

    # ---- helpers
    def randn(self, shape, dtype):
        t = self.torch.randn(*shape, device=self.dev, generator=self.gen, dtype=self.torch.float64)
        return t.to(self.tdt[dtype])

    def stream_ptr(self, stream=None):
        if self.sim:
            return None
        return (stream or self.torch.cuda.current_stream()).cuda_stream

    def call(self, x, dy, dw, db, dw_beta, db_beta, in_dtype, stream=None, **ex):
        """One call of the core on torch tensors (or raw pointers: int); returns its report."""
        def ptr(t):
            return t if isinstance(t, int) or t is None else t.data_ptr()

        def dt(t, default):
            return default if t is None or isinstance(t, int) else str(t.dtype).split(".")[-1]

        M, K = ex.pop("shape", None) or (x.shape[0], x.shape[1])
        N = ex.pop("n", None) or dy.shape[1]
        acc = "float64" if in_dtype == "float64" else "float32"
        a = (ptr(x), ptr(dy), in_dtype, M, K, N, ptr(dw), dt(dw, acc), dw_beta, ptr(db),
             dt(db, acc), db_beta)
        if self.sim:
            return self.core.cpu(*a)
        return self.core.gpu_ex(*a, device=ex.pop("device", self.device),
                                stream=self.stream_ptr(stream), **ex)

    def torch_alloc(self, stream=None):
        """An allocator callback backed by torch's caching allocator (as Paddle's for the op)."""
        def alloc(n):
            if stream is not None:
                with self.torch.cuda.stream(stream):
                    t = self.torch.empty(int(n), dtype=self.torch.uint8, device=self.dev)
            else:
                t = self.torch.empty(int(n), dtype=self.torch.uint8, device=self.dev)
            self.keep.append(t)
            return t.data_ptr()
        return alloc

    def reference(self, x, dy):
        x64, dy64 = x.double(), dy.double()
        return (x64.T @ dy64, x64.abs().T @ dy64.abs(), dy64.sum(0), dy64.abs().sum(0))

    def compare(self, got, want, absval, start, M, out, in_dtype, calls):
        """got vs start + calls * want, with the bound of `calls` accumulations."""
        np = self.np
        s = start.double().cpu().numpy()
        bound = error_bound(calls * absval.cpu().numpy(), np.abs(s), M, out, in_dtype) + \
            error_bound(absval.cpu().numpy(), 0, M, out, in_dtype)
        return check_result(got.double().cpu().numpy(), s + calls * want.cpu().numpy(), bound)

    def same_bytes(self, a, b):
        t = self.torch
        return bool(t.equal(a.contiguous().view(t.uint8), b.contiguous().view(t.uint8)))

    def add(self, item, case, ok, detail="", **extra):
        row = {"item": item, "case": case, "ok": bool(ok), "detail": detail, **extra}
        self.report["checks"].append(row)
        print(f"{item:10s} {case:44s} {'ok' if ok else 'FAIL'}  {detail}", flush=True)
        return row

    def skip(self, item, why):
        self.report["checks"].append({"item": item, "case": "-", "ok": None, "detail": why})
        print(f"{item:10s} {'-':44s} n/a  {why}", flush=True)

    def accumulate(self, in_dtype, shape, bias, x=None, dy=None, mg=None, db=None, calls=3,
                   **ex):
        """`calls` in-place accumulations from random starting accumulators; checks data_ptr and
        values vs float64.  Returns (ok, detail, infos)."""
        M, K, N = shape
        acc = "float64" if in_dtype == "float64" else "float32"
        x = self.randn((M, K), in_dtype) if x is None else x
        dy = self.randn((M, N), in_dtype) if dy is None else dy
        mg = self.randn((K, N), acc) if mg is None else mg
        if bias and db is None:
            db = self.randn((N,), acc)
        w0, b0 = mg.clone(), (db.clone() if bias else None)
        prod, absprod, colsum, abscolsum = self.reference(x, dy)
        ptr = mg.data_ptr()
        infos = [self.call(x, dy, mg, db if bias else None, 1.0, 1.0, in_dtype, **dict(ex))
                 for _ in range(calls)]
        self.sync()
        self.keep.clear()
        ok, ratio, _ = self.compare(mg, prod, absprod, w0, M, acc, in_dtype, calls)
        ok = ok and mg.data_ptr() == ptr
        detail = f"err/bound {ratio:.3f}"
        if bias:
            okb, rb, _ = self.compare(db, colsum, abscolsum, b0, M, acc, in_dtype, calls)
            ok, detail = ok and okb, detail + f", bias err/bound {rb:.3f}"
        return ok, detail, infos

    # ---- items
    def values(self):
        args, torch = self.args, self.torch
        shapes = CHECK_SHAPES[1::2] if self.sim else CHECK_SHAPES[: (3 if args.quick else None)]
        for (M, K, N) in shapes:
            for in_dtype in ("bfloat16", "float16", "float32", "float64"):
                out = "float64" if in_dtype == "float64" else "float32"
                for with_bias in (True, False):
                    x, dy = self.randn((M, K), in_dtype), self.randn((M, N), in_dtype)
                    prod, absprod, colsum, abscolsum = self.reference(x, dy)
                    # fresh accumulator (beta = 0) poisoned with NaN, then 3 accumulations
                    dw = torch.full((K, N), float("nan"), device=self.dev, dtype=self.tdt[out])
                    db = torch.full((N,), float("nan"), device=self.dev,
                                    dtype=self.tdt[out]) if with_bias else None
                    info = self.call(x, dy, dw, db, 0.0, 0.0, in_dtype)
                    start = dw.double().clone()
                    ptr = dw.data_ptr()
                    for _ in range(3):
                        self.call(x, dy, dw, db, 1.0, 1.0, in_dtype)
                    self.sync()
                    ok, ratio, _ = self.compare(dw, prod, absprod, start, M, out, in_dtype, 3)
                    ok = ok and dw.data_ptr() == ptr
                    detail = f"err/bound {ratio:.3f}"
                    if with_bias:
                        zero = torch.zeros_like(colsum)
                        okb, rb, _ = self.compare(db, colsum, abscolsum, zero, M, out, in_dtype, 4)
                        ok, detail = ok and okb, detail + f", bias {rb:.3f} via {info_field(info, 'bias') or info}"
                    item = "fp64" if in_dtype == "float64" else "values"
                    self.add(item, f"{in_dtype} {M}x{K}x{N} bias={with_bias}", ok, detail)
                    if in_dtype in ("bfloat16", "float16"):  # same-precision C (multi_precision=False)
                        dwl = torch.full((K, N), float("nan"), device=self.dev).to(self.tdt[in_dtype])
                        self.call(x, dy, dwl, None, 0.0, 0.0, in_dtype)
                        self.sync()
                        okl, rl, _ = check_result(dwl.double().cpu().numpy(), prod.cpu().numpy(),
                                                  error_bound(absprod.cpu().numpy(), 0, M, in_dtype,
                                                              in_dtype))
                        self.add("values", f"{in_dtype} {M}x{K}x{N} -> {in_dtype} dW", okl,
                                 f"err/bound {rl:.3f}")

    def offset_view(self, shape, dtype, off, fill=None, tail=64):
        """A contiguous view of `shape` starting `off` bytes into a fresh byte buffer (`tail`
        spare bytes after it; 0 for views that end at the allocation's end)."""
        torch = self.torch
        n = 1
        for s in shape:
            n *= s
        es = ELEM[dtype]
        buf = torch.empty(off + n * es + tail, dtype=torch.uint8, device=self.dev)
        buf.fill_(0x5A)
        v = buf[off: off + n * es].view(self.tdt[dtype]).view(*shape)
        if fill is not None:
            v.copy_(fill)
        return buf, v

    def offsets(self):
        shapes = OFFSET_SHAPES[1:] if self.sim else OFFSET_SHAPES
        for (in_dtype, off, moved) in offset_cases():
            for (M, K, N) in shapes:
                acc = "float64" if in_dtype == "float64" else "float32"
                bufs = {}

                def make(name, shape, dtype, off=off, moved=moved, bufs=bufs):
                    o = off if name in moved else 0
                    buf, v = self.offset_view(shape, dtype, o, self.randn(shape, dtype))
                    bufs[name] = (buf, o, v)
                    return v
                x = make("x", (M, K), in_dtype)
                dy = make("dy", (M, N), in_dtype)
                mg = make("main_grad", (K, N), acc)
                db = make("bias", (N,), acc)
                mg_buf, mg_off, _ = bufs["main_grad"]
                around = self.torch.cat([mg_buf[:mg_off], mg_buf[mg_off + K * N * ELEM[acc]:]]).clone()
                try:
                    ok, detail, infos = self.accumulate(in_dtype, (M, K, N), True, x=x, dy=dy, mg=mg,
                                                        db=db)
                except CoreError as e:
                    ok, detail, infos = False, f"error: {e}", []
                after = self.torch.cat([mg_buf[:mg_off], mg_buf[mg_off + K * N * ELEM[acc]:]])
                ok = ok and self.same_bytes(around, after)
                align = info_field(infos[0], "align") if infos and not self.sim else "cpu"
                bias = info_field(infos[0], "bias") if infos and not self.sim else "cpu"
                self.add("offsets", f"{in_dtype} +{off}B {'/'.join(moved)} {M}x{K}x{N}", ok,
                         f"{detail}; align {align}; bias via {bias}")

    def bias(self):
        M, K, N = (257, 64, 96) if self.sim else (4095, 1024, 520)
        for in_dtype in ("bfloat16", "float16", "float32"):
            x, dy = self.randn((M, K), in_dtype), self.randn((M, N), in_dtype)
            mg0, db0 = self.randn((K, N), "float32"), self.randn((N,), "float32")
            results = {}
            for mode in (("cpu",) if self.sim else ("auto", "epilogue", "kernel")):
                outs = []
                for _rep in range(2):  # twice from the same start: bitwise equal (deterministic)
                    mg, db = mg0.clone(), db0.clone()
                    try:
                        ex = {} if self.sim else {"bias_mode": mode}
                        ok, detail, infos = self.accumulate(in_dtype, (M, K, N), True, x=x, dy=dy,
                                                            mg=mg, db=db, **ex)
                    except CoreError as e:
                        ok, detail, infos = False, f"error: {e}", []
                    outs.append((ok, detail, infos, mg, db))
                (ok, detail, infos, mg, db), (_, _, _, mg2, db2) = outs
                det = self.same_bytes(mg, mg2) and self.same_bytes(db, db2)
                ran = info_field(infos[0], "bias") if infos and not self.sim else "cpu"
                why = re.search(r"bias=\S+ \(([^)]*)\)", infos[0]) if infos and not self.sim else None
                results[mode] = db
                want = {"epilogue": "epilogue", "kernel": "kernel"}.get(mode)
                path_ok = want is None or ran == want
                self.add("bias", f"{in_dtype} {M}x{K}x{N} mode={mode}",
                         ok and det and outs[1][0] and path_ok,
                         f"{detail}; ran {ran}{' (' + why.group(1) + ')' if why else ''}; "
                         f"repeat {'bitwise equal' if det else 'DIFFERS'}")
            if "epilogue" in results and "kernel" in results:
                d = float((results["epilogue"].double() - results["kernel"].double()).abs().max())
                self.report.setdefault("bias_epilogue_vs_kernel", {})[in_dtype] = d

    def streams(self):
        if self.sim:
            return self.skip("streams", "simulation: the CPU core has no streams")
        torch = self.torch
        s = torch.cuda.Stream()
        M, K, N = 2048, 1024, 768
        cur = torch.cuda.current_stream()
        for ws in ("stream-ordered", "allocator", "caller"):
            x, dy = self.randn((M, K), "bfloat16"), self.randn((M, N), "bfloat16")
            mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
            ex = {}
            if ws == "allocator":
                ex["alloc"] = self.torch_alloc(s)
            elif ws == "caller":
                wbuf = torch.empty(64 << 20, dtype=torch.uint8, device=self.dev)
                ex.update(workspace=wbuf.data_ptr(), workspace_bytes=wbuf.numel())
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                ok, detail, infos = self.accumulate("bfloat16", (M, K, N), True, x=x, dy=dy, mg=mg,
                                                    db=db, stream=s, **ex)
            cur.wait_stream(s)
            used = info_field(infos[0], "workspace") if infos else "?"
            self.add("streams", f"non-default stream, workspace {ws}", ok and ws in (used or ""),
                     f"{detail}; workspace {used}")
        # two streams at once, interleaved, no sync in between
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        for ws in ("stream-ordered", "caller"):
            probs = []
            for (M, K, N), dt in (((3000, 1024, 1536), "bfloat16"), ((1500, 2048, 512), "float16")):
                x, dy = self.randn((M, K), dt), self.randn((M, N), dt)
                mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
                probs.append(((M, K, N), dt, x, dy, mg, db, mg.clone(), db.clone()))
            wb = [torch.empty(64 << 20, dtype=torch.uint8, device=self.dev) for _ in range(2)]
            s1.wait_stream(cur)
            s2.wait_stream(cur)
            for _ in range(3):
                for i, st in enumerate((s1, s2)):
                    (_, dt, x, dy, mg, db, _, _) = probs[i]
                    ex = {} if ws == "stream-ordered" else {"workspace": wb[i].data_ptr(),
                                                            "workspace_bytes": wb[i].numel()}
                    with torch.cuda.stream(st):
                        self.call(x, dy, mg, db, 1.0, 1.0, dt, stream=st, **ex)
            cur.wait_stream(s1)
            cur.wait_stream(s2)
            self.sync()
            oks, details = [], []
            for ((M, _K, _N), dt, x, dy, mg, db, w0, b0) in probs:
                prod, absprod, colsum, abscolsum = self.reference(x, dy)
                okw, rw, _ = self.compare(mg, prod, absprod, w0, M, "float32", dt, 3)
                okb, rb, _ = self.compare(db, colsum, abscolsum, b0, M, "float32", dt, 3)
                oks.append(okw and okb)
                details.append(f"{dt} {rw:.3f}/{rb:.3f}")
            self.add("streams", f"two streams at once, workspace {ws}", all(oks),
                     "err/bound " + ", ".join(details))

    def graph(self):
        if self.sim:
            return self.skip("graph", "simulation: no CUDA graphs on the CPU")
        torch = self.torch
        M, K, N = 1024, 512, 384
        for ws in ("caller", "allocator", "stream-ordered"):
            x, dy = self.randn((M, K), "bfloat16"), self.randn((M, N), "bfloat16")
            mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
            w0, b0 = mg.clone(), db.clone()
            ex = {}
            if ws == "caller":
                wbuf = torch.empty(64 << 20, dtype=torch.uint8, device=self.dev)
                ex = {"workspace": wbuf.data_ptr(), "workspace_bytes": wbuf.numel()}
            elif ws == "allocator":
                ex = {"alloc": self.torch_alloc()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(side):  # warm-up: handle, algorithm, image checks cached
                    self.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", stream=side, **dict(ex))
                torch.cuda.current_stream().wait_stream(side)
                self.sync()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    info = self.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", **dict(ex))
                mg.copy_(w0)
                db.copy_(b0)
                for _ in range(3):
                    g.replay()
                self.sync()
                prod, absprod, colsum, abscolsum = self.reference(x, dy)
                okw, rw, _ = self.compare(mg, prod, absprod, w0, M, "float32", "bfloat16", 3)
                okb, rb, _ = self.compare(db, colsum, abscolsum, b0, M, "float32", "bfloat16", 3)
                self.add("graph", f"capture + 3 replays, workspace {ws}", okw and okb,
                         f"err/bound {rw:.3f}, bias {rb:.3f}; {info}")
            except Exception as e:  # noqa: BLE001  (a capture failure is this row's result)
                self.add("graph", f"capture + 3 replays, workspace {ws}", False,
                         f"{type(e).__name__}: {e}"[:300])
            self.keep.clear()

    def untouched_error(self, item, case, expect, fn, mg, db=None):
        """fn() must raise CoreError containing `expect`, leaving mg/db bitwise unchanged."""
        before = [t.clone() for t in (mg, db) if t is not None]
        try:
            fn()
            self.sync()
            ok, detail = False, "no error"
        except CoreError as e:
            self.sync()
            ok, detail = expect.lower() in str(e).lower(), str(e)[:160]
        after = [t for t in (mg, db) if t is not None]
        same = all(self.same_bytes(a, b) for a, b in zip(before, after))
        return self.add(item, case, ok and same,
                        ("untouched; " if same else "TOUCHED; ") + detail)

    def capability(self):
        M, K, N = 512, 256, 128
        x, dy = self.randn((M, K), "bfloat16"), self.randn((M, N), "bfloat16")
        mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
        if self.sim:  # the decision only (the plan function the core calls)
            lib = self.core.lib
            t = b"sm_80+sm_90+compute_90"
            ok = (not lib.pmg_targets_cover(t, 70) and lib.pmg_targets_cover(t, 90)
                  and lib.pmg_targets_cover(t, 100) and lib.pmg_targets_cover(t, 86))
            return self.add("capability", "targets_cover (decision only)", ok,
                            "simulation: sm_70 refused, sm_86/90/100 covered")
        for mode in ("auto", "kernel"):
            self.untouched_error(
                "capability", f"simulated sm_70, bias {mode}", "sm_70",
                lambda mode=mode: self.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", sim=70, bias_mode=mode),
                mg, db)
        try:  # without bias only cuBLASLt runs (its own kernels): no refusal
            ok, detail, _ = self.accumulate("bfloat16", (M, K, N), False, x=x, dy=dy, calls=1, sim=70)
        except CoreError as e:
            ok, detail = False, str(e)
        self.add("capability", "simulated sm_70, no bias (cuBLASLt only)", ok, detail)
        cap = self.torch.cuda.get_device_capability()
        try:
            ok, detail, _ = self.accumulate("bfloat16", (M, K, N), True, x=x, dy=dy, calls=1,
                                            sim=100)
        except CoreError as e:
            ok, detail = False, str(e)
        self.add("capability", "simulated sm_100 (compute_90 PTX covers it)", ok,
                 f"{detail}; real GPU sm_{cap[0]}{cap[1]}")

    def checks(self):
        torch = self.torch
        M, K, N = 256, 128, 64
        x, dy = self.randn((M, K), "float32"), self.randn((M, N), "float32")
        mg, db = self.randn((K, N), "float32"), self.randn((N,), "float32")
        if self.sim:
            err = ctypes.create_string_buffer(512)
            rc = self.core.lib.pmg_check_element_alignment(
                x.data_ptr() + 2, dy.data_ptr(), 0, M, K, N, mg.data_ptr(), 0, db.data_ptr(), 0,
                err, len(err))
            return self.add("checks", "fp32 x at +2 bytes (decision only)",
                            rc == 1 and b"element size" in err.value, err.value.decode()[:120])
        tiny = torch.empty(16, dtype=torch.uint8, device=self.dev)
        self.untouched_error("checks", "workspace too small, no allocator", "needed",
                             lambda: self.call(x, dy, mg, db, 1.0, 1.0, "float32",
                                               workspace=tiny.data_ptr(), workspace_bytes=16),
                             mg, db)
        self.untouched_error("checks", "allocator returns null", "could not allocate",
                             lambda: self.call(x, dy, mg, db, 1.0, 1.0, "float32",
                                               alloc=lambda n: 0), mg, db)
        self.untouched_error("checks", "fp32 x at +2 bytes", "element size",
                             lambda: self.call(x.data_ptr() + 2, dy, mg, db, 1.0, 1.0, "float32",
                                               shape=(M, K)), mg, db)
        mg16 = self.randn((K, N), "bfloat16")
        xb, dyb = x.to(torch.bfloat16), dy.to(torch.bfloat16)
        self.untouched_error("checks", "epilogue forced, bf16 dW (refused)", "cannot apply",
                             lambda: self.call(xb, dyb, mg16, db, 1.0, 1.0, "bfloat16",
                                               bias_mode="epilogue"), mg16, db)
        x64, dy64 = x.double(), dy.double()
        mg64, db64 = mg.double(), db.double()
        self.untouched_error("checks", "epilogue forced, fp64 (refused)", "float64",
                             lambda: self.call(x64, dy64, mg64, db64, 1.0, 1.0, "float64",
                                               bias_mode="epilogue"), mg64, db64)
        self.untouched_error("checks", "no device given", "device",
                             lambda: self.call(x, dy, mg, db, 1.0, 1.0, "float32", device=-1),
                             mg, db)

    def time_fn(self, fn, stream=None):
        """Median GPU time of fn (ms).  A short spin kernel before the first event keeps the GPU
        busy while the host enqueues the call, so the events time the GPU work, not our ctypes
        and descriptor overhead (both sides get the same treatment)."""
        Event = _CpuEvent if self.sim else (lambda: self.torch.cuda.Event(enable_timing=True))
        spin = getattr(self.torch.cuda, "_sleep", None) if not self.sim else None
        for _ in range(3):
            fn()
        self.sync()
        ts = []
        for _ in range(self.args.repeat):
            a, b = Event(), Event()
            if spin is not None:
                spin(1_000_000)  # ~0.5 ms of clock cycles
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    def speed(self):
        torch = self.torch
        wbuf = None if self.sim else torch.empty(64 << 20, dtype=torch.uint8, device=self.dev)
        ws = {} if self.sim else {"workspace": wbuf.data_ptr(), "workspace_bytes": wbuf.numel()}
        for (T, K, N) in self.args.bench_shapes:
            x = torch.randn(T, K, device=self.dev, dtype=torch.bfloat16)
            dy = torch.randn(T, N, device=self.dev, dtype=torch.bfloat16)
            mg = torch.zeros(K, N, device=self.dev, dtype=torch.float32)
            db = torch.zeros(N, device=self.dev)
            flop = 2.0 * T * K * N
            # each timed call binds this shape's tensors (partial, default arguments)
            call = functools.partial(self.call, x, dy, mg)
            t_gemm = self.time_fn(lambda x=x, dy=dy: torch.matmul(x.T, dy))
            t_ours = self.time_fn(functools.partial(call, None, 1.0, 1.0, "bfloat16", **ws))
            t_bias = self.time_fn(functools.partial(call, db, 1.0, 1.0, "bfloat16", **ws))
            info = self.call(x, dy, mg, db, 1.0, 1.0, "bfloat16", **ws)
            t_kern = t_bias if self.sim else self.time_fn(
                functools.partial(call, db, 1.0, 1.0, "bfloat16", bias_mode="kernel", **ws))
            t_unf = self.time_fn(lambda x=x, dy=dy, mg=mg: mg.add_(torch.matmul(x.T, dy).float()))
            row = {"shape": [T, K, N], "ours_ms": t_ours, "ours_with_bias_ms": t_bias,
                   "ours_bias_kernel_ms": t_kern, "bf16_gemm_ms": t_gemm, "unfused_ms": t_unf,
                   "ours_tflops": flop / t_ours / 1e9, "ours_vs_gemm": t_ours / t_gemm,
                   "bias_vs_ours": t_bias / t_ours, "bias_kernel_vs_ours": t_kern / t_ours,
                   "unfused_vs_ours": t_unf / t_ours,
                   "bias_path": "cpu" if self.sim else info_field(info, "bias")}
            g_ok, b_ok = speed_verdict(row)
            row["targets_met"] = g_ok and b_ok
            self.report["bench"].append(row)
            print(f"speed      {T}x{K}x{N}: ours {t_ours:.3f} ms, +bias {t_bias:.3f} "
                  f"({row['bias_path']}), +bias kernel {t_kern:.3f}, gemm {t_gemm:.3f}, "
                  f"unfused {t_unf:.3f}", flush=True)
            x = dy = mg = db = None
            if not self.sim:
                torch.cuda.empty_cache()


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
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "9", "--print-limit", "20",
           sys.executable, os.path.abspath(__file__), "--sanitize-case", "--lib", lib, "--out", out]
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60.0, budget_s), env=env)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"timed out after {e.timeout:.0f} s", -1
    with open(os.path.join(out, "sanitizer.log"), "w") as f:
        f.write(" ".join(cmd) + "\n" + text)
    n, clean = sanitizer_summary(text)
    cases = re.search(r"SANITIZE-CASES (\d+)/(\d+)", text)
    ok = rc == 0 and clean and cases is not None and cases.group(1) == cases.group(2)
    bench.add("sanitizer", "memcheck, small cases", ok,
              f"{n} errors, cases {cases.group(0) if cases else '?'}, rc {rc}, "
              f"{time.time() - t0:.0f} s" + ("" if ok else f"; {text[-300:]!r}"))


def sanitize_case(args):
    """Small cases under compute-sanitizer: every dtype, views that end at their allocation's
    end (offsets at the front), both bias paths, the three workspace sources, M = 0 and K = 0."""
    import torch

    core = Core(args.lib, cuda=True)
    report = {"checks": [], "bench": []}
    b = Bench(args, torch, core, False, report)
    n_ok = n = 0
    for in_dtype in ("bfloat16", "float16", "float32", "float64"):
        acc = "float64" if in_dtype == "float64" else "float32"
        for mode in ("auto", "kernel"):
            for (M, K, N), off in (((67, 40, 24), 2), ((130, 33, 17), 16), ((0, 8, 8), 0),
                                   ((9, 0, 8), 0)):
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


def gpu_main(args):
    import torch

    t_start = time.time()
    sim = args.simulate_cpu
    report = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "checks": [],
              "bench": [], "targets": {"ours_vs_gemm": TARGET_VS_GEMM, "bias_vs_ours": TARGET_BIAS}}
    build_dir = args.build_dir or os.path.join(args.out, "build")
    t0 = time.time()
    if sim:
        report.update(device="cpu (simulation)", cuda=None)
        core = Core(build(build_dir, cuda=False), cuda=False)
        targets = "cpu"
    else:
        props = torch.cuda.get_device_properties(0)
        cap = torch.cuda.get_device_capability(0)
        report.update(device=props.name, cuda=torch.version.cuda, capability=cap[0] * 10 + cap[1])
        tk = _require(toolkit())
        targets = bc.cuda_targets([cap[0] * 10 + cap[1]], tk.supported_codes())
        core = Core(build(build_dir, cuda=True, targets=targets), cuda=True)
        targets = core.targets()
    report["targets_built"] = targets
    bench = Bench(args, torch, core, sim, report)
    bench.add("build", f"targets {targets}", True, f"{time.time() - t0:.1f} s")
    for item in ("values", "offsets", "bias", "streams", "graph", "capability", "checks"):
        try:
            getattr(bench, item)()
        except Exception as e:  # noqa: BLE001  (one item's crash is its row, the rest still run)
            bench.add(item, "crashed", False, f"{type(e).__name__}: {e}"[:300])
    try:
        bench.speed()
    except Exception as e:  # noqa: BLE001
        bench.add("speed", "crashed", False, f"{type(e).__name__}: {e}"[:300])
    if sim:
        bench.skip("sanitizer", "simulation: compute-sanitizer needs a GPU")
    elif args.no_sanitizer:
        bench.skip("sanitizer", "--no-sanitizer")
    else:
        run_sanitizer(bench, core.path, args.budget - (time.time() - t_start))
    if not sim:
        report["core_stats"] = core.stats()
    report["seconds"] = round(time.time() - t_start, 1)
    return report


def table(report):
    """The one table: a row per item (cases ok/total, worst detail), then a row per speed shape."""
    lines = [f"device: {report.get('device')}  torch {report.get('torch')}  CUDA {report.get('cuda')}"
             f"  targets {report.get('targets_built')}  {report.get('date')}  "
             f"({report.get('seconds', '?')} s)",
             f"{'item':10s} {'result':8s} detail"]
    by = {}
    for c in report.get("checks", []):
        by.setdefault(c["item"], []).append(c)
    for item in ITEMS:
        rows = by.get(item, [])
        if item == "speed":
            continue
        if not rows:
            lines.append(f"{item:10s} {'-':8s} not run")
            continue
        ran = [r for r in rows if r["ok"] is not None]
        if not ran:
            lines.append(f"{item:10s} {'n/a':8s} {rows[0]['detail']}")
            continue
        good = sum(1 for r in ran if r["ok"])
        cases = sorted({r["case"] for r in ran})
        lines.append(f"{item:10s} {good:>3d}/{len(ran):<4d} "
                     + ("; ".join(cases)[:150] if len(cases) <= 3 else f"{len(ran)} cases"))
        for r in ran:
            if not r["ok"]:
                lines.append(f"{'':10s} FAIL     {r['case']}: {r['detail'][:200]}")
    bench = report.get("bench", [])
    crashed = [r for r in by.get("speed", []) if r["ok"] is False]
    if bench or crashed:
        lines.append(f"{'speed':10s} {'T x K x N':>18s} {'ours ms':>8s} {'+bias':>7s} {'bias via':>9s} "
                     f"{'+kernel':>8s} {'gemm':>7s} {'unfused':>8s} {'TFLOP/s':>8s} "
                     f"{'ours/gemm':>9s} {'bias/ours':>9s} targets")
        for r in bench:
            g_ok, b_ok = speed_verdict(r)
            lines.append(
                f"{'':10s} {'x'.join(map(str, r['shape'])):>18s} {r['ours_ms']:8.3f} "
                f"{r['ours_with_bias_ms']:7.3f} {str(r.get('bias_path')):>9s} "
                f"{r['ours_bias_kernel_ms']:8.3f} {r['bf16_gemm_ms']:7.3f} {r['unfused_ms']:8.3f} "
                f"{r['ours_tflops']:8.1f} {r['ours_vs_gemm']:9.3f} {r['bias_vs_ours']:9.3f} "
                f"{'met' if g_ok and b_ok else 'MISSED'} (<={TARGET_VS_GEMM}, <={TARGET_BIAS})")
        for r in crashed:
            lines.append(f"{'':10s} FAIL     {r['case']}: {r['detail'][:200]}")
    return "\n".join(lines)


def print_table(report):
    print()
    print(table(report))


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.sanitize_case:
        return sanitize_case(args)
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
        ok = all(c["ok"] is not False for c in report["checks"])
        print_table(report)
    with open(os.path.join(args.out, "gpu_wgrad.json" if not args.cpu_core else "cpu_core.json"),
              "w") as f:
        json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
