"""``pmg_fused_linear_bwd``: a float32/float64 CPU linear's whole backward in one op call
(issue 23).

dx = dout . W^T (new, Paddle's matmul kernel: equal to ``paddle.matmul`` bit for bit) and the
weight/bias gradients accumulated as ``pmg_fused_wgrad_add``
with multi_precision does; against a float64 numpy reference over shapes hypothesis draws
(3-D inputs, strided views, given or missing accumulators; M = 0 or N = 0 is refused before
anything is written: Paddle 2.6 rejects a zero-size output after the kernel ran).  A call the op
refuses writes nothing.  The portable build (no oneDNN) runs it in test_ops' CHECK.
"""
import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from paddle_mgrad import ops


@pytest.fixture(scope="module")
def run():
    if ops.load() is None:
        pytest.skip("C++ op not built")
    r = ops.cpu_runner("float32")
    assert r is not None
    return r


def _f32(a):
    return paddle.to_tensor(np.ascontiguousarray(a, dtype="float32"))


def _strided(a):
    """A non-contiguous view holding ``a`` (every other column of a wider buffer)."""
    wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), "float32")
    wide[..., ::2] = a
    return _f32(wide)[..., ::2]


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(lead=st.lists(st.integers(0, 9), min_size=1, max_size=2), k=st.integers(1, 70),
       n=st.integers(0, 70), bias=st.booleans(), given_acc=st.booleans(),
       strided=st.sampled_from(["none", "x", "dout", "weight"]), seed=st.integers(0, 2**31 - 1))
def test_matches_float64(run, lead, k, n, bias, given_acc, strided, seed):
    rs = np.random.RandomState(seed)
    x = rs.standard_normal(lead + [k]).astype("f4")
    dy = rs.standard_normal(lead + [n]).astype("f4")
    w = rs.standard_normal([k, n]).astype("f4")
    w0 = rs.standard_normal([k, n]).astype("f4")
    b0 = rs.standard_normal([n]).astype("f4")
    tx = _strided(x) if strided == "x" and k else _f32(x)
    tdy = _strided(dy) if strided == "dout" and n else _f32(dy)
    tw = _strided(w) if strided == "weight" and n else _f32(w)
    mg, mb = (_f32(w0), _f32(b0)) if given_acc else (None, None)
    m = int(np.prod(lead))
    if m == 0 or n == 0:  # zero-size outputs (Paddle 2.6 refuses them after the kernel ran):
        # refused, nothing written
        with pytest.raises(Exception, match="zero-size product"):
            run("pmg_fused_linear_bwd", tx, tdy, tw, mg, mb if bias else None, bias)
        if given_acc:
            np.testing.assert_array_equal(mg.numpy(), w0)
            np.testing.assert_array_equal(mb.numpy(), b0)
        return
    dx, dw, db = run("pmg_fused_linear_bwd", tx, tdy, tw, mg, mb if bias else None, bias)
    x2, y2 = x.reshape(m, k).astype("f8"), dy.reshape(m, n).astype("f8")
    assert list(dx.shape) == lead + [k] and dx.dtype == paddle.float32
    np.testing.assert_allclose(dx.numpy().reshape(m, k), y2 @ w.astype("f8").T,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(dx.numpy(), paddle.matmul(tdy, tw, transpose_y=True).numpy())
    base_w = w0.astype("f8") if given_acc else 0.0
    np.testing.assert_allclose(dw.numpy(), base_w + x2.T @ y2, rtol=1e-4, atol=1e-4)
    if given_acc:  # in place: the given accumulators are the outputs
        assert dw.data_ptr() == mg.data_ptr()
    if bias:
        base_b = b0.astype("f8") if given_acc else 0.0
        np.testing.assert_allclose(db.numpy(), base_b + y2.sum(0), rtol=1e-4, atol=1e-4)
        if given_acc:
            assert db.data_ptr() == mb.data_ptr()


def _refused_calls():
    x, dy, w = paddle.randn([4, 5]), paddle.randn([4, 3]), paddle.randn([5, 3])
    mg, mb = paddle.ones([5, 3]), paddle.ones([3])
    return {
        "weight shape": (x, dy, paddle.randn([3, 5]), mg, mb, True),
        "weight K": (x, dy, paddle.randn([6, 3]), mg, mb, True),
        "weight dtype": (x, dy, w.astype("float64"), mg, mb, True),
        "x dtype": (x.astype("float64"), dy.astype("float64"), w, mg, mb, True),
        "bfloat16": (x.astype("bfloat16"), dy.astype("bfloat16"), w.astype("bfloat16"), mg, mb,
                     True),
        "float64 accumulators for float32": (x, dy, w, mg.astype("float64"), None, False),
        "leading dims": (x, paddle.randn([5, 3]), w, mg, mb, True),
        "dweight shape": (x, dy, w, paddle.ones([3, 5]), mb, True),
        "dweight dtype": (x, dy, w, paddle.ones([5, 3], "float64"), mb, True),
        "dbias shape": (x, dy, w, mg, paddle.ones([5]), True),
        "dbias dtype": (x, dy, w, mg, paddle.ones([3], "bfloat16"), True),
    }


@pytest.mark.parametrize("case", sorted(_refused_calls()))
def test_a_refused_call_writes_nothing(run, case):
    args = _refused_calls()[case]
    accs = [a for a in args[3:5] if a is not None]
    before = [(a.data_ptr(), a.numpy().copy()) for a in accs]
    with pytest.raises(Exception, match="pmg_fused_linear_bwd|fused_linear_param_grad_add|must|differ"):
        run("pmg_fused_linear_bwd", *args)
    for a, (ptr, values) in zip(accs, before):
        assert a.data_ptr() == ptr
        np.testing.assert_array_equal(a.numpy(), values)


def test_float64(run):
    rs = np.random.RandomState(4)
    x, dy, w = (paddle.to_tensor(rs.standard_normal(s)) for s in ([2, 6, 5], [2, 6, 3], [5, 3]))
    mg, mb = paddle.ones([5, 3], "float64"), paddle.ones([3], "float64")
    dx, dw, db = run("pmg_fused_linear_bwd", x, dy, w, mg, mb, True)
    x2, y2 = x.numpy().reshape(12, 5), dy.numpy().reshape(12, 3)
    np.testing.assert_allclose(dx.numpy().reshape(12, 5), y2 @ w.numpy().T, rtol=1e-12)
    np.testing.assert_allclose(mg.numpy(), 1 + x2.T @ y2, rtol=1e-12)
    np.testing.assert_allclose(mb.numpy(), 1 + y2.sum(0), rtol=1e-12)
    assert dw.data_ptr() == mg.data_ptr() and db.data_ptr() == mb.data_ptr()
