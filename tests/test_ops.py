"""The fused weight-gradient op against a float64 reference, in place, with bad input."""
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

DTYPES = ["float32", "bfloat16", "float16"]


def test_backend_is_compiled():
    """CI has a compiler: the C++ op must build (the fallback is tested separately)."""
    assert ops.backend().startswith("cpp-"), ops.fallback_reason()


def _as64(t):
    return t.astype("float32").numpy().astype("float64")


def _tol(dtype_out):
    # fp32 accumulation of K-long dot products; bf16/fp16 outputs round once.
    return {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3}[dtype_out]


def _check_close(got, want, scale, dtype_out):
    err = np.abs(got.astype("float32").numpy().astype("float64") - want)
    bound = _tol(dtype_out) * (scale + 1e-6)
    assert (err <= bound).all(), f"max err {err.max()} > bound {bound.max()}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lead=st.lists(st.integers(0, 9), min_size=1, max_size=2),
    K=st.integers(1, 40), N=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    give_w=st.booleans(), give_b=st.booleans(), has_bias=st.booleans(),
    multi_precision=st.booleans(), seed=st.integers(0, 2**16),
)
def test_matches_float64_reference(lead, K, N, dtype, give_w, give_b, has_bias,
                                   multi_precision, seed):
    rs = np.random.RandomState(seed)
    x = paddle.to_tensor(rs.standard_normal(lead + [K]).astype("float32")).astype(dtype)
    dy = paddle.to_tensor(rs.standard_normal(lead + [N]).astype("float32")).astype(dtype)
    acc = "float32" if multi_precision else dtype
    w0 = rs.standard_normal([K, N]).astype("float32")
    b0 = rs.standard_normal([N]).astype("float32")
    dw = paddle.to_tensor(w0).astype(acc) if give_w else None
    db = paddle.to_tensor(b0).astype(acc) if give_b else None
    w_ptr = dw.data_ptr() if give_w else None
    b_ptr = db.data_ptr() if give_b else None
    w_start = _as64(dw) if give_w else 0.0
    b_start = _as64(db) if give_b else 0.0

    out_w, out_b = ops.fused_linear_param_grad_add(x, dy, dw, db, multi_precision, has_bias)

    x2, y2 = _as64(x).reshape(-1, K), _as64(dy).reshape(-1, N)
    want_w = w_start + x2.T @ y2
    _check_close(out_w, want_w, np.abs(w_start) + np.abs(x2).T @ np.abs(y2), str(out_w.dtype).split(".")[-1])
    assert list(out_w.shape) == [K, N]
    if give_w:
        assert out_w is dw and out_w.data_ptr() == w_ptr  # in place
    else:
        assert out_w.dtype == (paddle.float32 if multi_precision else x.dtype)
    if not has_bias:
        assert out_b is None
        if give_b:
            np.testing.assert_array_equal(_as64(db), b_start)  # untouched
        return
    want_b = b_start + y2.sum(0)
    _check_close(out_b, want_b, np.abs(b_start) + np.abs(y2).sum(0), str(out_b.dtype).split(".")[-1])
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
    x = paddle.to_tensor(rs.standard_normal([5, 7, 33]).astype("float32")).astype(dtype)
    dy = paddle.to_tensor(rs.standard_normal([5, 7, 17]).astype("float32")).astype(dtype)
    w1, w2 = paddle.ones([33, 17]), paddle.ones([33, 17])
    b1, b2 = paddle.ones([17]), paddle.ones([17])
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
    ("unsupported dtype", lambda: (paddle.randn([3, 8]).astype("float64"),
                                   paddle.randn([3, 5]).astype("float64"), None, None, True, False),
     "float64"),
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
    for dtype in ("float32", "bfloat16", "float16"):
        x = paddle.to_tensor(rs.standard_normal([700, 37]).astype("float32")).astype(dtype)
        dy = paddle.to_tensor(rs.standard_normal([700, 530]).astype("float32")).astype(dtype)
        mg = paddle.ones([37, 530]); mb = paddle.ones([530])
        ops.fused_linear_param_grad_add(x, dy, mg, mb, True, True)
        x2 = x.astype("float32").numpy().astype("f8"); y2 = dy.astype("float32").numpy().astype("f8")
        np.testing.assert_allclose(mg.numpy(), 1 + x2.T @ y2, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(mb.numpy(), 1 + y2.sum(0), rtol=1e-4, atol=1e-3)
    print("OK")
"""


def test_portable_cpu_path_without_onednn(tmp_path):
    """The build for machines without oneDNN (blocked OpenMP GEMM) is correct too."""
    r = _run_isolated(CHECK, {"PADDLE_MGRAD_NO_ONEDNN": "1", "PADDLE_MGRAD_CACHE": str(tmp_path)})
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
