"""The fused weight-gradient op against a float64 reference, in place, with bad input."""
import contextlib
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paddle_mgrad import FusedLinearError, ops
from paddle_mgrad.ops import _reference

DTYPES = ["float32", "bfloat16", "float16", "float64"]
# Rows of bf16/fp16 widened per fp32 GEMM, forced through PADDLE_MGRAD_CPU_CHUNK_ROWS (the
# default, a 64 MiB budget in csrc/wgrad_cpu.cc, gives one chunk for every shape tested here).
CHUNK_ROWS = 512


def _mp(dtype):
    """Paddle's MPTypeTrait: the multi-precision accumulator of an input dtype."""
    return "float64" if dtype == "float64" else "float32"


@contextlib.contextmanager
def _env(name, value):
    """Set (value None: unset) an environment variable the C++ op reads on every call."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _bf16_path(path):
    """Force the CPU bf16 path."""
    return _env("PADDLE_MGRAD_CPU_BF16", path)


def _chunk_rows(rows):
    """Force the rows per widening chunk (None: the op's memory-budget default)."""
    return _env("PADDLE_MGRAD_CPU_CHUNK_ROWS", rows)


def test_backend_is_compiled():
    """CI has a compiler: the C++ op must build (the fallback is tested separately)."""
    assert ops.backend().startswith("cpp-"), ops.fallback_reason()


def _as64(t):
    if t.dtype == paddle.float64:
        return t.numpy()
    return t.astype("float32").numpy().astype("float64")


def _t(arr, dtype):
    """A paddle tensor of dtype from a numpy array (via float32 for 16-bit dtypes)."""
    arr = np.asarray(arr)
    if dtype == "float64":
        return paddle.to_tensor(arr.astype("float64"))
    return paddle.to_tensor(arr.astype("float32")).astype(dtype)


def _name(dt):
    return str(dt).split(".")[-1]


def _tol(dtype_out):
    # fp32 accumulation of K-long dot products; bf16/fp16 outputs round once.
    return {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3, "float64": 1e-12}[dtype_out]


def _check_close(got, want, scale, dtype_out):
    err = np.abs(_as64(got) - want)
    bound = _tol(dtype_out) * (scale + 1e-6)
    assert (err <= bound).all(), f"max err {err.max()} > bound {bound.max()}"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # small leading dims, and single ones around the widening chunk (1, 2 and 3 chunks)
    lead=st.one_of(st.lists(st.integers(0, 9), min_size=1, max_size=2),
                   st.integers(CHUNK_ROWS - 3, 2 * CHUNK_ROWS + 90).map(lambda m: [m])),
    K=st.integers(0, 40), N=st.integers(0, 40),
    dtype=st.sampled_from(DTYPES),
    give_w=st.booleans(), give_b=st.booleans(), has_bias=st.booleans(),
    multi_precision=st.booleans(), seed=st.integers(0, 2**16),
    bf16_path=st.sampled_from(["auto", "widen", "native"]),
    chunk_rows=st.sampled_from([None, CHUNK_ROWS, 7]),
)
def test_matches_float64_reference(lead, K, N, dtype, give_w, give_b, has_bias,
                                   multi_precision, seed, bf16_path, chunk_rows):
    with _bf16_path(bf16_path), _chunk_rows(chunk_rows):
        _matches_float64_reference(lead, K, N, dtype, give_w, give_b, has_bias, multi_precision,
                                   seed)


def _matches_float64_reference(lead, K, N, dtype, give_w, give_b, has_bias, multi_precision,
                               seed):
    rs = np.random.RandomState(seed)
    x = _t(rs.standard_normal(lead + [K]), dtype)
    dy = _t(rs.standard_normal(lead + [N]), dtype)
    acc = _mp(dtype) if multi_precision else dtype
    w0 = rs.standard_normal([K, N])
    b0 = rs.standard_normal([N])
    dw = _t(w0, acc) if give_w else None
    db = _t(b0, acc) if give_b else None
    w_ptr = dw.data_ptr() if give_w else None
    b_ptr = db.data_ptr() if give_b else None
    w_start = _as64(dw) if give_w else 0.0
    b_start = _as64(db) if give_b else 0.0

    out_w, out_b = ops.fused_linear_param_grad_add(x, dy, dw, db, multi_precision, has_bias)

    M = int(np.prod(lead))
    x2, y2 = _as64(x).reshape(M, K), _as64(dy).reshape(M, N)
    want_w = w_start + x2.T @ y2
    _check_close(out_w, want_w, np.abs(w_start) + np.abs(x2).T @ np.abs(y2), _name(out_w.dtype))
    assert list(out_w.shape) == [K, N]
    if give_w:
        assert out_w is dw and out_w.data_ptr() == w_ptr  # in place
    else:
        assert _name(out_w.dtype) == acc
    if not has_bias:
        assert out_b is None
        if give_b:
            np.testing.assert_array_equal(_as64(db), b_start)  # untouched
        return
    want_b = b_start + y2.sum(0)
    _check_close(out_b, want_b, np.abs(b_start) + np.abs(y2).sum(0), _name(out_b.dtype))
    if give_b:
        assert out_b is db and out_b.data_ptr() == b_ptr


def test_accumulates_over_calls_in_place():
    x = paddle.randn([64, 48])
    dy = paddle.randn([64, 32])
    mg = paddle.zeros([48, 32])
    ptr = mg.data_ptr()
    for _ in range(3):
        ops.fused_linear_param_grad_add(x, dy, mg, None, True, False)
    ref = 3 * x.numpy().astype("f8").T @ dy.numpy().astype("f8")
    np.testing.assert_allclose(mg.numpy(), ref, rtol=1e-5, atol=1e-4)
    assert mg.data_ptr() == ptr


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_fallback_gives_same_numbers(dtype, has_bias):
    rs = np.random.RandomState(3)
    x = _t(rs.standard_normal([5, 7, 33]), dtype)
    dy = _t(rs.standard_normal([5, 7, 17]), dtype)
    w1, w2 = paddle.ones([33, 17], _mp(dtype)), paddle.ones([33, 17], _mp(dtype))
    b1, b2 = paddle.ones([17], _mp(dtype)), paddle.ones([17], _mp(dtype))
    a = ops.fused_linear_param_grad_add(x, dy, w1, b1, True, has_bias)
    b = _reference.fused_linear_param_grad_add(x, dy, w2, b2, True, has_bias)
    np.testing.assert_allclose(a[0].numpy(), b[0].numpy(), rtol=1e-5, atol=1e-5)
    assert b[0].data_ptr() == w2.data_ptr()
    if has_bias:
        np.testing.assert_allclose(a[1].numpy(), b[1].numpy(), rtol=1e-5, atol=1e-5)
    # fresh buffers too
    a = ops.fused_linear_param_grad_add(x, dy, None, None, False, has_bias)
    b = _reference.fused_linear_param_grad_add(x, dy, None, None, False, has_bias)
    assert a[0].dtype == b[0].dtype == x.dtype
    np.testing.assert_allclose(a[0].astype("float32").numpy(), b[0].astype("float32").numpy(),
                               rtol=_tol(dtype), atol=_tol(dtype) * 10)


BAD = [
    ("1-D x", lambda: (paddle.randn([8]), paddle.randn([4]), None, None, True, False), "at least 2-D"),
    ("leading dims", lambda: (paddle.randn([3, 8]), paddle.randn([4, 5]), None, None, True, False),
     "[3, 8]"),
    ("K vs dweight", lambda: (paddle.randn([3, 8]), paddle.randn([3, 5]), paddle.zeros([7, 5]), None,
                              True, False), "[8, 5]"),
    ("N vs dweight", lambda: (paddle.randn([3, 8]), paddle.randn([3, 5]), paddle.zeros([8, 6]), None,
                              True, False), "[8, 5]"),
    ("N vs dbias", lambda: (paddle.randn([3, 8]), paddle.randn([3, 5]), None, paddle.zeros([4]),
                            True, True), "[5]"),
    ("dweight dtype", lambda: (paddle.randn([3, 8]).astype("bfloat16"),
                               paddle.randn([3, 5]).astype("bfloat16"),
                               paddle.zeros([8, 5]).astype("float16"), None, True, False), "float16"),
    ("unsupported dtype", lambda: (paddle.ones([3, 8], "int32"), paddle.ones([3, 5], "int32"), None,
                                   None, True, False), "int32"),
    # Paddle's MPTypeTrait<double> is double: fp64 inputs accumulate in fp64 only
    ("fp64 into fp32", lambda: (paddle.randn([3, 8], "float64"), paddle.randn([3, 5], "float64"),
                                paddle.zeros([8, 5]), None, True, False), "float64"),
    ("fp64 into fp32, no mp", lambda: (paddle.randn([3, 8], "float64"),
                                       paddle.randn([3, 5], "float64"), None, paddle.zeros([5]),
                                       False, True), "dbias must be float64"),
    ("fp32 into fp64", lambda: (paddle.randn([3, 8]), paddle.randn([3, 5]),
                                paddle.zeros([8, 5], "float64"), None, False, False),
     "dweight must be float32"),
    ("mixed dtypes", lambda: (paddle.randn([3, 8]), paddle.randn([3, 5]).astype("bfloat16"), None,
                              None, True, False), "same dtype"),
]


@pytest.mark.parametrize("name,make,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_clear_error(name, make, needle):
    with pytest.raises(FusedLinearError) as e:
        ops.fused_linear_param_grad_add(*make())
    assert needle in str(e.value)
    assert isinstance(e.value, ValueError)


def _run_isolated(code, env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=600)


CHECK = """
    import zlib, numpy as np, paddle
    from paddle_mgrad import ops
    print("BACKEND", ops.backend())
    rs = np.random.RandomState(0)
    for dtype in ("float32", "bfloat16", "float16", "float64"):
        acc = "float64" if dtype == "float64" else "float32"
        x = paddle.to_tensor(rs.standard_normal([700, 37]).astype(acc)).astype(dtype)
        dy = paddle.to_tensor(rs.standard_normal([700, 530]).astype(acc)).astype(dtype)
        mg = paddle.ones([37, 530], acc); mb = paddle.ones([530], acc)
        ops.fused_linear_param_grad_add(x, dy, mg, mb, True, True)
        x2 = x.astype(acc).numpy().astype("f8"); y2 = dy.astype(acc).numpy().astype("f8")
        np.testing.assert_allclose(mg.numpy(), 1 + x2.T @ y2, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(mb.numpy(), 1 + y2.sum(0), rtol=1e-4, atol=1e-3)
        # fresh output, three widening chunks: beta applies to the first chunk only
        fw, _ = ops.fused_linear_param_grad_add(
            paddle.concat([x, x]), paddle.concat([dy, dy]), None, None, True, False)
        np.testing.assert_allclose(fw.numpy(), 2 * x2.T @ y2, rtol=1e-4, atol=1e-3)
    print("OK")
"""


def test_portable_cpu_path_without_onednn(tmp_path):
    """The build for machines without oneDNN (blocked OpenMP GEMM) is correct too."""
    r = _run_isolated(CHECK, {"PADDLE_MGRAD_NO_ONEDNN": "1", "PADDLE_MGRAD_CACHE": str(tmp_path),
                              "PADDLE_MGRAD_CPU_CHUNK_ROWS": str(CHUNK_ROWS)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BACKEND cpp-portable" in r.stdout and "OK" in r.stdout


def test_forced_python_fallback_warns_nothing_and_works():
    r = _run_isolated(CHECK, {"PADDLE_MGRAD_OPS": "python"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BACKEND python" in r.stdout and "OK" in r.stdout


def test_failed_build_falls_back_with_one_warning(tmp_path):
    code = """
        import os, warnings, zlib
        import paddle
        from paddle_mgrad.ops import _build
        _build.CORE_SOURCES = ["does_not_exist.cc"]
        from paddle_mgrad import ops
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            b = ops.backend(); ops.backend()
            paddle.seed(0)
            x = paddle.randn([4, 3]); dy = paddle.randn([4, 2])
            dw, _ = ops.fused_linear_param_grad_add(x, dy, None, None, True, False)
        msgs = [str(m.message) for m in w if "paddle_mgrad" in str(m.message)]
        print("BACKEND", b, "WARNINGS", len(msgs), msgs[0][:200] if msgs else "")
        import numpy as np
        np.testing.assert_allclose(dw.numpy(), x.numpy().T @ dy.numpy(), rtol=1e-5, atol=1e-5)
        print("OK")
    """
    r = _run_isolated(code, {"PADDLE_MGRAD_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    # (on a CUDA Paddle the GPU tier follows: "python;gpu=paddle-fused")
    assert re.search(r"BACKEND python(;gpu=\S+)? WARNINGS 1 ", r.stdout) and "OK" in r.stdout, r.stdout


# ---------------------------------------------------------------- zero-size (issue 10.1)
ZERO_SHAPES = [(3, 2, 0), (4, 0, 3), (0, 2, 3), (2, 0, 0), (0, 0, 0), (0, 5, 0)]  # (M, K, N)


@pytest.mark.parametrize("M,K,N", ZERO_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("given", [False, True])
def test_zero_size_like_paddle(M, K, N, dtype, given):
    """K, N or M = 0: a given accumulator is returned unchanged (+0), a missing one is zeros
    [K, N] / [N] of the accumulator dtype; dbias += column sums of dy (K = 0 still has them)."""
    rs = np.random.RandomState(M * 100 + K * 10 + N)
    x, dy = _t(rs.standard_normal([M, K]), dtype), _t(rs.standard_normal([M, N]), dtype)
    acc = _mp(dtype)
    dw = _t(rs.standard_normal([K, N]), acc) if given else None
    db = _t(rs.standard_normal([N]), acc) if given else None
    w0 = _as64(dw) if given else np.zeros([K, N])
    b0 = _as64(db) if given else np.zeros([N])
    out_w, out_b = ops.fused_linear_param_grad_add(x, dy, dw, db, True, True)
    assert list(out_w.shape) == [K, N] and list(out_b.shape) == [N]
    assert _name(out_w.dtype) == _name(out_b.dtype) == acc
    if given:
        assert out_w is dw and out_b is db
    y2 = _as64(dy).reshape(M, N)
    np.testing.assert_allclose(_as64(out_w), w0 + _as64(x).reshape(M, K).T @ y2, atol=1e-5)
    np.testing.assert_allclose(_as64(out_b), b0 + y2.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,K,N", ZERO_SHAPES)
def test_zero_size_raw_op(M, K, N):
    """The C++ op itself takes zero-element (null-pointer) inputs.  Paddle 2.6's custom-op
    runtime rejects zero-size outputs, so there the wrapper computes K = 0 / N = 0 itself."""
    module = ops.load()
    x, dy = paddle.ones([M, K]), paddle.ones([M, N])
    dw, db = paddle.full([K, N], 2.0), paddle.full([N], 3.0)
    if paddle.__version__.startswith("2.") and K * N == 0:
        with pytest.raises(Exception, match="not initialized"):
            module.pmg_fused_wgrad_add(x, dy, dw, db, True, True)
        return
    out_w, out_b = module.pmg_fused_wgrad_add(x, dy, dw, db, True, True)
    np.testing.assert_array_equal(out_w.numpy(), np.full([K, N], 2.0 + M))
    np.testing.assert_array_equal(out_b.numpy(), np.full([N], 3.0 + M))
    fresh_w, fresh_b = module.pmg_fused_wgrad_add(x, dy, None, None, True, True)
    np.testing.assert_array_equal(fresh_w.numpy(), np.full([K, N], float(M)))
    np.testing.assert_array_equal(fresh_b.numpy(), np.full([N], float(M)))


def _linear_grads(fn, xn, wn, bn, dtype="float32", main_grad=False):
    # plain leaf tensors: Paddle 2.6's create_parameter refuses zero-size shapes
    x = paddle.to_tensor(xn.astype(dtype), stop_gradient=False)
    w = paddle.to_tensor(wn.astype(dtype), stop_gradient=False)
    b = None if bn is None else paddle.to_tensor(bn.astype(dtype), stop_gradient=False)
    if main_grad:
        w.main_grad = None
    y = fn(x, w, b)
    (y * y).sum().backward() if y.size else y.sum().backward()
    grad_w = w.main_grad if main_grad else w.grad
    return y.numpy(), x.grad.numpy(), (None if grad_w is None else grad_w.numpy()), \
        (None if b is None else b.grad.numpy()), (None if grad_w is None else grad_w.dtype)


@pytest.mark.parametrize("xs,ws", [([3, 2], [2, 0]), ([4, 3, 2], [2, 0]), ([0, 4], [4, 3]),
                                   ([3, 0], [0, 5])])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_linear_zero_size_matches_paddle(xs, ws, with_bias):
    """Paddle's TestLinearAPI_ZeroSize (weight [2, 0]) and other zero-size linears give
    Paddle's outputs and gradients through paddle_mgrad.fused_linear."""
    import paddle.nn.functional as F
    from paddle_mgrad import fused_linear

    rs = np.random.RandomState(0)
    xn, wn = rs.standard_normal(xs), rs.standard_normal(ws)
    bn = rs.standard_normal([ws[1]]) if with_bias else None
    try:
        want = _linear_grads(F.linear, xn, wn, bn)
    except ValueError as e:  # Paddle 2.6's matmul rejects zero-size operands: so must we
        assert paddle.__version__.startswith("2."), e
        with pytest.raises(type(e), match="dims size must not be equal 0"):
            _linear_grads(fused_linear, xn, wn, bn)
        return
    ours = _linear_grads(fused_linear, xn, wn, bn)
    for got, ref in zip(ours[:4], want[:4]):
        if ref is None:
            assert got is None
        else:
            assert got.shape == ref.shape
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert ours[4] == want[4]
    # into main_grad (allocated fp32 on the parameter at the first micro-step)
    mg = _linear_grads(fused_linear, xn, wn, bn, main_grad=True)
    assert list(mg[2].shape) == ws and mg[4] == paddle.float32
    np.testing.assert_allclose(mg[2], want[2], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- float64 (issue 10.3)
@pytest.mark.parametrize("M,K,N", [(300, 200, 1030), (257, 97, 9), (1, 7, 1), (5, 1, 2049)])
@pytest.mark.parametrize("given", [False, True])
def test_float64_across_gemm_blocks(M, K, N, given):
    """The fp64 GEMM's blocking (256-deep slices, 96-row blocks, 1024-wide panels, 6x8 tiles,
    ragged edges) against numpy in float64, in place or fresh, with bias."""
    rs = np.random.RandomState(M + K + N)
    xn, yn = rs.standard_normal([M, K]), rs.standard_normal([M, N])
    w0, b0 = rs.standard_normal([K, N]), rs.standard_normal([N])
    dw = paddle.to_tensor(w0) if given else None
    db = paddle.to_tensor(b0) if given else None
    ptr = dw.data_ptr() if given else None
    out_w, out_b = ops.fused_linear_param_grad_add(paddle.to_tensor(xn), paddle.to_tensor(yn),
                                                   dw, db, True, True)
    assert out_w.dtype == out_b.dtype == paddle.float64  # MPTypeTrait<double> is double
    if given:
        assert out_w is dw and out_w.data_ptr() == ptr
    start_w, start_b = (w0, b0) if given else (0.0, 0.0)
    scale = np.abs(start_w) + np.abs(xn).T @ np.abs(yn)
    assert (np.abs(out_w.numpy() - (start_w + xn.T @ yn)) <= 1e-13 * (scale + 1)).all()
    np.testing.assert_allclose(out_b.numpy(), start_b + yn.sum(0), rtol=1e-12, atol=1e-12)


# M (reduction, 256-deep slices), K (rows of C: 96-row blocks, 6-row strips), N (columns of C:
# 1024-wide panels, 8-column strips); none a multiple of any block: every last slice, block,
# panel and strip is ragged (M=259: a 3-deep slice; K=97: a 1-row block; N=1030: a 6-wide
# panel, 513/203/1043: 1-deep slice, 11-row block = 6 + 5, 19-wide panel = 8 + 8 + 3).
@pytest.mark.parametrize("M,K,N", [(259, 97, 1030), (513, 203, 1043), (7, 5, 3)])
@pytest.mark.parametrize("given", [False, True], ids=["fresh", "in_place"])
@pytest.mark.parametrize("kernel", [None, "generic"], ids=["cpu_kernel", "generic_kernel"])
def test_float64_packing_edges(M, K, N, given, kernel):
    """fp64 GEMM strip packing at every ragged edge, against float64 numpy: each C entry is
    checked (an edge row or column lost or shifted in packing shows), in place or fresh, with
    the micro-kernel this CPU picks and with the portable one (PADDLE_MGRAD_CPU_FP64_KERNEL)."""
    with _env("PADDLE_MGRAD_CPU_FP64_KERNEL", kernel):
        _float64_packing_edges(M, K, N, given)


def _float64_packing_edges(M, K, N, given):
    rs = np.random.RandomState(M * K + N)
    xn = rs.uniform(0.5, 1.5, [M, K]) * rs.choice([-1.0, 1.0], [M, K])
    yn = rs.uniform(0.5, 1.5, [M, N]) * rs.choice([-1.0, 1.0], [M, N])
    w0 = rs.standard_normal([K, N])
    dw = paddle.to_tensor(w0) if given else None
    ptr = dw.data_ptr() if given else None
    out_w, _ = ops.fused_linear_param_grad_add(paddle.to_tensor(xn), paddle.to_tensor(yn), dw,
                                               None, False, False)
    assert out_w.dtype == paddle.float64 and list(out_w.shape) == [K, N]
    if given:
        assert out_w is dw and out_w.data_ptr() == ptr
    want = (w0 if given else 0.0) + xn.T @ yn
    bound = 1e-13 * (np.abs(xn).T @ np.abs(yn) + (np.abs(w0) if given else 0.0) + 1)
    err = np.abs(out_w.numpy() - want)
    bad = np.argwhere(err > bound)
    assert bad.size == 0, f"{len(bad)} wrong entries of C [{K}, {N}], first at {bad[:5].tolist()}"


@pytest.mark.parametrize("transpose_weight", [False, True])
def test_fused_linear_float64_matches_autograd(transpose_weight):
    """float64 parameters through the fused linear: x, weight and bias gradients equal plain
    autograd's in float64 (the bias gradient is summed in float64 too)."""
    from paddle_mgrad.linear import FusedLinearWithGradAdd

    rs = np.random.RandomState(1)
    xn = rs.standard_normal([3, 5, 7])
    wn = rs.standard_normal([11, 7] if transpose_weight else [7, 11]) * 1e3
    bn = rs.standard_normal([11])
    got = []
    for fused in (True, False):
        x = paddle.to_tensor(xn, stop_gradient=False)
        w = paddle.to_tensor(wn, stop_gradient=False)
        b = paddle.to_tensor(bn, stop_gradient=False)
        y = (FusedLinearWithGradAdd.apply(x, w, b, transpose_weight) if fused
             else paddle.matmul(x, w, transpose_y=transpose_weight) + b)
        (y * y).sum().backward()
        got.append((x.grad, w.grad, b.grad))
    for a, b in zip(*got):
        assert a.dtype == b.dtype == paddle.float64
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-9)


# ---------------------------------------------------------------- bf16/fp16 paths (10.4, 10.5)
def test_bf16_path_is_observable_and_forceable():
    info = ops.cpu_info()
    assert info["bf16_path"] == ("onednn-bf16" if info["native_bf16"] else "widen-sgemm")
    with _bf16_path("widen"):
        assert ops.cpu_info()["bf16_path"] == "widen-sgemm"
    with _bf16_path("native"):
        assert ops.cpu_info()["bf16_path"] == "onednn-bf16"
    with _bf16_path("bogus"):
        assert ops.cpu_info()["bf16_path"] == "invalid PADDLE_MGRAD_CPU_BF16"
        x = paddle.ones([4, 3]).astype("bfloat16")
        with pytest.raises(Exception, match="PADDLE_MGRAD_CPU_BF16 must be auto, native or widen"):
            ops.fused_linear_param_grad_add(x, x, None, None, True, False)


@pytest.mark.parametrize("dtype,path", [("bfloat16", "widen"), ("bfloat16", "native"),
                                        ("bfloat16", "auto"), ("float16", "auto")])
@pytest.mark.parametrize("M", [CHUNK_ROWS + 1, 2 * CHUNK_ROWS + 300])
@pytest.mark.parametrize("acc", ["float32", "same"])
def test_fresh_output_over_several_chunks(dtype, path, M, acc):
    """A fresh (None) accumulator filled from more than one widening chunk: only the first
    chunk may apply beta = 0, later chunks accumulate (a per-chunk beta loses all but the
    last chunk).  Positive data, so the lost chunks cannot cancel."""
    rs = np.random.RandomState(M)
    x, dy = _t(rs.uniform(0.5, 1.0, [M, 24]), dtype), _t(rs.uniform(0.5, 1.0, [M, 40]), dtype)
    mp = acc == "float32"
    with _bf16_path(path), _chunk_rows(CHUNK_ROWS):
        out_w, out_b = ops.fused_linear_param_grad_add(x, dy, None, None, mp, True)
    x2, y2 = _as64(x), _as64(dy)
    out_dtype = "float32" if mp else dtype
    _check_close(out_w, x2.T @ y2, x2.T @ y2, out_dtype)
    _check_close(out_b, y2.sum(0), y2.sum(0), out_dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_default_chunking_of_a_wide_output(dtype):
    """Without PADDLE_MGRAD_CPU_CHUNK_ROWS the op picks rows by a 64 MiB budget
    (rows * (K + N) * 4 bytes, at least 256): K + N = 65536 gives 256-row chunks, so 600
    rows are 3 equal chunks into a fresh accumulator, then accumulated onto it."""
    rs = np.random.RandomState(3)
    M, K, N = 600, 8, 65528
    x, dy = _t(rs.uniform(0.5, 1.0, [M, K]), dtype), _t(rs.uniform(0.5, 1.0, [M, N]), dtype)
    with _bf16_path("widen"), _chunk_rows(None):
        out_w, _ = ops.fused_linear_param_grad_add(x, dy, None, None, True, False)
        want = _as64(x).T @ _as64(dy)
        _check_close(out_w, want, want, "float32")
        ptr = out_w.data_ptr()
        ops.fused_linear_param_grad_add(x, dy, out_w, None, True, False)
    assert out_w.data_ptr() == ptr
    _check_close(out_w, 2 * want, 2 * want, "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_same_precision_weight_grad_around_the_scratch_budget(dtype):
    """multi_precision=False: dW is accumulated in fp32 and rounded once.  A K x N product
    over 64 MiB goes through a one-shot buffer, a smaller one through the thread's kept
    scratch; interleaved calls of both sizes, in place, each against float64."""
    rs = np.random.RandomState(5)
    shapes = [(3, 4096, 4100), (5, 24, 40), (3, 4096, 4100), (7, 40, 24)]  # 16.8M > 64 MiB/4
    for M, K, N in shapes:
        x, dy = _t(rs.uniform(0.5, 1.0, [M, K]), dtype), _t(rs.uniform(0.5, 1.0, [M, N]), dtype)
        dw = _t(rs.uniform(0.5, 1.0, [K, N]), dtype)
        start, ptr = _as64(dw), dw.data_ptr()
        with _bf16_path("widen"), _chunk_rows(None):
            out_w, _ = ops.fused_linear_param_grad_add(x, dy, dw, None, False, False)
        assert out_w is dw and out_w.data_ptr() == ptr
        prod = _as64(x).T @ _as64(dy)
        _check_close(out_w, start + prod, start + prod, dtype)


def _every_half(dtype):
    """All 65536 bf16/fp16 bit patterns (zeros, subnormals, normals, infs, NaNs) as float32."""
    bits = np.arange(65536, dtype=np.uint32)
    if dtype == "float16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float32)
    return (bits << 16).view(np.float32)


def _round_half(f32, dtype):
    """float32 -> bf16/fp16 round-to-nearest-even (numpy's for fp16; by bits for bf16), as
    float32 values.  Overflow rounds to inf; NaN stays NaN."""
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return f32.astype(np.float16).astype(np.float32)
    u = f32.view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(f32), np.float32(np.nan), r)


def _same_values(got, want):
    nan = np.isnan(want)
    bad = (np.isnan(got) != nan) | (~nan & (got != want))
    return int(bad.sum()), [(float(want[i]), float(got[i])) for i in np.nonzero(bad)[0][:4]]


@pytest.mark.parametrize("dtype,path", [("float16", "auto"), ("bfloat16", "widen"),
                                        ("bfloat16", "native")])
def test_every_half_bit_pattern_widens_and_rounds_exactly(dtype, path):
    """Every bf16/fp16 bit pattern is read exactly (dW through the widening or native GEMM,
    db through the scalar loads: fp16's F16C and portable conversions both run), and a
    same-precision result (multi_precision=False) is the fp32 sum rounded once to nearest
    even: sums of random pairs of all patterns (ties, overflow to inf, subnormals, NaN)."""
    v = _every_half(dtype)
    row = paddle.to_tensor(v.reshape(1, -1)).astype(dtype)
    one = paddle.ones([1, 1], dtype=dtype)
    with _bf16_path(path):
        dw, _ = ops.fused_linear_param_grad_add(row, one, None, None, True, False)  # x^T . 1
        _, db = ops.fused_linear_param_grad_add(one, row, None, None, True, True)   # sum_m dy
    for got in (dw, db):
        assert _name(got.dtype) == "float32"
        assert _same_values(got.numpy().reshape(-1), v) == (0, [])

    # Rounding once: db = the fp32 sum of two rows (random pairs of all patterns), dW = exact
    # fp32 products of an outer product whose factors (random patterns plus powers of two and
    # small odd multiples) land on ties, the subnormal range and the overflow edge.
    rs = np.random.RandomState(0)
    a, b = v, v[rs.permutation(v.size)]
    with np.errstate(over="ignore", invalid="ignore"):
        want_db = _round_half(a + b, dtype)
    dy = paddle.to_tensor(np.stack([a, b])).astype(dtype)
    with _bf16_path(path):
        _, db = ops.fused_linear_param_grad_add(paddle.ones([2, 1], dtype=dtype), dy, None,
                                                None, False, True)
    crafted = np.array([s * m * 2.0 ** e for s in (1, -1) for m in (1, 3, 19, 151, 431)
                        for e in range(-24, 16, 3)], np.float32)
    crafted = crafted[np.isfinite(_round_half(crafted, dtype))]
    crafted = crafted[_round_half(crafted, dtype) == crafted]  # exactly representable
    finite = v[np.isfinite(v)]
    f = np.concatenate([crafted, rs.choice(finite, 512 - crafted.size)])
    g = np.concatenate([crafted[::3], rs.choice(finite, 128 - crafted[::3].size)])
    with np.errstate(over="ignore", invalid="ignore"):
        want_dw = _round_half(f[:, None] * g[None, :], dtype).reshape(-1)  # exact in fp32
    with _bf16_path(path):
        dw, _ = ops.fused_linear_param_grad_add(paddle.to_tensor(f[None]).astype(dtype),
                                                paddle.to_tensor(g[None]).astype(dtype), None,
                                                None, False, False)
    for got, want in ((db, want_db), (dw, want_dw)):
        assert _name(got.dtype) == dtype
        assert _same_values(got.astype("float32").numpy().reshape(-1), want) == (0, [])


@pytest.mark.parametrize("value", ["0", "-3", "12x", "abc"])
def test_bad_chunk_rows_env_is_a_clear_error(value):
    x = paddle.ones([4, 3]).astype("bfloat16")
    with _bf16_path("widen"), _chunk_rows(value):
        with pytest.raises(Exception, match=f"PADDLE_MGRAD_CPU_CHUNK_ROWS must be a positive "
                                            f"integer, got '{value}'"):
            ops.fused_linear_param_grad_add(x, x, None, None, True, False)
    with _chunk_rows(""):  # empty: the default, like an unset variable
        w, _ = ops.fused_linear_param_grad_add(x, x, None, None, True, False)
    np.testing.assert_array_equal(w.numpy(), np.full([3, 3], 4.0))


# ---------------------------------------------------------------- the C ABI (Paddle-free)
def test_c_api_zero_size_null_pointers_and_float64(tmp_path):
    """pmg_wgrad_cpu_c: zero-element inputs may be null (the core reads only what it needs),
    a null pointer that would be read is a clear error, fp64 (code 3) accumulates in fp64,
    and the accumulator rule is enforced by the core's one check."""
    import ctypes

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu"))
    try:
        import bench_wgrad_gpu as gpu
    finally:
        sys.path.pop(0)
    core = gpu.Core(gpu.build(str(tmp_path), cuda=False), cuda=False)
    err = ctypes.create_string_buffer(512)

    def call(x, dy, in_t, M, K, N, dw, dw_t, db, db_t, beta=1.0):
        ptr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
        return core.lib.pmg_wgrad_cpu_c(ptr(x), ptr(dy), in_t, M, K, N, ptr(dw), dw_t, beta,
                                        ptr(db), db_t, beta, err, len(err))

    dy = np.ones([4, 3], "float32")
    db = np.full([3], 2.0, "float32")
    assert call(None, dy, 0, 4, 0, 3, None, 0, db, 0) == 0, err.value  # K = 0: x never read
    np.testing.assert_array_equal(db, np.full([3], 6.0))
    guard = np.full([2], 7.0, "float32")  # K = 0 with a non-null dW: nothing written or read
    assert call(None, dy, 0, 4, 0, 3, guard, 0, None, 0) == 0, err.value
    np.testing.assert_array_equal(guard, [7.0, 7.0])
    assert call(None, None, 0, 0, 5, 3, np.ones([5, 3], "float32"), 0, db, 0) == 0, err.value
    assert call(None, dy, 0, 4, 5, 3, np.ones([5, 3], "float32"), 0, None, 0) == 1
    assert b"null input pointer x" in err.value
    rs = np.random.RandomState(0)
    x64, y64, w64 = rs.standard_normal([70, 13]), rs.standard_normal([70, 9]), np.ones([13, 9])
    b64 = np.ones([9])
    assert call(x64, y64, 3, 70, 13, 9, w64, 3, b64, 3) == 0, err.value
    np.testing.assert_allclose(w64, 1 + x64.T @ y64, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(b64, 1 + y64.sum(0), rtol=1e-13, atol=1e-13)
    assert call(x64, y64, 3, 70, 13, 9, np.ones([13, 9], "float32"), 0, None, 0) == 1
    assert b"dweight is float32; it must be float64" in err.value
    assert call(dy, dy, 0, 4, 3, 3, np.ones([3, 3]), 3, None, 0) == 1
    assert b"dweight is float64; it must be float32" in err.value
