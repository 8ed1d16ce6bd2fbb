"""CPU-side parts of benchmarks/gpu/bench_wgrad_gpu.py: arguments, reference math, and the
Paddle-free core built with the script's own builder and driven through its ctypes API."""

import importlib.util
import json
import os

import numpy as np
import pytest

PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "bench_wgrad_gpu.py")
spec = importlib.util.spec_from_file_location("bench_wgrad_gpu", PATH)
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)


def test_parse_args_defaults_and_overrides():
    a = gpu.parse_args([])
    assert a.repeat == 30 and a.bench_shapes == gpu.BENCH_SHAPES
    assert all(
        8192 <= t <= 16384 and 4096 <= k <= 14336 and 4096 <= n <= 14336
        for t, k, n in a.bench_shapes
    )
    q = gpu.parse_args(["--quick"])
    assert q.repeat == 10 and len(q.bench_shapes) == 2
    s = gpu.parse_args(["--shapes", "16:8:4,32:4:2", "--repeat", "3", "--out", "/tmp/x"])
    assert s.bench_shapes == [(16, 8, 4), (32, 4, 2)] and s.repeat == 3 and s.out == "/tmp/x"
    assert any(k == 1023 for _, k, _ in gpu.CHECK_SHAPES)  # odd shapes are checked


def test_error_bound_orders_dtypes_and_scales():
    s = np.array([1.0, 10.0])
    f32 = gpu.error_bound(s, 0, 4096, "float32", "bfloat16")
    bf = gpu.error_bound(s, 0, 4096, "bfloat16", "bfloat16")
    fp16 = gpu.error_bound(s, 0, 4096, "float16", "float16")
    assert (f32 < fp16).all() and (fp16 < bf).all()
    assert np.allclose(f32[1] / f32[0], 10.0)
    assert (gpu.error_bound(s, 0, 8192, "float32", "float32") > f32).all()  # grows with k


def test_check_result_catches_nan_and_excess():
    want = np.array([1.0, 2.0])
    bound = np.array([1e-3, 1e-3])
    assert gpu.check_result(np.array([1.0005, 2.0]), want, bound)[0]
    assert not gpu.check_result(np.array([1.01, 2.0]), want, bound)[0]
    assert not gpu.check_result(np.array([np.nan, 2.0]), want, bound)[0]


def _file(path, text=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_include_and_lib_dir_search_finds_toolkit_then_wheels(tmp_path, monkeypatch):
    """A CUDA 13 toolkit without cuBLASLt (CUDA_HOME) and the nvidia-cublas wheel on sys.path:
    the script's include search returns the toolkit's include directory first, then the
    wheel's (and, when asked for thrust, CUDA 13's cccl directory last); the library search
    returns the wheel's lib directory."""
    home = tmp_path / "cuda-13.0"
    nvcc = _file(home / "bin" / "nvcc", "#!/bin/sh\n")
    nvcc.chmod(0o755)
    _file(home / "include" / "cuda_runtime_api.h", "#define CUDART_VERSION 13000\n")
    _file(home / "include" / "cuda_runtime.h")
    _file(home / "lib64" / "libcudart.so.13")
    _file(home / "include" / "cccl" / "thrust" / "complex.h")
    site = tmp_path / "site-packages"
    wheel = site / "nvidia" / "cu13"
    _file(wheel / "include" / "cublasLt.h")
    _file(wheel / "lib" / "libcublasLt.so.13")
    monkeypatch.setenv("CUDA_HOME", str(home))
    monkeypatch.syspath_prepend(str(site))

    # the script's default: find_cuda over this environment and sys.path
    assert gpu.cuda_include_dirs() == [str(home / "include"), str(wheel / "include")]
    assert gpu.cublas_lib_dirs() == [str(wheel / "lib")]
    tk = gpu.toolkit(need_thrust=True)
    assert tk.ok, tk.problem()
    assert gpu.cuda_include_dirs(tk) == [
        str(home / "include"),
        str(wheel / "include"),
        str(home / "include" / "cccl"),
    ]
    # without the wheel: no cuBLASLt directory, and only the toolkit's headers
    no_wheel = gpu.bc.find_cuda(search_paths=[], environ={"CUDA_HOME": str(home)})
    assert gpu.cublas_lib_dirs(no_wheel) == []
    assert gpu.cuda_include_dirs(no_wheel) == [str(home / "include")]


@pytest.mark.probe
def test_paddle_free_cpu_core_through_ctypes(tmp_path):
    rc = gpu.main(["--cpu-core", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "cpu_core.json").read_text())
    assert report["backend"] == "portable"
    assert [r["shape"] for r in report["cpu_core"]] == [[37, 19, 23], [600, 70, 530], [0, 4, 5]]
    assert all(r["ok"] for r in report["cpu_core"])


@pytest.fixture(scope="module")
def cpu_core_library(tmp_path_factory):
    """The Paddle-free CPU core built once with the script's builder, for the tests that only
    need *a* build of it (test_paddle_free_cpu_core_through_ctypes builds through main())."""
    return gpu.build(str(tmp_path_factory.mktemp("cpu_core")), cuda=False)


@pytest.mark.probe
def test_core_rejects_bad_dtype_code(cpu_core_library):
    core = gpu.Core(cpu_core_library, cuda=False)
    x = np.zeros([2, 2], "float32")
    err = gpu.ctypes.create_string_buffer(256)
    rc = core.lib.pmg_wgrad_cpu_c(
        x.ctypes.data, x.ctypes.data, 7, 2, 2, 2, x.ctypes.data, 0, 1.0, None, 0, 1.0, err, 256
    )
    assert rc == 1 and b"dtype code" in err.value


@pytest.mark.probe
def test_script_shares_the_packages_build_config_and_needs_no_paddle():
    """One build configuration: the script loads paddle_mgrad/ops/build_config.py by path, and
    that works with Paddle unimportable (the H200 box has CUDA + torch, no Paddle)."""
    import subprocess
    import sys

    from paddle_mgrad.ops import build_config

    checkout = os.path.join(
        os.path.dirname(PATH), "..", "..", "paddle_mgrad", "ops", "build_config.py"
    )
    assert os.path.samefile(gpu.bc.__file__, checkout)
    with open(checkout) as a, open(build_config.__file__) as b:  # the package (maybe installed)
        assert a.read() == b.read()
    assert gpu.NVCC_ARCH == build_config.NVCC_ARCH
    code = (
        "import sys, importlib.util; sys.modules['paddle'] = None\n"
        f"spec = importlib.util.spec_from_file_location('g', {PATH!r})\n"
        "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)\n"
        "tk = g.toolkit(); print('OK', g.bc.NVCC_FLAGS, tk.ok or tk.problem())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr


def test_new_flags_and_items():
    a = gpu.parse_args(["--no-sanitizer", "--budget", "200"])
    assert a.no_sanitizer and a.budget == 200.0 and not a.sanitize_case
    assert gpu.parse_args([]).budget < 300  # the whole run fits the 5 minutes
    assert gpu.ITEMS == [
        "build",
        "values",
        "offsets",
        "bias",
        "streams",
        "graph",
        "fp64",
        "capability",
        "checks",
        "bias-order",
        "pressure",
        "sanitizer",
        "speed",
    ]
    assert gpu.TARGET_VS_GEMM == 1.05 and gpu.TARGET_BIAS == 1.03


def test_offset_cases_are_views_of_real_data():
    """+2/+4/+8/+16 bytes for x, dy, main_grad and the bias gradient, each only where the offset
    is a multiple of its element size (an fp32 tensor never starts at +2)."""
    cases = gpu.offset_cases()
    assert ("bfloat16", 2, ["x", "dy"]) in cases and ("float16", 2, ["x", "dy"]) in cases
    assert ("bfloat16", 4, ["x", "dy", "main_grad", "bias"]) in cases
    assert ("float64", 8, ["x", "dy", "main_grad", "bias"]) in cases
    assert not [c for c in cases if c[0] == "float32" and c[1] == 2]
    assert not [c for c in cases if c[0] == "float64" and c[1] in (2, 4)]
    assert {off for _, off, _ in cases} == {2, 4, 8, 16}
    for dt, off, moved in cases:
        acc = "float64" if dt == "float64" else "float32"
        for name in moved:
            assert off % gpu.ELEM[acc if name in ("main_grad", "bias") else dt] == 0


def test_sanitizer_summary_and_finder(tmp_path, monkeypatch):
    assert gpu.sanitizer_summary("...\n========= ERROR SUMMARY: 0 errors\n") == (0, True)
    assert gpu.sanitizer_summary("========= ERROR SUMMARY: 3 errors") == (3, False)
    assert gpu.sanitizer_summary("timed out after 60 s") == (None, False)
    home = tmp_path / "cuda"
    tool = home / "bin" / "compute-sanitizer"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)

    class Tk:
        pass

    tk = Tk()
    tk.home = str(home)
    assert gpu.find_sanitizer(tk) == str(tool)


def test_the_one_table():
    report = {
        "device": "NVIDIA H200",
        "torch": "2.11",
        "cuda": "13.0",
        "targets_built": "sm_80+sm_90",
        "date": "2026-01-01",
        "seconds": 200,
        "checks": [
            {"item": "build", "case": "targets sm_80+sm_90", "ok": True, "detail": "20 s"},
            {"item": "values", "case": "a", "ok": True, "detail": ""},
            {"item": "values", "case": "b", "ok": False, "detail": "err/bound 3.1"},
            {"item": "graph", "case": "-", "ok": None, "detail": "simulation"},
        ],
        "bench": [
            {
                "shape": [8192, 4096, 4096],
                "ours_ms": 1.0,
                "ours_with_bias_ms": 1.02,
                "bias_path": "epilogue",
                "ours_bias_kernel_ms": 1.1,
                "bf16_gemm_ms": 0.97,
                "unfused_ms": 1.5,
                "ours_tflops": 275.0,
                "ours_vs_gemm": 1.0 / 0.97,
                "bias_vs_ours": 1.02,
            },
            {
                "shape": [16384, 4096, 14336],
                "ours_ms": 1.2,
                "ours_with_bias_ms": 1.3,
                "bias_path": "kernel",
                "ours_bias_kernel_ms": 1.3,
                "bf16_gemm_ms": 1.0,
                "unfused_ms": 1.5,
                "ours_tflops": 275.0,
                "ours_vs_gemm": 1.2,
                "bias_vs_ours": 1.3 / 1.2,
            },
        ],
    }
    text = gpu.table(report)
    lines = text.splitlines()
    assert "NVIDIA H200" in lines[0] and "sm_80+sm_90" in lines[0]
    assert [ln for ln in lines if ln.startswith("values") and "1/2" in ln]
    assert [ln for ln in lines if "FAIL" in ln and "err/bound 3.1" in ln]
    assert [ln for ln in lines if ln.startswith("graph") and "n/a" in ln]
    assert [ln for ln in lines if ln.startswith("sanitizer") and "not run" in ln]
    rows = [ln for ln in lines if "8192x4096x4096" in ln or "16384x4096x14336" in ln]
    assert "met" in rows[0] and "MISSED" in rows[1] and "epilogue" in rows[0]
    assert gpu.speed_verdict(report["bench"][0]) == (True, True)
    assert gpu.speed_verdict(report["bench"][1]) == (False, False)


def test_core_report_fields():
    info = "cap=90 bias=kernel (dweight is bfloat16 (...)) align=256,2,16,16 workspace=4351@allocator cached=1"
    assert gpu.info_field(info, "cap") == "90" and gpu.info_field(info, "bias") == "kernel"
    assert gpu.info_field(info, "align") == "256,2,16,16"
    assert gpu.info_field(info, "workspace") == "4351@allocator"
    assert gpu.info_field(info, "nothing") is None


@pytest.mark.probe
def test_cpu_library_carries_the_decisions_and_no_cuda(cpu_core_library):
    core = gpu.Core(cpu_core_library, cuda=False)
    assert core.lib.pmg_has_cuda() == 0
    assert core.lib.pmg_pointer_alignment(0x1002) == 2
    assert core.lib.pmg_targets_cover(b"sm_80+sm_90+compute_90", 90) == 1
    import pytest

    with pytest.raises(AttributeError):
        core.lib.pmg_wgrad_cuda_ex  # noqa: B018  (the CUDA entry points exist only with CUDA)


def test_bias_path_shapes_are_where_the_bias_path_matters():
    """LoRA-narrow N, a LoRA K, MoE experts (small M*N) and a large M -- each small K*N against M,
    where cuBLASLt splits K -- timed per bias path in the same run as the four main shapes."""
    shapes = dict(gpu.BIAS_PATH_SHAPES)
    assert set(shapes) == {"lora-A", "lora-B", "moe-expert", "moe-small", "large-M"}
    assert shapes["lora-A"][2] <= 64 and shapes["lora-B"][1] <= 64
    assert all(t * n <= 2**20 for t, _, n in (shapes["moe-expert"], shapes["moe-small"]))
    assert shapes["large-M"][0] >= 65536
    # what the rows cost on the GPU: 6 timings x (3 + repeat) calls each, well inside the budget
    flops = sum(2.0 * t * k * n for t, k, n in shapes.values())
    assert flops * 6 * 33 / 300e12 < 5.0  # seconds at a (pessimistic) 300 TFLOP/s


def test_the_table_shows_the_bias_path_rows():
    row = {
        "name": "lora-A",
        "shape": [16384, 4096, 16],
        "bf16_gemm_ms": 0.05,
        "ours_ms": 0.05,
        "colsum_ms": 0.01,
        "auto_ms": 0.06,
        "auto_path": "kernel",
        "kernel_ms": 0.06,
        "epilogue_ms": 0.09,
        "auto_vs_best_forced": 1.0,
        "bias_kernel_GBps": 2600.0,
    }
    lines = gpu.table(
        {"checks": [], "bench": [], "bias_paths": [row, dict(row, epilogue_ms=None)]}
    ).splitlines()
    rows = [ln for ln in lines if "lora-A 16384x4096x16" in ln]
    assert (
        len(rows) == 2 and "kernel" in rows[0] and "2600" in rows[0] and rows[1].split()[7] == "-"
    )


def test_the_script_is_a_small_package_of_modules():
    """The script is split by concern into modules; the command line stays the script's."""
    pkg = os.path.join(os.path.dirname(PATH), "pmg_gpu_bench")
    names = sorted(f for f in os.listdir(pkg) if f.endswith(".py"))
    assert names == [
        "__init__.py",
        "build.py",
        "capi.py",
        "checks.py",
        "report.py",
        "sanitizer.py",
        "shapes.py",
        "timing.py",
    ]
    # (lines as ruff format writes them: one argument per line where a call does not fit)
    for f in names + [os.path.join("..", "bench_wgrad_gpu.py")]:
        with open(os.path.join(pkg, f)) as fh:
            assert len(fh.read().splitlines()) <= 720, f


class _FakeArray(np.ndarray):
    """Enough of a torch tensor for the timing rows (numpy underneath)."""

    def add_(self, other):
        self += other
        return self

    def data_ptr(self):
        return self.ctypes.data

    def numel(self):
        return self.size

    def float(self):
        return self.astype(np.float32).view(_FakeArray)

    def sum(self, axis=None, dtype=None, **kw):
        return np.ndarray.sum(self, axis=axis, dtype=np.float32 if dtype is not None else None)


def _fake_torch():
    import types

    def make(*shape, device=None, dtype=None):
        return np.zeros(shape, np.float32).view(_FakeArray)

    cuda = types.SimpleNamespace(empty_cache=lambda: None, _sleep=None)
    return types.SimpleNamespace(
        randn=make,
        zeros=make,
        empty=lambda n, dtype=None, device=None: np.zeros(n, np.uint8).view(_FakeArray),
        matmul=lambda a, b: (a @ b).view(_FakeArray),
        bfloat16="bf16",
        float32="f32",
        uint8="u8",
        cuda=cuda,
    )


class _FakeBench:
    """The attributes timing.py uses, with a core that answers like the CUDA core's report."""

    def __init__(self, sim):
        import types

        self.sim, self.torch, self.dev, self.report = (
            sim,
            _fake_torch(),
            "cpu",
            {"checks": [], "bench": []},
        )
        self.args = types.SimpleNamespace(repeat=2, bench_shapes=[(8, 4, 2)])
        self.sync = lambda: None
        self.calls = []

    def call(self, x, dy, dw, db, dw_beta, db_beta, in_dtype, **ex):
        mode = ex.get("bias_mode", "auto")
        self.calls.append((x.shape, db is not None, mode, "workspace" in ex))
        if mode == "epilogue" and x.shape[1] == 16:
            raise gpu.CoreError("PADDLE_MGRAD_CUDA_BIAS=epilogue, but it cannot apply: fake")
        path = (
            "none"
            if db is None
            else (
                "kernel (the epilogue's algorithm (0.30 waves) is not ...)"
                if mode != "epilogue"
                else "epilogue"
            )
        )
        return f"cap=90 bias={path} align=256,256,256,256 workspace=0@caller cached=1 ws_retry=0"

    def add(self, item, case, ok, detail="", **extra):
        self.report["checks"].append({"item": item, "case": case, "ok": bool(ok), "detail": detail})

    def skip(self, item, why):
        self.report["checks"].append({"item": item, "case": "-", "ok": None, "detail": why})


def test_timing_rows_run_on_a_fake_gpu(monkeypatch):
    """The speed and bias-path rows end to end on a fake torch and core (CPU timer): every shape,
    every bias path, a refused epilogue recorded, auto's path and reason parsed, the table."""
    timing = gpu.timing
    monkeypatch.setattr(
        timing, "BIAS_PATH_SHAPES", [("lora-B", (64, 16, 32)), ("moe", (32, 8, 16))]
    )
    monkeypatch.setattr(timing, "_CpuEvent", timing._CpuEvent)
    b = _FakeBench(sim=True)
    timing.speed(b)
    assert len(b.report["bench"]) == 1 and b.report["bench"][0]["shape"] == [8, 4, 2]
    b = _FakeBench(sim=False)
    monkeypatch.setattr(timing, "time_fn", lambda bench, fn, stream=None: (fn(), 0.5)[1])
    timing.bias_paths(b)
    rows = b.report["bias_paths"]
    assert [r["name"] for r in rows] == ["lora-B", "moe"]
    assert rows[0]["epilogue_ms"] is None and "cannot apply" in rows[0]["epilogue_error"]
    assert rows[1]["epilogue_ms"] == 0.5 and rows[0]["auto_path"] == "kernel"
    assert rows[0]["auto_why"].startswith("the epilogue's algorithm")
    assert rows[1]["auto_vs_best_forced"] == 1.0 and all(c[3] for c in b.calls)  # caller workspace
    assert {c[2] for c in b.calls} == {"auto", "kernel", "epilogue"}
    assert [c["ok"] for c in b.report["checks"]] == [True, True]
    text = gpu.table(b.report)
    assert "lora-B 64x16x32" in text and "moe 32x8x16" in text
