"""Check and time the CUDA weight-gradient core on a machine with CUDA + torch and no Paddle.

    python benchmarks/gpu/bench_wgrad_gpu.py                 # every check + timing, < 5 min, one GPU
    python benchmarks/gpu/bench_wgrad_gpu.py --quick         # fewer shapes and repeats
    python benchmarks/gpu/bench_wgrad_gpu.py --compile-only  # nvcc-compile + link, no GPU (CI)
    python benchmarks/gpu/bench_wgrad_gpu.py --simulate-cpu  # the checks' logic on the CPU core
    python benchmarks/gpu/bench_wgrad_gpu.py --cpu-core      # the Paddle-free CPU core (numpy only)

Everything goes through the C ABIs of ``csrc/wgrad_capi.cc`` and the test-only
``csrc/wgrad_capi_testing.cc`` (ctypes), built here with nvcc from
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
  bias-order the bias kernel's sums bitwise equal to the CPU reference of its order
             (csrc/wgrad_gpu_plan.cc) for this GPU's SM count: 16-byte and scalar loads, each dtype
  pressure   an allocator that refuses the first request: re-planned without cuBLASLt
             workspace (ws_retry=1), values vs float64
  sanitizer  compute-sanitizer memcheck on small cases (views ending at their allocation's end)
  speed      ours vs a bare bf16 torch GEMM (target <= 1.05x); ours + bias vs ours
             (target <= 1.03x); median of --repeat runs, CUDA events, same process; then the
             bias-path shapes (LoRA-narrow N, MoE-small M*N, large M; shapes.BIAS_PATH_SHAPES):
             auto / kernel / epilogue vs no bias and the bare GEMM, which path auto took and
             whether it was within 3 % of the faster one, the bias kernel's GB/s

The modules are in pmg_gpu_bench/ (build, capi, shapes, checks, timing, sanitizer, report).
"""

from __future__ import annotations

import argparse
import ctypes  # noqa: F401  (tests reach ctypes through this module)
import json
import os
import shutil  # noqa: F401  (tests patch shutil.which through this module)
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from pmg_gpu_bench import timing  # noqa: E402
from pmg_gpu_bench.build import (  # noqa: E402,F401
    CSRC,
    NVCC_ARCH,
    _require,
    bc,
    build,
    cached_cpu_library,
    check_paddle_binding,
    compile_only,
    cublas_lib_dirs,
    cuda_include_dirs,
    toolkit,
)
from pmg_gpu_bench.capi import (  # noqa: E402,F401
    ALLOC_FN,
    BIAS_MODE,
    DTYPE_CODE,
    ELEM,
    Core,
    CoreError,
    FakeGpuConfig,
    info_field,
)
from pmg_gpu_bench.checks import Bench, check_cpu_core  # noqa: E402
from pmg_gpu_bench.report import ITEMS, print_table, speed_verdict, table  # noqa: E402,F401
from pmg_gpu_bench.sanitizer import find_sanitizer, run_sanitizer, sanitize_case, sanitizer_summary  # noqa: E402,F401
from pmg_gpu_bench.shapes import (  # noqa: E402,F401
    BENCH_SHAPES,
    BIAS_PATH_SHAPES,
    CHECK_SHAPES,
    OFFSET_SHAPES,
    OFFSETS,
    TARGET_BIAS,
    TARGET_VS_GEMM,
    check_result,
    error_bound,
    offset_cases,
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="nvcc-compile the CUDA core and C API, link and load (no GPU needed; CI)",
    )
    ap.add_argument(
        "--simulate-cpu",
        action="store_true",
        help="run the GPU checks' logic on the CPU core with CPU torch (tiny shapes)",
    )
    ap.add_argument(
        "--paddle-include",
        default=None,
        help="with --compile-only: also syntax-check the Paddle binding's CUDA branch",
    )
    ap.add_argument(
        "--cpu-core",
        action="store_true",
        help="build/check the CPU core only (no CUDA, no torch needed)",
    )
    ap.add_argument("--repeat", type=int, default=None, help="timed runs per case (median)")
    ap.add_argument("--shapes", default=None, help="benchmark shapes T:K:N,T:K:N")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "results")))
    ap.add_argument("--build-dir", default=None)
    ap.add_argument("--no-sanitizer", action="store_true", help="skip the compute-sanitizer row")
    ap.add_argument(
        "--budget",
        type=float,
        default=285.0,
        help="seconds for the whole run; the sanitizer gets what is left (>= 60)",
    )
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


def gpu_main(args):
    import torch

    t_start = time.time()
    sim = args.simulate_cpu
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "checks": [],
        "bench": [],
        "targets": {"ours_vs_gemm": TARGET_VS_GEMM, "bias_vs_ours": TARGET_BIAS},
    }
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
    for item in (
        "values",
        "offsets",
        "bias",
        "streams",
        "graph",
        "capability",
        "checks",
        "bias_order",
        "pressure",
    ):
        try:
            getattr(bench, item)()
        except Exception as e:  # noqa: BLE001  (one item's crash is its row, the rest still run)
            bench.add(item, "crashed", False, f"{type(e).__name__}: {e}"[:300])
    for name in ("speed", "bias_paths"):
        try:
            getattr(timing, name)(bench)
        except Exception as e:  # noqa: BLE001
            bench.add("speed", f"{name} crashed", False, f"{type(e).__name__}: {e}"[:300])
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
        core = Core(
            build(args.build_dir or os.path.join(args.out, "build"), cuda=False), cuda=False
        )
        res = check_cpu_core(core)
        report = {"cpu_core": res, "backend": core.lib.pmg_cpu_gemm_backend().decode()}
        print(json.dumps(report))
        ok = all(r["ok"] for r in res)
    else:
        report = gpu_main(args)
        ok = all(c["ok"] is not False for c in report["checks"])
        print_table(report)
    with open(
        os.path.join(args.out, "gpu_wgrad.json" if not args.cpu_core else "cpu_core.json"), "w"
    ) as f:
        json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
