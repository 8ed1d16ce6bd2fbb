"""CPU-side parts of benchmarks/gpu/bench_wgrad_gpu.py: arguments, reference math, and the
Paddle-free core built with the script's own builder and driven through its ctypes API."""
import importlib.util
import json
import os

import numpy as np

PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu", "bench_wgrad_gpu.py")
spec = importlib.util.spec_from_file_location("bench_wgrad_gpu", PATH)
gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)


def test_parse_args_defaults_and_overrides():
    a = gpu.parse_args([])
    assert a.repeat == 30 and a.bench_shapes == gpu.BENCH_SHAPES
    assert all(8192 <= t <= 16384 and 4096 <= k <= 14336 and 4096 <= n <= 14336
               for t, k, n in a.bench_shapes)
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


def test_include_dir_search_is_a_list():
    assert isinstance(gpu.cuda_include_dirs(), list)
    assert isinstance(gpu.cublas_lib_dirs(), list)


def test_paddle_free_cpu_core_through_ctypes(tmp_path):
    rc = gpu.main(["--cpu-core", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "cpu_core.json").read_text())
    assert report["backend"] == "portable"
    assert [r["shape"] for r in report["cpu_core"]] == [[37, 19, 23], [600, 70, 530], [0, 4, 5]]
    assert all(r["ok"] for r in report["cpu_core"])


def test_core_rejects_bad_dtype_code(tmp_path):
    core = gpu.Core(gpu.build(str(tmp_path), cuda=False), cuda=False)
    x = np.zeros([2, 2], "float32")
    err = gpu.ctypes.create_string_buffer(256)
    rc = core.lib.pmg_wgrad_cpu_c(x.ctypes.data, x.ctypes.data, 7, 2, 2, 2, x.ctypes.data, 0, 1.0,
                                  None, 0, 1.0, err, 256)
    assert rc == 1 and b"dtype code" in err.value


def test_script_shares_the_packages_build_config_and_needs_no_paddle():
    """One build configuration: the script loads paddle_mgrad/ops/build_config.py by path, and
    that works with Paddle unimportable (the H200 box has CUDA + torch, no Paddle)."""
    import subprocess
    import sys

    from paddle_mgrad.ops import build_config

    checkout = os.path.join(os.path.dirname(PATH), "..", "..", "paddle_mgrad", "ops", "build_config.py")
    assert os.path.samefile(gpu.bc.__file__, checkout)
    with open(checkout) as a, open(build_config.__file__) as b:  # the package (maybe installed)
        assert a.read() == b.read()
    assert gpu.NVCC_ARCH == build_config.NVCC_ARCH
    code = (
        "import sys, importlib.util; sys.modules['paddle'] = None\n"
        f"spec = importlib.util.spec_from_file_location('g', {PATH!r})\n"
        "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)\n"
        "tk = g.toolkit(); print('OK', g.bc.NVCC_FLAGS, tk.ok or tk.problem())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
