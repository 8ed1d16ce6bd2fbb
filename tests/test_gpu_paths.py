"""GPU-only Python paths, exercised without a GPU: CUDA toolkit discovery on fake toolkits and
wheels, the tiered CUDA build (CPU op survives with one warning), and the per-place dispatch to
our op / Paddle's fused op / the fallback with a fake GPU placement."""
import os
import stat
import types
import warnings

import numpy as np
import paddle
import pytest

from paddle_mgrad import ops
from paddle_mgrad.ops import _build
from paddle_mgrad.ops import build_config as bc


# ------------------------------------------------------------------ fake toolkits and wheels
def _touch(path, text=""):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def fake_toolkit(root, version=13000, cublas=False, cudart=True, thrust="cccl"):
    home = str(root / f"cuda-{version}")
    nvcc = _touch(os.path.join(home, "bin", "nvcc"), "#!/bin/sh\n")
    os.chmod(nvcc, os.stat(nvcc).st_mode | stat.S_IEXEC)
    _touch(os.path.join(home, "include", "cuda_runtime_api.h"), f"#define CUDART_VERSION {version}\n")
    major = version // 1000
    if cudart:
        _touch(os.path.join(home, "include", "cuda_runtime.h"))
        _touch(os.path.join(home, "lib64", "libcudart.so"))
        _touch(os.path.join(home, "lib64", f"libcudart.so.{major}"))
    if cublas:
        _touch(os.path.join(home, "include", "cublasLt.h"))
        _touch(os.path.join(home, "lib64", "libcublasLt.so"))
    if thrust == "cccl":
        _touch(os.path.join(home, "include", "cccl", "thrust", "complex.h"))
    elif thrust == "plain":
        _touch(os.path.join(home, "include", "thrust", "complex.h"))
    return home


def fake_wheel(site, pkg, major, header="cublasLt.h", lib="libcublasLt"):
    d = os.path.join(str(site), "nvidia", pkg)
    _touch(os.path.join(d, "include", header))
    _touch(os.path.join(d, "lib", f"{lib}.so.{major}"))
    return d


def find(home, site, **kw):
    kw.setdefault("need_thrust", True)
    return bc.find_cuda(search_paths=[str(site)], environ={}, which=lambda _: None,
                        default_home=home, **kw)


def test_toolkit_plus_same_major_wheel_links_by_file_name_with_rpath(tmp_path):
    home = fake_toolkit(tmp_path, 13000)
    wheel = fake_wheel(tmp_path / "site", "cu13", 13)
    tk = find(home, tmp_path / "site")
    assert tk.ok, tk.problem()
    assert tk.version == (13, 0) and tk.home == home and tk.nvcc == os.path.join(home, "bin", "nvcc")
    lib = os.path.join(wheel, "lib")
    assert tk.link_args() == [f"-L{lib}", "-l:libcublasLt.so.13", f"-Wl,-rpath,{lib}"]
    assert "-Xlinker=-l:libcublasLt.so.13" in tk.nvcc_link_args()
    assert os.path.join(wheel, "include") in tk.include_dirs
    assert os.path.join(home, "include", "cccl") in tk.include_dirs  # thrust moved in CUDA 13
    assert "-lcublas" not in tk.link_args()  # cuBLAS proper is not used
    assert tk.link_shims() == {}  # the toolkit has libcudart.so


def test_toolkit_own_cublas_is_preferred_and_linked_by_name(tmp_path):
    home = fake_toolkit(tmp_path, 12040, cublas=True, thrust="plain")
    fake_wheel(tmp_path / "site", "cublas", 12)
    tk = find(home, tmp_path / "site")
    assert tk.ok and tk.version == (12, 4)
    assert tk.libs["cublasLt"] == os.path.join(home, "lib64", "libcublasLt.so")
    assert "-lcublasLt" in tk.link_args() and tk.include_dirs == []


def test_other_major_wheel_is_refused_with_one_line_naming_the_fix(tmp_path):
    home = fake_toolkit(tmp_path, 13000)
    fake_wheel(tmp_path / "site", "cublas", 12)  # nvidia-cublas-cu12 next to nvcc 13
    tk = find(home, tmp_path / "site")
    assert not tk.ok and "\n" not in tk.problem()
    msg = tk.problem()
    assert "cublasLt" in msg and "CUDA 12's" in msg and "nvcc is CUDA 13" in msg
    assert 'pip install "nvidia-cublas>=13,<14"' in msg
    tk12 = find(fake_toolkit(tmp_path, 12020, thrust="plain"), tmp_path / "empty")
    assert "pip install nvidia-cublas-cu12" in tk12.problem()


def test_missing_thrust_and_missing_cudart_are_each_named(tmp_path):
    home = fake_toolkit(tmp_path, 12040, cudart=False, thrust=None)
    fake_wheel(tmp_path / "site", "cublas", 12)
    tk = find(home, tmp_path / "site")
    assert "pip install nvidia-cuda-runtime-cu12" in tk.problem()
    assert "thrust" in tk.problem() and "pip install nvidia-cuda-cccl-cu12" in tk.problem()
    assert find(home, tmp_path / "site", need_thrust=False).problem().count("thrust (") == 0


def test_versioned_only_cudart_from_a_wheel_gets_a_link_shim(tmp_path):
    home = fake_toolkit(tmp_path, 12040, cudart=False, thrust="plain")
    fake_wheel(tmp_path / "site", "cublas", 12)
    rt = fake_wheel(tmp_path / "site", "cuda_runtime", 12, header="cuda_runtime.h", lib="libcudart")
    tk = find(home, tmp_path / "site")
    assert tk.ok, tk.problem()
    assert tk.link_shims() == {"libcudart.so": os.path.join(rt, "lib", "libcudart.so.12")}


def test_no_toolkit_and_bad_cuda_home(tmp_path):
    tk = find(str(tmp_path / "none"), tmp_path)
    assert not tk.ok and tk.problem().startswith("no CUDA toolkit: missing nvcc")
    bad = bc.find_cuda(search_paths=[], environ={"CUDA_HOME": str(tmp_path)}, which=lambda _: None)
    assert f"CUDA_HOME/CUDA_PATH={tmp_path}" in bad.problem()


def test_nvcc_wrapper_on_path_is_skipped_for_the_real_toolkit(tmp_path):
    """/usr/local/bin/nvcc can be a wrapper script: its bin/.. has no CUDA headers."""
    home = fake_toolkit(tmp_path, 13000)
    wrapper = _touch(str(tmp_path / "usr" / "bin" / "nvcc"), "#!/bin/sh\n")
    os.chmod(wrapper, 0o755)
    os.makedirs(tmp_path / "usr" / "include")
    fake_wheel(tmp_path / "site", "cu13", 13)
    tk = bc.find_cuda(search_paths=[str(tmp_path / "site")], environ={}, which=lambda _: wrapper,
                      default_home=home)
    assert tk.ok and tk.home == home


def test_build_config_is_paddle_free():
    import ast

    with open(bc.__file__) as f:
        tree = ast.parse(f.read())
    mods = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in mods if m.startswith(("paddle", "."))], mods


# ------------------------------------------------------------------ tiered build / loading
class _FakeTk:
    def __init__(self, ok, problem=""):
        self.ok, self._problem, self.version, self.home = ok, problem, (13, 0), "/fake/cuda"
        self.include_dirs, self.libs = [], {}

    def problem(self):
        return self._problem

    def summary(self):
        return "CUDA 13.0 (fake)"

    def link_args(self):
        return ["-L/fake/cuda/lib", "-l:libcublasLt.so.13"]

    def link_shims(self):
        return {}


@pytest.fixture
def fresh_ops(monkeypatch):
    """ops' load state reset for the test and restored afterwards.  The real module is loaded
    once per process (a custom-op library must not be imported twice) and handed back by a
    stubbed ``_build.load_op_module``; tests replace the stub to fake a tier."""
    ops.load()
    saved = dict(ops._state)
    ops._state.update(module=None, backend=None, why=None, cpu=None, gpu=None, cuda_why=None)
    monkeypatch.setattr(_build, "load_op_module", lambda: (saved["module"], None))
    if saved["module"] is None:
        monkeypatch.setenv("PADDLE_MGRAD_OPS", "python")
    yield saved
    ops._state.clear()
    ops._state.update(saved)


def test_incomplete_toolkit_keeps_the_cpu_op_and_warns_once(monkeypatch, fresh_ops):
    if fresh_ops["module"] is None:
        pytest.skip("the C++ op is not built here (PADDLE_MGRAD_OPS=python)")
    problem = 'CUDA 13.0 at /x: missing cublasLt (...): pip install "nvidia-cublas>=13,<14"'
    real = fresh_ops["module"]
    info = real.pmg_backend_info(paddle.zeros([1])).numpy()
    cpu_only = types.SimpleNamespace(  # the real CPU op, reporting no CUDA part (as when missing)
        pmg_fused_wgrad_add=real.pmg_fused_wgrad_add,
        pmg_backend_info=lambda t: paddle.to_tensor(np.array([info[0], 0], "int32")))
    monkeypatch.setattr(_build, "load_op_module", lambda: (cpu_only, problem))
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(ops, "_paddle_has_gpu_fused_op", lambda: True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        b = ops.backend()
        ops.backend()
        ops.describe()
    msgs = [str(m.message) for m in w if "paddle_mgrad" in str(m.message)]
    assert b.startswith("cpp-") and "+cuda" not in b and b.endswith(";gpu=paddle-fused"), b
    assert len(msgs) == 1 and problem in msgs[0] and "Paddle's _C_ops" in msgs[0], msgs
    assert ops.backends() == {"cpu": b.split(";")[0], "gpu": "paddle-fused"}
    assert ops.cuda_fallback_reason() == problem and ops.fallback_reason() is None
    line = ops.describe()
    assert "\n" not in line and "GPU: Paddle's _C_ops" in line and "nvidia-cublas" in line


def test_incomplete_toolkit_builds_only_the_cpu_module(monkeypatch, tmp_path):
    monkeypatch.setenv("PADDLE_MGRAD_CACHE", str(tmp_path))
    monkeypatch.setattr(_build, "want_cuda", lambda: True)
    monkeypatch.setattr(_build, "cuda_toolkit", lambda: _FakeTk(False, "missing cublasLt: pip ..."))
    calls = []
    monkeypatch.setattr(_build, "_load", lambda d, k, cuda, verbose=False: calls.append(cuda) or "m")
    assert _build.load_op_module() == ("m", "missing cublasLt: pip ...") and calls == [False]
    monkeypatch.setattr(_build, "want_cuda", lambda: False)  # CPU Paddle: no CUDA problem at all
    monkeypatch.setenv("PADDLE_MGRAD_CACHE", str(tmp_path / "other"))
    assert _build.load_op_module() == ("m", None) and calls == [False, False]


def test_failed_cuda_build_falls_back_to_cpu_build_and_is_not_retried(monkeypatch, tmp_path):
    monkeypatch.setenv("PADDLE_MGRAD_CACHE", str(tmp_path))
    monkeypatch.setattr(_build, "want_cuda", lambda: True)
    monkeypatch.setattr(_build, "cuda_toolkit", lambda: _FakeTk(True))
    calls = []

    def fake_load(directory, key, cuda, verbose=False):
        calls.append(cuda)
        if cuda:
            raise RuntimeError("nvcc: fake failure")
        return "cpu-module"

    monkeypatch.setattr(_build, "_load", fake_load)
    module, problem = _build.load_op_module()
    assert module == "cpu-module" and calls == [True, False]
    assert "CUDA 13.0 (fake)" in problem and "nvcc: fake failure" in problem
    cuda_dir = tmp_path / _build.build_key(True)
    assert (cuda_dir / ".failed").exists() and not (cuda_dir / ".complete").exists()
    calls.clear()
    module, problem = _build.load_op_module()  # a new process would see the marker: no retry
    assert True not in calls and "earlier build" in problem and module is not None


def test_cuda_flags_come_from_the_toolkit(monkeypatch):
    monkeypatch.setattr(_build, "cuda_toolkit", lambda: _FakeTk(True))
    sources, cflags, ldflags, nvcc = _build.build_config(cuda=True)
    assert "wgrad_cuda.cu" in sources and bc.CUDA_DEFINE in cflags
    assert nvcc[:len(bc.NVCC_FLAGS)] == bc.NVCC_FLAGS
    assert "-l:libcublasLt.so.13" in ldflags and "-lcublas" not in ldflags
    assert _build.build_key(True) != _build.build_key(False)
    assert "wgrad_cuda.cu" not in _build.build_config(cuda=False)[0]


def test_cpu_paddle_has_no_gpu_fused_kernel():
    if not paddle.is_compiled_with_cuda():
        assert ops._paddle_has_gpu_fused_op() is False


# ------------------------------------------------------------------ per-place dispatch (fake GPU)
def _data(dtype="float32", lead=(6, 5), k=4, n=3):
    rs = np.random.RandomState(7)
    x = paddle.to_tensor(rs.standard_normal([*lead, k]).astype("float32")).astype(dtype)
    dy = paddle.to_tensor(rs.standard_normal([*lead, n]).astype("float32")).astype(dtype)
    x2 = x.astype("float32").numpy().astype("f8").reshape(-1, k)
    y2 = dy.astype("float32").numpy().astype("f8").reshape(-1, n)
    return x, dy, x2, y2


@pytest.fixture
def fake_gpu(monkeypatch, fresh_ops):
    """Every tensor looks like a GPU tensor; Paddle's fused op is a CPU stand-in that, like a
    non-inplace kernel, returns NEW tensors (so our write-back into the accumulators is tested)."""
    ops.load()
    monkeypatch.setattr(ops, "_is_gpu", lambda t: True)
    calls = []

    def fake_fused(x, dout, dweight, dbias, multi_precision, has_bias):
        calls.append((list(x.shape), dweight is None, dbias is None, multi_precision, has_bias))
        assert len(x.shape) == 2 and len(dout.shape) == 2  # flattened for Paddle's kernel
        acc = "float32" if multi_precision else x.dtype
        g = paddle.matmul(x.astype("float32"), dout.astype("float32"), transpose_x=True)
        b = dout.astype("float32").sum(0)
        dw = (g if dweight is None else dweight.astype("float32") + g).astype(acc)
        db = (b if dbias is None else dbias.astype("float32") + b).astype(acc) if has_bias else None
        return dw, db

    from paddle import _C_ops

    monkeypatch.setattr(_C_ops, "fused_linear_param_grad_add", fake_fused, raising=False)
    return calls


def test_gpu_tier_paddle_fused_accumulates_in_place(fake_gpu):
    ops._state["gpu"] = "paddle-fused"
    x, dy, x2, y2 = _data()
    mg, mb = paddle.ones([4, 3]), paddle.ones([3])
    pw, pb = mg.data_ptr(), mb.data_ptr()
    dw, db = ops.fused_linear_param_grad_add(x, dy, mg, mb, True, True)
    assert fake_gpu and fake_gpu[-1][0] == [30, 4]
    assert dw is mg and db is mb and mg.data_ptr() == pw and mb.data_ptr() == pb
    np.testing.assert_allclose(mg.numpy(), 1 + x2.T @ y2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mb.numpy(), 1 + y2.sum(0), rtol=1e-5, atol=1e-5)
    dw, db = ops.fused_linear_param_grad_add(x, dy, None, None, True, False)
    assert db is None and dw.dtype == paddle.float32
    np.testing.assert_allclose(dw.numpy(), x2.T @ y2, rtol=1e-5, atol=1e-5)


def test_gpu_tier_paddle_fused_skips_accumulators_it_does_not_take(fake_gpu):
    """fp32 accumulator without multi_precision for fp16 input: ours accepts it, Paddle's op
    wants the input dtype -> the pure-Paddle fallback, same result."""
    ops._state["gpu"] = "paddle-fused"
    x, dy, x2, y2 = _data("float16")
    mg = paddle.zeros([4, 3])
    ops.fused_linear_param_grad_add(x, dy, mg, None, False, False)
    assert fake_gpu == []
    np.testing.assert_allclose(mg.numpy(), x2.T @ y2, rtol=1e-3, atol=1e-3)
    assert ops._tier_for(x, paddle.zeros([4, 3], "float16"), None, False, False) == "paddle-fused"


def test_gpu_tiers_ours_and_python(fake_gpu):
    x, dy, x2, y2 = _data()
    ops._state["gpu"] = "cuda"
    assert ops._tier_for(x, None, None, True, True) == ("cpp" if ops._state["module"] else "python")
    ops._state["gpu"] = "python"
    assert ops._tier_for(x, None, None, True, True) == "python"
    mg = paddle.zeros([4, 3])
    ops.fused_linear_param_grad_add(x, dy, mg, None, True, False)
    assert fake_gpu == []
    np.testing.assert_allclose(mg.numpy(), x2.T @ y2, rtol=1e-5, atol=1e-5)


def test_cpu_tensors_never_take_the_gpu_tiers(fresh_ops, monkeypatch):
    ops.load()
    ops._state["gpu"] = "paddle-fused"
    x, dy, _, _ = _data()
    assert not ops._is_gpu(x)
    assert ops._tier_for(x, None, None, True, True) == ("cpp" if ops._state["module"] else "python")


def test_backend_strings_keep_their_old_meaning():
    assert ops._compose("cpp-onednn", None) == "cpp-onednn"
    assert ops._compose("cpp-onednn", "cuda") == "cpp-onednn+cuda"
    s = ops._compose("cpp-portable", "paddle-fused")
    assert s.startswith("cpp-") and "+cuda" not in s and s == "cpp-portable;gpu=paddle-fused"
