"""``ctx.save_for_backward`` of non-tensor objects while paddle_mgrad is on.

While saved-tensor hooks are active (non-reentrant recompute), Paddle 3.3.1 and 2.6.2 accept
only tensors in ``save_for_backward`` (2.6 not even None): PaddleFormers 1.2.0's
``LMHeadFunction`` saves ``(x, weight, transpose_y)`` -- a Python bool -- and fails with
``ValueError: save_for_backward only support Tensor, list of Tensor, tuple of Tensor``.  The
registry entry ``PyLayerContext.save_for_backward`` (installed by ``enable()`` and by the
first non-reentrant recompute) keeps non-tensor objects on the context and hands them back
from ``saved_tensor()`` unchanged, on both versions, in every mode; tensors keep their
guarantees (a parameter comes back as the very object, with ``main_grad``).
"""

import numpy as np
import paddle
import pytest
from paddle.autograd import PyLayer
from paddle.distributed.fleet.utils import recompute as native_recompute

import paddle_mgrad
from helpers import run_probe_script
from paddle_mgrad import registry

MODES = ["none", "non_reentrant", "reentrant"]
PADDLE_REFUSES = "save_for_backward only support Tensor, list of Tensor, tuple of Tensor"


def _run(mode, fn, *args):
    if mode == "none":
        return fn(*args)
    return paddle_mgrad.recompute(fn, *args, use_reentrant=(mode == "reentrant"))


# ------------------------------------------------------------------ any objects
def _objects(x, w):
    """What the PyLayer saves: tensors and Python objects, nested."""
    return (
        x,
        True,
        3,
        2.5,
        None,
        "name",
        w,
        (1, (None, "a"), (x, False)),
        [x, 7],
        {"scale": 0.5, "t": x},
    )


class _SavesObjects(PyLayer):
    got = {}

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(*_objects(x, w))
        return paddle.matmul(x, w)

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensor()
        _SavesObjects.got["saved"] = saved
        x, w = saved[0], saved[6]
        w.main_grad = paddle.matmul(x, dy, transpose_x=True)
        return paddle.matmul(dy, w, transpose_y=True), None


def _same(a, b, w):
    """``a`` (what saved_tensor returned) equals ``b`` (what was saved): same types and
    structure, equal Python values, tensors with equal values; the parameter itself."""
    if b is w:
        return a is w
    if isinstance(b, paddle.Tensor):
        return isinstance(a, paddle.Tensor) and np.array_equal(a.numpy(), b.numpy())
    if type(b) in (tuple, list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y, w) for x, y in zip(a, b))
    if type(b) is dict:
        return type(a) is dict and a.keys() == b.keys() and all(_same(a[k], b[k], w) for k in b)
    return type(a) is type(b) and a == b if b is not None else a is None


@pytest.mark.parametrize("mode", MODES)
def test_saved_objects_come_back_unchanged(mode):
    paddle_mgrad.enable(recompute=True)
    paddle.seed(4)
    w = paddle.create_parameter([8, 4], "float32")
    w.main_grad = None
    x = paddle.randn([3, 8])
    x.stop_gradient = False
    _SavesObjects.got.clear()
    y = _run(mode, lambda t: paddle.tanh(_SavesObjects.apply(t * 1.0, w)), x)
    y.sum().backward()
    saved = _SavesObjects.got["saved"]
    want = _objects(x * 1.0, w)
    assert type(saved) is tuple and len(saved) == len(want)
    for i, (a, b) in enumerate(zip(saved, want)):
        assert _same(a, b, w), f"entry {i}: saved {b!r}, got back {a!r}"
    assert w.main_grad is not None  # written on the real parameter
    xn, wn = x.numpy().astype("f8"), w.numpy().astype("f8")
    dy = 1 - np.tanh(xn @ wn) ** 2
    np.testing.assert_allclose(w.main_grad.numpy(), xn.T @ dy, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("obj", [True, 3, "s", (1, None)], ids=["bool", "int", "str", "tuple"])
def test_paddle_alone_refuses_them_under_hooks(obj):
    """Plain Paddle (both versions; paddle_mgrad off) under its own non-reentrant recompute:
    the ValueError the PaddleFormers user met.  Asserted so that a Paddle fix shows."""

    class P(PyLayer):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, obj)
            return x * 2

        @staticmethod
        def backward(ctx, dy):
            return dy * 2

    x = paddle.randn([3])
    x.stop_gradient = False
    assert not registry.is_installed("PyLayerContext.save_for_backward")
    with pytest.raises(ValueError, match=PADDLE_REFUSES):
        native_recompute(
            lambda t: P.apply(t * 1.0), x, use_reentrant=False, preserve_rng_state=False
        )


def test_installed_by_enable_with_either_feature_and_removed_by_disable():
    from paddle.autograd.py_layer import PyLayerContext

    before = (PyLayerContext.save_for_backward, PyLayerContext.saved_tensor)
    for kw in ({"recompute": True}, {"recompute": False, "fused_linear": True}):
        paddle_mgrad.enable(**kw)
        assert registry.is_installed("PyLayerContext.save_for_backward"), kw
        assert registry.is_installed("PyLayerContext.saved_tensor"), kw
        paddle_mgrad.disable()
        assert (PyLayerContext.save_for_backward, PyLayerContext.saved_tensor) == before


def test_tensor_only_saves_go_to_paddle_unchanged():
    """All-tensor saves (the common case) take Paddle's own path: what saved_tensor returns
    is exactly what Paddle returns (no layout kept on the context)."""
    paddle_mgrad.enable(recompute=True)
    seen = {}

    class P(PyLayer):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, x * 2)
            seen["layout"] = hasattr(ctx, "_paddle_mgrad_saved_layout")
            return x * 3

        @staticmethod
        def backward(ctx, dy):
            seen["saved"] = ctx.saved_tensor()
            return dy * 3

    x = paddle.randn([3])
    x.stop_gradient = False
    P.apply(x).sum().backward()
    assert seen["layout"] is False
    assert type(seen["saved"]) is tuple and len(seen["saved"]) == 2
    np.testing.assert_array_equal(seen["saved"][0].numpy(), x.numpy())  # in the order saved
    np.testing.assert_array_equal(seen["saved"][1].numpy(), 2 * x.numpy())
    np.testing.assert_array_equal(x.grad.numpy(), np.full([3], 3, "float32"))


def test_user_saved_tensors_hooks_with_non_tensors():
    """Paddle's own paddle.autograd.saved_tensors_hooks (not recompute) gets the same
    treatment while paddle_mgrad is on."""
    paddle_mgrad.enable(recompute=True)
    packed = []

    class P(PyLayer):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, False, None)
            return x * 2

        @staticmethod
        def backward(ctx, dy):
            x, flag, nothing = ctx.saved_tensor()
            assert flag is False and nothing is None and isinstance(x, paddle.Tensor)
            return dy * 2

    x = paddle.randn([3])
    x.stop_gradient = False
    with paddle.autograd.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        y = P.apply(x * 1.0)
    y.sum().backward()
    assert packed  # the hooks ran for the tensors
    np.testing.assert_allclose(x.grad.numpy(), np.full([3], 2.0))


# ------------------------------------------------------- PaddleFormers' LM head
class LMHeadFunction(PyLayer):
    """PaddleFormers 1.2.0 (``cli/train/deepseek_v3_pretrain/modeling.py``) style: saves a
    Python bool; the weight gradient goes in place into ``weight.main_grad`` through
    ``_C_ops.fused_linear_param_grad_add`` -- ``(dout, x)`` for a weight stored transposed
    ``[vocab, hidden]``, ``(x, dout)`` for ``[hidden, vocab]``.  (PaddleFormers also casts
    ``dout`` to bf16, for the GPU kernel; CPU Paddle has no bf16 matmul, so fp32 here.)"""

    @staticmethod
    def forward(ctx, x, weight, transpose_y):
        out = paddle.matmul(x, weight, transpose_y=transpose_y)
        ctx.save_for_backward(x, weight, transpose_y)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, transpose_y = ctx.saved_tensor()
        dx = paddle.matmul(dout, weight, transpose_y=not transpose_y)
        d2 = dout.reshape([-1, dout.shape[-1]])
        x2 = x.reshape([-1, x.shape[-1]])
        with paddle.amp.auto_cast(False):
            if transpose_y:
                paddle._C_ops.fused_linear_param_grad_add(
                    d2, x2, weight.main_grad, None, True, False
                )
            else:
                paddle._C_ops.fused_linear_param_grad_add(
                    x2, d2, weight.main_grad, None, True, False
                )
        return dx, None


H, V = 8, 12


def _lm_head_run(mode, transpose_y, weight_as_arg, data):
    paddle.seed(21)
    hidden = paddle.nn.Linear(H, H)
    shape = [V, H] if transpose_y else [H, V]
    weight = paddle.create_parameter(shape, "float32")
    weight.main_grad = paddle.zeros(shape, "float32")
    ptr = weight.main_grad.data_ptr()

    def block(x, *w):
        return LMHeadFunction.apply(paddle.tanh(hidden(x)), w[0] if w else weight, transpose_y)

    for x in data:
        xt = paddle.to_tensor(x, stop_gradient=False)  # hidden states of earlier layers
        args = (xt, weight) if weight_as_arg else (xt,)
        logits = _run(mode, block, *args)
        (logits * logits).sum().backward()
    assert weight.main_grad.data_ptr() == ptr, "main_grad was replaced, not updated in place"
    assert weight.grad is None
    return hidden, weight


def _lm_head_reference(transpose_y, data):
    """float64 numpy: sum over micro-steps of d(sum(logits^2))/dW."""
    paddle.seed(21)
    hidden = paddle.nn.Linear(H, H)
    shape = [V, H] if transpose_y else [H, V]
    w = paddle.create_parameter(shape, "float32").numpy().astype("f8")
    wh, bh = hidden.weight.numpy().astype("f8"), hidden.bias.numpy().astype("f8")
    dw, dwh = 0, 0
    for x in data:
        x2 = x.reshape(-1, H).astype("f8")
        h = np.tanh(x2 @ wh + bh)
        logits = h @ (w.T if transpose_y else w)
        dl = 2 * logits
        dw = dw + (dl.T @ h if transpose_y else h.T @ dl)
        dh = dl @ (w if transpose_y else w.T)
        dwh = dwh + x2.T @ (dh * (1 - h * h))
    return dw, dwh


@pytest.mark.parametrize("weight_as_arg", [False, True], ids=["closure", "argument"])
@pytest.mark.parametrize("transpose_y", [True, False], ids=["weight_VxH", "weight_HxV"])
@pytest.mark.parametrize("mode", MODES)
def test_lm_head_function_trains_with_main_grad_exact(mode, transpose_y, weight_as_arg):
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    rs = np.random.RandomState(3)
    data = [rs.standard_normal([2, 5, H]).astype("float32") for _ in range(2)]
    before = paddle_mgrad.stats.paddle_c_ops.get("ours", 0)
    hidden, weight = _lm_head_run(mode, transpose_y, weight_as_arg, data)
    dw, dwh = _lm_head_reference(transpose_y, data)
    np.testing.assert_allclose(weight.main_grad.numpy(), dw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hidden.weight.grad.numpy(), dwh, rtol=1e-5, atol=1e-5)
    assert paddle_mgrad.stats.paddle_c_ops["ours"] - before == len(data)  # our op ran


def test_lm_head_function_fails_in_plain_paddle_under_recompute():
    """The report, asserted: plain Paddle's non-reentrant recompute refuses the bool."""
    rs = np.random.RandomState(3)
    data = [rs.standard_normal([2, 5, H]).astype("float32")]
    paddle.seed(21)
    weight = paddle.create_parameter([V, H], "float32")
    x = paddle.to_tensor(data[0])
    with pytest.raises(ValueError, match=PADDLE_REFUSES):
        native_recompute(
            lambda t: LMHeadFunction.apply(t * 1.0, weight, True),
            x,
            use_reentrant=False,
            preserve_rng_state=False,
        )


# ------------------------------------------------------------------ a list of tensors
@pytest.mark.probe
def test_list_of_tensors_under_non_reentrant_recompute_no_signal():
    """``ctx.save_for_backward(x, [a, b])`` under non-reentrant recompute: Paddle's own unpack
    of the list segfaults the process (3.3.1, checked by hand; 2.6.2 first refuses CPU RNG);
    with paddle_mgrad the list is flattened and the gradients equal a run without recompute
    (non-reentrant and reentrant).  In a subprocess: a crash must show as a failed test."""
    r = run_probe_script("list_save_probe.py", "ours")
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])  # < 0: killed by a signal
    assert "OURS OK" in r.stdout, r.stdout + r.stderr[-3000:]
