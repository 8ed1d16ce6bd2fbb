"""Our op under Paddle's name: paddle._C_ops.fused_linear_param_grad_add while fused_linear is on."""

import numpy as np
import paddle
import pytest

import paddle_mgrad
from paddle_mgrad import registry, stats
from paddle_mgrad.fleet import c_ops

KEY = "_C_ops.fused_linear_param_grad_add"


def _ref(x, dy):
    x2 = x.numpy().astype("float64").reshape(-1, x.shape[-1])
    d2 = dy.numpy().astype("float64").reshape(-1, dy.shape[-1])
    return x2.T @ d2, d2.sum(0)


def test_plain_paddle_has_no_cpu_kernel():
    """Why the entry exists: Paddle's own op fails on CPU tensors."""
    x, dy = paddle.randn([4, 3]), paddle.randn([4, 5])
    with pytest.raises(Exception, match="not registered"):
        paddle._C_ops.fused_linear_param_grad_add(x, dy, None, None, True, False)


@pytest.mark.parametrize("has_bias", [False, True])
def test_paddle_name_runs_our_op_in_place(has_bias):
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    from paddle import _C_ops  # the form PaddleNLP's fused_layers.py uses

    x, dy = paddle.randn([2, 7, 3]), paddle.randn([2, 7, 5])
    dw0, db0 = paddle.randn([3, 5]), paddle.randn([5])
    dw, db = dw0.clone(), db0.clone()
    ptr_w, ptr_b = dw.data_ptr(), db.data_ptr()
    before = dict(stats.paddle_c_ops)
    out_w, out_b = _C_ops.fused_linear_param_grad_add(
        x, dy, dw, db if has_bias else None, True, has_bias
    )
    assert stats.paddle_c_ops["ours"] == before["ours"] + 1
    assert out_w.data_ptr() == ptr_w and dw.data_ptr() == ptr_w  # accumulated in place
    ref_w, ref_b = _ref(x, dy)
    np.testing.assert_allclose(dw.numpy(), dw0.numpy() + ref_w, rtol=1e-5, atol=1e-5)
    if has_bias:
        assert out_b.data_ptr() == ptr_b
        np.testing.assert_allclose(db.numpy(), db0.numpy() + ref_b, rtol=1e-5, atol=1e-5)
    else:
        assert out_b is None
        np.testing.assert_array_equal(db.numpy(), db0.numpy())
    # no accumulator given: a fresh fp32 one (first micro-step)
    fresh, _ = _C_ops.fused_linear_param_grad_add(
        x.astype("bfloat16"), dy.astype("bfloat16"), None, None, True, False
    )
    assert fresh.dtype == paddle.float32
    np.testing.assert_allclose(
        fresh.numpy(),
        _ref(x.astype("bfloat16").astype("float32"), dy.astype("bfloat16").astype("float32"))[0],
        rtol=2e-2,
        atol=2e-2,
    )


def test_bad_input_is_a_clear_error():
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    with pytest.raises(paddle_mgrad.FusedLinearError, match=r"dweight must be \[K, N\]"):
        paddle._C_ops.fused_linear_param_grad_add(
            paddle.randn([4, 3]), paddle.randn([4, 5]), paddle.zeros([5, 3]), None, True, False
        )


def test_other_places_go_to_paddles_kernel(monkeypatch):
    calls = []

    def paddle_op(*args):
        calls.append(args)
        return "paddle's"

    fn = c_ops.wrap_fused_linear_param_grad_add(paddle_op)
    x, dy = paddle.randn([4, 3]), paddle.randn([4, 5])
    before = dict(stats.paddle_c_ops)
    monkeypatch.setattr(c_ops, "_runs_here", lambda t: False)  # e.g. a GPU tensor
    assert fn(x, dy, None, None, True, False) == "paddle's"
    assert calls == [(x, dy, None, None, True, False)]
    assert stats.paddle_c_ops["paddle"] == before["paddle"] + 1
    monkeypatch.undo()
    assert c_ops._runs_here(x)  # CPU tensor in dynamic mode: ours
    fn(x, dy, None, None, True, False)
    assert len(calls) == 1 and stats.paddle_c_ops["ours"] == before["ours"] + 1


def test_disable_restores_paddles_object():
    original = paddle._C_ops.fused_linear_param_grad_add
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    assert paddle._C_ops.fused_linear_param_grad_add is not original
    assert paddle._C_ops.fused_linear_param_grad_add.__wrapped__ is original
    assert registry.original(KEY) is original
    paddle_mgrad.disable()
    assert paddle._C_ops.fused_linear_param_grad_add is original


def test_added_where_paddle_lacks_it_and_removed_again(monkeypatch):
    """A Paddle build without the attribute: enable adds it, disable deletes it."""
    monkeypatch.delattr(paddle._C_ops, "fused_linear_param_grad_add")
    assert registry.resolve_target(registry._BY_KEY[KEY]) is None
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    assert registry.is_installed(KEY)
    fn = paddle._C_ops.fused_linear_param_grad_add
    assert fn.__wrapped__ is None
    x, dy = paddle.randn([4, 3]), paddle.randn([4, 5])
    dw, _ = fn(x, dy, None, None, True, False)
    np.testing.assert_allclose(dw.numpy(), _ref(x, dy)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError):
        registry.original(KEY)
    paddle_mgrad.disable()
    assert not hasattr(paddle._C_ops, "fused_linear_param_grad_add")
