"""GPU-only paths, exercised without a GPU: CUDA toolkit discovery on fake toolkits and wheels,
the tiered CUDA build (CPU op survives with one warning), the build targets (the running GPU's
capability), the per-place dispatch to our op / Paddle's fused op / the fallback with a fake GPU
placement; the CUDA core's decisions (csrc/wgrad_gpu_plan.cc: alignment, kernel images, bias
path, workspace, places) and the Paddle binding's GPU branch (csrc/wgrad_gpu_flow.h) on a
recording fake host, both through the test library's C ABI (the capi fixture); the overlap linears' GPU aid."""

import ctypes
import os
import stat
import types
import warnings

import numpy as np
import paddle
import pytest

from helpers import require_cpp_op
from paddle_mgrad import ops
from paddle_mgrad.ops import _build, build_config as bc, devices, dispatch, loader


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
    _touch(
        os.path.join(home, "include", "cuda_runtime_api.h"), f"#define CUDART_VERSION {version}\n"
    )
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
    return bc.find_cuda(
        search_paths=[str(site)], environ={}, which=lambda _: None, default_home=home, **kw
    )


def test_toolkit_plus_same_major_wheel_links_by_file_name_with_rpath(tmp_path):
    home = fake_toolkit(tmp_path, 13000)
    wheel = fake_wheel(tmp_path / "site", "cu13", 13)
    tk = find(home, tmp_path / "site")
    assert tk.ok, tk.problem()
    assert (
        tk.version == (13, 0) and tk.home == home and tk.nvcc == os.path.join(home, "bin", "nvcc")
    )
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
    tk = bc.find_cuda(
        search_paths=[str(tmp_path / "site")],
        environ={},
        which=lambda _: wrapper,
        default_home=home,
    )
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

    def supported_codes(self):
        return frozenset({"sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"})


@pytest.fixture
def fresh_ops(monkeypatch):
    """ops unloaded for the test (``loader.unloaded``), what was settled restored afterwards.
    The real module is loaded once per process (a custom-op library must not be imported twice)
    and handed back by a stubbed ``_build.load_op_module``; tests replace the stub to fake a
    tier.  Yields ``{"module", "why"}`` as the first load settled them."""
    loaded = {"module": ops.load(), "why": ops.fallback_reason()}
    monkeypatch.setattr(_build, "load_op_module", lambda: (loaded["module"], None))
    if loaded["module"] is None:
        monkeypatch.setenv("PADDLE_MGRAD_OPS", "python")
    with loader.unloaded():
        yield loaded


def test_incomplete_toolkit_keeps_the_cpu_op_and_warns_once(monkeypatch, fresh_ops):
    require_cpp_op(fresh_ops)
    problem = 'CUDA 13.0 at /x: missing cublasLt (...): pip install "nvidia-cublas>=13,<14"'
    real = fresh_ops["module"]
    info = real.pmg_backend_info(paddle.zeros([1])).numpy()
    cpu_only = types.SimpleNamespace(  # the real CPU op, reporting no CUDA part (as when missing)
        pmg_fused_wgrad_add=real.pmg_fused_wgrad_add,
        pmg_backend_info=lambda t: paddle.to_tensor(np.array([info[0], 0], "int32")),
    )
    monkeypatch.setattr(_build, "load_op_module", lambda: (cpu_only, problem))
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(loader, "_paddle_has_gpu_fused_op", lambda: True)
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
    monkeypatch.setattr(
        _build, "_load", lambda d, k, cuda, verbose=False: calls.append(cuda) or "m"
    )
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
    assert nvcc[: len(bc.NVCC_FLAGS)] == bc.NVCC_FLAGS
    assert "-l:libcublasLt.so.13" in ldflags and "-lcublas" not in ldflags
    assert _build.build_key(True) != _build.build_key(False)
    assert "wgrad_cuda.cu" not in _build.build_config(cuda=False)[0]


def test_cpu_paddle_has_no_gpu_fused_kernel():
    if not paddle.is_compiled_with_cuda():
        assert loader._paddle_has_gpu_fused_op() is False


# ------------------------------------------------------------------ per-place dispatch (fake GPU)
def _data(dtype="float32", lead=(6, 5), k=4, n=3):
    rs = np.random.RandomState(7)
    x = paddle.to_tensor(rs.standard_normal([*lead, k]).astype("float32")).astype(dtype)
    dy = paddle.to_tensor(rs.standard_normal([*lead, n]).astype("float32")).astype(dtype)
    x2 = x.astype("float32").numpy().astype("f8").reshape(-1, k)
    y2 = dy.astype("float32").numpy().astype("f8").reshape(-1, n)
    return x, dy, x2, y2


@pytest.fixture
def fake_gpu(monkeypatch):
    """Every tensor is on ``Place(gpu:0)`` (``ops.override``); Paddle's fused op is a CPU
    stand-in that, like a non-inplace kernel, returns NEW tensors (so our write-back into the
    accumulators is tested).  Tests pick the GPU tier with ``loader.settled(gpu=...)``."""
    ops.load()
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
    with ops.override(place="Place(gpu:0)"):
        yield calls


def test_gpu_tier_paddle_fused_accumulates_in_place(fake_gpu):
    x, dy, x2, y2 = _data()
    mg, mb = paddle.ones([4, 3]), paddle.ones([3])
    pw, pb = mg.data_ptr(), mb.data_ptr()
    with loader.settled(gpu="paddle-fused"):
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
    x, dy, x2, y2 = _data("float16")
    mg = paddle.zeros([4, 3])
    with loader.settled(gpu="paddle-fused"):
        ops.fused_linear_param_grad_add(x, dy, mg, None, False, False)
        assert fake_gpu == []
        np.testing.assert_allclose(mg.numpy(), x2.T @ y2, rtol=1e-3, atol=1e-3)
        tier = dispatch.tier_for(x, paddle.zeros([4, 3], "float16"), None, False, False)
    assert tier == "paddle-fused"


def test_gpu_tier_is_decided_once_not_per_call(fake_gpu, monkeypatch):
    """The tier for GPU tensors (Paddle's fused op, our CUDA op, the reference) comes from the
    state load() settled: no call asks Paddle's kernel registry, is_compiled_with_cuda or the
    build again (each of those is a slow query, and the host cost is per call)."""
    ops.load()
    for state, want_fake in (("paddle-fused", True), ("python", False)):

        def boom(*a, **k):
            raise AssertionError("an expensive query ran per call")

        with loader.settled(gpu=state):
            monkeypatch.setattr(paddle, "is_compiled_with_cuda", boom)
            monkeypatch.setattr(loader, "_paddle_has_gpu_fused_op", boom)
            monkeypatch.setattr(_build, "load_op_module", boom)
            monkeypatch.setattr(
                paddle.framework.core, "_get_all_register_op_kernels", boom, raising=False
            )
            x, dy, x2, y2 = _data()
            mg = paddle.zeros([4, 3])
            fake_gpu.clear()
            for _ in range(3):
                ops.fused_linear_param_grad_add(x, dy, mg, None, True, False)
        assert bool(fake_gpu) == want_fake and len(fake_gpu) in (0, 3)
        np.testing.assert_allclose(mg.numpy(), 3 * (x2.T @ y2), rtol=1e-5, atol=1e-5)


def test_gpu_tiers_ours_and_python(fake_gpu):
    x, dy, x2, y2 = _data()
    with loader.settled(gpu="cuda"):
        assert dispatch.tier_for(x, None, None, True, True) == ("cpp" if ops.load() else "python")
    mg = paddle.zeros([4, 3])
    with loader.settled(gpu="python"):
        assert dispatch.tier_for(x, None, None, True, True) == "python"
        ops.fused_linear_param_grad_add(x, dy, mg, None, True, False)
    assert fake_gpu == []
    np.testing.assert_allclose(mg.numpy(), x2.T @ y2, rtol=1e-5, atol=1e-5)


def test_cpu_tensors_never_take_the_gpu_tiers():
    x, dy, _, _ = _data()
    with loader.settled(gpu="paddle-fused"):
        assert not devices.is_gpu(x)
        assert dispatch.tier_for(x, None, None, True, True) == ("cpp" if ops.load() else "python")


def test_backend_strings_keep_their_old_meaning():
    assert loader._compose("cpp-onednn", None) == "cpp-onednn"
    assert loader._compose("cpp-onednn", "cuda") == "cpp-onednn+cuda"
    s = loader._compose("cpp-portable", "paddle-fused")
    assert s.startswith("cpp-") and "+cuda" not in s and s == "cpp-portable;gpu=paddle-fused"


# ------------------------------------------------------------------ build targets
def test_build_targets_add_the_running_gpus_capability_when_not_covered():
    assert bc.cuda_targets() == bc.DEFAULT_TARGETS == ("sm_80", "sm_90", "compute_90")
    sup = frozenset({"sm_75", "sm_80", "sm_86", "sm_90", "sm_100"})
    assert bc.cuda_targets([75], sup) == bc.DEFAULT_TARGETS + ("sm_75",)  # T4: nothing ran there
    assert bc.cuda_targets([86, 89, 90], sup) == bc.DEFAULT_TARGETS  # sm_80/sm_90 SASS run there
    assert bc.cuda_targets([100], sup) == bc.DEFAULT_TARGETS + ("sm_100",)  # PTX only: add SASS
    assert bc.cuda_targets([70], sup) == bc.DEFAULT_TARGETS  # this nvcc cannot: the core refuses
    assert bc.cuda_targets([70], None) == bc.DEFAULT_TARGETS + ("sm_70",)  # unknown: try
    flags = bc.nvcc_flags(bc.cuda_targets([75], sup))
    assert "-gencode=arch=compute_75,code=sm_75" in flags
    assert "-gencode=arch=compute_90,code=compute_90" in flags
    assert "-DPMG_CUDA_TARGETS=sm_80+sm_90+compute_90+sm_75" in flags
    assert bc.NVCC_FLAGS == bc.nvcc_flags() and bc.NVCC_ARCH == bc.gencode_flags(bc.DEFAULT_TARGETS)


def test_running_gpu_capability_reaches_the_nvcc_flags_and_the_key(monkeypatch):
    monkeypatch.setattr(_build, "cuda_toolkit", lambda: _FakeTk(True))
    plain = _build.build_config(cuda=True)[3]
    key = _build.build_key(True)
    monkeypatch.setattr(_build, "gpu_capabilities", lambda: [75])  # a T4 in this process
    t4 = _build.build_config(cuda=True)[3]
    assert "-gencode=arch=compute_75,code=sm_75" in t4 and not any("sm_75" in f for f in plain)
    assert _build.build_key(True) != key


def test_gpu_capabilities_reads_paddle_and_survives_cpu_paddle(monkeypatch):
    cuda = paddle.device.cuda
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "get_device_capability", lambda i: [(9, 0), (7, 5)][i])
    assert _build.gpu_capabilities() == [75, 90]
    monkeypatch.setattr(cuda, "device_count", lambda: (_ for _ in ()).throw(RuntimeError("no")))
    assert _build.gpu_capabilities() == []


# ------------------------------------------------------------------ the core's decisions (C ABI)
def test_pointer_alignment_for_cublaslt(capi):
    al = capi.lib.pmg_pointer_alignment
    assert al(0) == 256 and al(0x7F0000001000) == 256 and al(0x7F0000001100) == 256
    base = 0x7F0000001000
    assert [al(base + off) for off in (2, 4, 8, 16, 32, 128, 1, 6)] == [2, 4, 8, 16, 32, 128, 1, 2]


def test_kernel_image_rule_matches_build_config(capi):
    for targets in (
        bc.DEFAULT_TARGETS,
        ("sm_80",),
        ("compute_80",),
        ("sm_90a",),
        ("sm_75", "sm_80", "compute_90"),
        ("sm_100", "compute_120"),
    ):
        text = "+".join(targets).encode()
        for cap in (61, 70, 75, 80, 86, 89, 90, 100, 103, 120, 121):
            assert bool(capi.lib.pmg_targets_cover(text, cap)) == bc.covers(targets, cap), (
                targets,
                cap,
            )
    t = b"sm_80+sm_90+compute_90"
    assert not capi.lib.pmg_targets_cover(t, 70) and not capi.lib.pmg_targets_cover(t, 75)
    assert all(capi.lib.pmg_targets_cover(t, c) for c in (80, 86, 89, 90, 100, 120))
    assert not capi.lib.pmg_targets_cover(b"", 90)


def _choose(
    capi,
    in_dtype="bfloat16",
    M=64,
    K=32,
    N=16,
    dw="float32",
    db="float32",
    mode="auto",
    has_dw=True,
    has_db=True,
):
    why = ctypes.create_string_buffer(256)
    c = {"float32": 0, "bfloat16": 1, "float16": 2, "float64": 3}
    path = capi.lib.pmg_choose_bias(
        c[in_dtype],
        M,
        K,
        N,
        int(has_dw),
        c[dw],
        int(has_db),
        c[db],
        {"auto": 0, "epilogue": 1, "kernel": 2}[mode],
        why,
        len(why),
    )
    return path, why.value.decode()


def test_bias_path_decision(capi):
    assert _choose(capi) == (1, "")  # the epilogue: fp32 compute, fp32 dW, a GEMM that runs
    assert _choose(capi, "float16")[0] == 1 and _choose(capi, "float32")[0] == 1
    path, why = _choose(capi, dw="bfloat16")  # multi_precision=False: dW (and so BGRAD) is bf16
    assert path == 2 and "dweight is bfloat16" in why
    path, why = _choose(capi, "float64", dw="float64", db="float64")
    assert path == 2 and "float64" in why
    assert _choose(capi, M=0) == (2, "no rows (M = 0)")
    assert _choose(capi, K=0)[0] == 2 and _choose(capi, has_dw=False)[0] == 2
    assert _choose(capi, has_db=False) == (0, "") and _choose(capi, N=0) == (0, "")
    assert _choose(capi, mode="kernel") == (2, "PADDLE_MGRAD_CUDA_BIAS=kernel")
    assert _choose(capi, mode="epilogue") == (1, "")
    path, why = _choose(capi, dw="bfloat16", mode="epilogue")  # forced but impossible: refused
    assert path == -1 and "dweight is bfloat16" in why


def test_bias_mode_setting_is_parsed_like_env_py(capi):
    from paddle_mgrad import env
    from paddle_mgrad.errors import EnvError

    err = ctypes.create_string_buffer(256)
    parse = capi.lib.pmg_parse_bias_mode
    for text, want in ((None, 0), (b"", 0), (b"auto", 0), (b" Kernel ", 2), (b"EPILOGUE", 1)):
        assert parse(text, err, len(err)) == want, text
        if text is not None:
            assert (
                env.get("PADDLE_MGRAD_CUDA_BIAS", {"PADDLE_MGRAD_CUDA_BIAS": text.decode()})
                == ["auto", "epilogue", "kernel"][want]
            )
    assert parse(b"fused", err, len(err)) == -1
    assert b"PADDLE_MGRAD_CUDA_BIAS='fused'" in err.value and b"epilogue" in err.value
    with pytest.raises(EnvError, match="PADDLE_MGRAD_CUDA_BIAS"):
        env.get("PADDLE_MGRAD_CUDA_BIAS", {"PADDLE_MGRAD_CUDA_BIAS": "fused"})


def _plan(capi, path, M=4096, K=64, N=1000, gemm_ws=1000, sms=132, in_dtype=1):
    out = (ctypes.c_int64 * 8)()
    capi.lib.pmg_plan_workspace(in_dtype, M, K, N, path, gemm_ws, sms, out)
    keys = (
        "gemm_offset",
        "tmp_offset",
        "tmp_bytes",
        "partial_offset",
        "partial_bytes",
        "splits",
        "total",
        "request",
    )
    return dict(zip(keys, list(out)))


def test_workspace_plan(capi):
    e = _plan(capi, 1)  # epilogue: cuBLASLt's bytes, then N fp32 for the bias gradient
    assert e["tmp_offset"] == 1024 and e["tmp_bytes"] == 4000 and e["total"] == 1024 + 4096
    assert e["request"] == e["total"] + 255 and e["splits"] == 0 and e["partial_bytes"] == 0
    k = _plan(capi, 2)  # kernel: partial sums; N = 1000 is one column block: >= 64 rows a slice
    assert k["splits"] == 4096 // 64 and k["partial_offset"] == 1024
    assert k["partial_bytes"] == k["splits"] * 1000 * 4
    assert _plan(capi, 2, in_dtype=3)["partial_bytes"] == k["splits"] * 1000 * 8  # fp64 sums
    assert _plan(capi, 2, M=0, gemm_ws=0)["request"] == 0  # no rows: nothing to allocate
    assert _plan(capi, 0, gemm_ws=0)["request"] == 0
    assert _plan(capi, 2, M=10**6, N=10**7)["splits"] == 1  # a huge N: partials <= 64 MiB
    assert _plan(capi, 2, M=10**6, N=14336)["splits"] == -(-(10**6) // 4096)  # <= 4096 rows each
    for p in (_plan(capi, 1, gemm_ws=777), _plan(capi, 2, gemm_ws=5000)):
        assert all(
            p[k] % 256 == 0 for k in ("gemm_offset", "tmp_offset", "partial_offset", "total")
        )


def test_element_alignment_check(capi):
    err = ctypes.create_string_buffer(256)
    chk = capi.lib.pmg_check_element_alignment
    base = 0x7F0000001000
    assert chk(base + 2, base, 1, 4, 4, 4, base, 0, base, 0, err, 256) == 0  # bf16 at +2: a view
    assert chk(base + 2, base, 0, 4, 4, 4, base, 0, base, 0, err, 256) == 1  # fp32 at +2: not
    assert b"x pointer" in err.value and b"4 bytes for float32" in err.value
    assert chk(base, base, 1, 4, 4, 4, base + 2, 0, base, 0, err, 256) == 1
    assert b"dweight" in err.value
    assert chk(base, base, 1, 4, 4, 4, base, 0, base + 4, 3, err, 256) == 1  # fp64 bias at +4
    assert b"dbias" in err.value
    assert chk(base + 2, base, 0, 0, 4, 4, base, 0, None, 0, err, 256) == 0  # M = 0: x unread


def _places(capi, spec):
    kinds = (ctypes.c_int * 4)(*[k for k, _ in spec] + [0] * (4 - len(spec)))
    devs = (ctypes.c_int * 4)(*[d for _, d in spec] + [0] * (4 - len(spec)))
    err = ctypes.create_string_buffer(256)
    rc = capi.lib.pmg_check_places(kinds, devs, len(spec), err, len(err))
    return rc, err.value.decode()


def test_every_input_must_be_on_xs_device(capi):
    assert _places(capi, [(1, 1), (1, 1), (1, 1), (1, 1)]) == (0, "")
    assert _places(capi, [(0, 0), (0, 0), (0, 0)]) == (0, "")
    rc, msg = _places(capi, [(1, 0), (1, 1)])
    assert rc == 1 and msg.startswith("dout is on gpu:1 but x is on gpu:0")
    rc, msg = _places(capi, [(1, 0), (1, 0), (0, 0)])
    assert rc == 1 and "dweight is on cpu" in msg
    rc, msg = _places(capi, [(0, 0), (0, 0), (0, 0), (1, 3)])
    assert rc == 1 and "dbias is on gpu:3 but x is on cpu" in msg
    rc, msg = _places(capi, [(2, 0), (2, 0)])
    assert rc == 1 and "x is on an unsupported place" in msg


# ------------------------------------------------------------------ the binding's GPU branch
def _flow(
    capi,
    places=((1, 1), (1, 1), (1, 1), (1, 1)),
    has_dweight=True,
    has_bias=True,
    has_dbias=True,
    env=None,
    current=0,
    fail=0,
    in_dtype=1,
    shape=(2, 2, 2),
    report=False,
    **gpu,
):
    """The binding's GPU branch on the fake host, the core's steps on a fake GPU (`gpu`: fields
    of FakeGpuConfig) -> (rc, steps, error[, the core's report line])."""
    n = 2 + int(has_dweight) + int(has_bias and has_dbias)
    spec = list(places)[:n]
    kinds = (ctypes.c_int * 4)(*[k for k, _ in spec] + [0] * (4 - n))
    devs = (ctypes.c_int * 4)(*[d for _, d in spec] + [0] * (4 - n))
    trace, rep, err = (ctypes.create_string_buffer(2048) for _ in range(3))
    cfg = type(capi).FakeGpuConfig(**gpu)
    M, K, N = shape
    rc = capi.lib.pmg_fake_gpu_flow_ex(
        kinds,
        devs,
        int(has_dweight),
        int(has_bias),
        int(has_dbias),
        in_dtype,
        M,
        K,
        N,
        env,
        current,
        fail,
        ctypes.byref(cfg),
        trace,
        len(trace),
        rep,
        len(rep),
        err,
        len(err),
    )
    out = (rc, trace.value.decode().split(), err.value.decode())
    return out + (rep.value.decode(),) if report else out


def test_binding_enters_the_device_guard_before_stream_and_allocations(capi):
    """x on gpu:1 while the thread's current device is 0: the guard comes first, then the stream
    and the fresh outputs (on gpu:1), then the core, told gpu:1 and gpu:1's stream explicitly, with
    scratch from the host's allocator; the guard is released last."""
    rc, steps, err = _flow(capi, ((1, 1), (1, 1)), has_dweight=False, has_dbias=False, current=0)
    assert rc == 0, err
    assert steps[:5] == [
        "guard(1)",
        "stream(1)",
        "alloc-dweight(1)",
        "alloc-dbias(1)",
        "core(device=1,stream=1,bias=auto)",
    ]
    assert steps[5:7] == [
        "heuristic(epilogue,M=2,ws<=33554432)",
        "heuristic(plain,M=2,ws<=33554432)",
    ]
    assert steps[7] == "workspace(511@1)"  # 2 fp32 for BGRADA (256 bytes + 255 to align), gpu:1
    assert steps[8:] == ["launch(bias=epilogue,gemm_ws=0,splitk=1,splits=0)", "unguard(0)"]


def test_binding_accumulates_into_given_outputs_without_allocating(capi):
    rc, steps, _ = _flow(capi, current=1)
    assert rc == 0 and not [s for s in steps if s.startswith("alloc-")]
    assert steps[0] == "guard(1)" and steps[-1] == "unguard(1)"
    rc, steps, _ = _flow(capi, has_bias=False, current=1)  # no bias: nothing to allocate at all
    assert rc == 0 and not [s for s in steps if s.startswith(("alloc-", "workspace("))]


def test_binding_refuses_misplaced_inputs_before_touching_a_device(capi):
    rc, steps, err = _flow(capi, ((1, 1), (1, 1), (1, 0), (1, 1)))
    assert rc == 1 and steps == [] and "dweight is on gpu:0 but x is on gpu:1" in err
    rc, steps, err = _flow(capi, ((1, 0), (0, 0), (1, 0), (1, 0)))
    assert rc == 1 and steps == [] and "dout is on cpu" in err


def test_binding_reads_the_bias_setting_before_touching_a_device(capi):
    rc, steps, err = _flow(capi, env=b"kernel")
    assert rc == 0 and "core(device=1,stream=1,bias=kernel)" in steps
    rc, steps, err = _flow(capi, env=b"fused")
    assert rc == 1 and steps == [] and "PADDLE_MGRAD_CUDA_BIAS='fused'" in err


def test_binding_failures_stop_the_flow_where_they_happen(capi):
    rc, steps, err = _flow(capi, fail=1)  # the guard: no stream, no allocation, no core
    assert rc == 1 and steps == ["guard-failed"] and "gpu:1" in err
    rc, steps, err = _flow(capi, fail=2, current=0)  # Paddle's allocator said no
    assert rc == 1 and "could not allocate" in err and steps[-1] == "unguard(0)"
    assert steps[-2].startswith("workspace(") and not [s for s in steps if s.startswith("launch")]
    rc, steps, err = _flow(capi, fail=4, current=0)
    assert rc == 1 and err == "fake core failure" and steps[-1] == "unguard(0)"


def _plan_request(capi, path, M, K, N, gemm_ws, sms=132):
    out = (ctypes.c_int64 * 8)()
    capi.lib.pmg_plan_workspace(1, M, K, N, path, gemm_ws, sms, out)
    return out[7]


def test_fake_scratch_follows_the_path_chosen_after_the_heuristic(capi):
    """The fake GPU sizes scratch from the core's final plan -- the chosen
    algorithm's GEMM workspace plus the epilogue's buffer, or, when the heuristic's plain GEMM
    splits K, the bias kernel's partial sums -- not from the first bias choice."""
    M, K, N = 4096, 64, 64
    rc, steps, err = _flow(capi, shape=(M, K, N), gemm_workspace=4096)
    assert rc == 0 and f"workspace({_plan_request(capi, 1, M, K, N, 4096)}@1)" in steps, steps
    rc, steps, err, rep = _flow(
        capi,
        shape=(M, K, N),
        gemm_workspace=4096,
        report=True,
        plain_algo=21,
        plain_splitk=4,
        epi_waves=0.25,
        plain_waves=0.9,
    )
    kernel = _plan_request(capi, 2, M, K, N, 4096)
    assert rc == 0 and f"workspace({kernel}@1)" in steps and "bias=kernel" in rep, (steps, rep)
    assert [s for s in steps if s.startswith("launch")][0].startswith(
        "launch(bias=kernel,gemm_ws=4096,splitk=4"
    )
    rc, steps, err, rep = _flow(
        capi, shape=(M, K, N), sms=8, report=True, plain_splitk=4, plain_algo=21
    )  # fewer SMs: fewer slices, smaller scratch
    assert f"workspace({_plan_request(capi, 2, M, K, N, 0, sms=8)}@1)" in steps


def test_memory_pressure_through_the_hosts_allocator(capi):
    """The allocator cannot give cuBLASLt's workspace: the core re-plans without it and asks
    Paddle's allocator again, on the guarded device; report ws_retry=1."""
    M, K, N = 4096, 64, 64
    big, small = (_plan_request(capi, 1, M, K, N, ws) for ws in (1 << 22, 0))
    rc, steps, err, rep = _flow(
        capi, shape=(M, K, N), gemm_workspace=1 << 22, alloc_limit=small, report=True
    )
    assert rc == 0, err
    i = steps.index(f"alloc-failed({big})")
    assert steps[i + 1 : i + 3] == [
        "heuristic(epilogue,M=4096,ws<=0)",
        "heuristic(plain,M=4096,ws<=0)",
    ]
    assert steps[i + 3] == f"workspace({small}@1)" and "ws_retry=1" in rep
    rc, steps, err = _flow(capi, shape=(M, K, N), gemm_workspace=1 << 22, fail=2)  # none at all
    assert rc == 1 and "nor" in err and "without cuBLASLt workspace" in err
    assert len([s for s in steps if s.startswith("workspace(")]) == 2 and steps[-1] == "unguard(0)"


@pytest.mark.parametrize("bit,where", [(8, "allocate_outputs"), (16, "the core")])
def test_exception_inside_the_device_guard_restores_the_device(capi, bit, where):
    """Paddle's PD_CHECK and allocator throw: the guard's destructor restores the caller's
    device while the exception unwinds, and the exception's text reaches the caller."""
    rc, steps, err = _flow(capi, fail=bit, current=0)
    assert rc == 1 and err == f"exception: fake exception from {where}"
    assert steps[0] == "guard(1)" and steps[-2:] == ["throw", "unguard(0)"]
    assert not [s for s in steps if s.startswith(("launch", "workspace("))]


# ------------------------------------------------------------------ overlap linears
@pytest.fixture
def overlap_aid(monkeypatch):
    from paddle_mgrad.fleet import collective_overlap as co

    launches = []
    monkeypatch.setattr(co, "_on_gpu", lambda t: True)
    monkeypatch.setattr(co.paddle, "ones", lambda shape: launches.append(list(shape)))
    monkeypatch.setitem(co._state, "warned", False)
    return co, launches


def test_overlap_aid_warns_once_and_launches_unless_one_connection(monkeypatch, overlap_aid):
    co, launches = overlap_aid
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert co.let_collective_start(paddle.zeros([2])) and co.let_collective_start(
            paddle.zeros([2])
        )
    msgs = [str(m.message) for m in w if "CUDA_DEVICE_MAX_CONNECTIONS" in str(m.message)]
    assert len(msgs) == 1 and "export CUDA_DEVICE_MAX_CONNECTIONS=1" in msgs[0]
    assert launches == [[512], [512]]
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert not co.let_collective_start(paddle.zeros([2])) and len(launches) == 2
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert co.let_collective_start(paddle.zeros([2])) and len(launches) == 3


def test_overlap_aid_is_gpu_only(monkeypatch):
    from paddle_mgrad.fleet import collective_overlap as co

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    launches = []
    monkeypatch.setattr(co.paddle, "ones", lambda shape: launches.append(shape))
    assert not co.let_collective_start(paddle.zeros([2])) and launches == []  # CPU tensor


def test_overlapped_backward_lets_the_collective_start_before_dw(monkeypatch, overlap_aid):
    from paddle_mgrad.fleet import overlap_linear as ol

    co, launches = overlap_aid
    order = []
    monkeypatch.setattr(ol, "let_collective_start", lambda t: order.append("aid"))
    monkeypatch.setattr(ol, "weight_and_bias_grads", lambda *a: order.append("dW") or (None, None))

    class Task:
        def wait(self):
            order.append("wait")

    ol.grads_while(Task(), None, None, paddle.zeros([2]), None, None)
    assert order == ["aid", "dW", "wait"]
    order.clear()
    ol.grads_while(None, None, None, paddle.zeros([2]), None, None)  # no collective: no aid
    assert order == ["dW"]
