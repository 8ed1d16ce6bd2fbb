"""Whatever Paddle's ``linear`` accepts, the enabled one accepts with the same result.

Each case runs twice on fresh tensors built from the same numpy data: unpatched
Paddle, then ``paddle_mgrad.enable(fused_linear=True)``.  Outputs and every
gradient must be equal; where Paddle raises, ours raises the same exception type.
The cases are Paddle's own unit-test patterns for ``F.linear`` / ``nn.Linear``
(``test_linear.py``: 3-D input, frozen parameters, ``TestLinearAPI_ZeroSize``) plus
the inputs Paddle's dispatcher takes or refuses (numpy, tuples, 1-D, broadcast
biases, dtype mixes), and Paddle 2.6's ``recompute_sequential``, which hands the
whole argument tuple to the first layer of the last segment.
"""

import contextlib

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import PADDLE2
from paddle_mgrad import stats

F = paddle.nn.functional
RS = np.random.RandomState(3)
X = RS.standard_normal([3, 4]).astype("float32")
X3 = RS.standard_normal([3, 1, 4]).astype("float32")
W = RS.standard_normal([4, 5]).astype("float32")
B = RS.standard_normal([5]).astype("float32")


def _t(a, grad=True, dtype=None):
    t = paddle.to_tensor(a if dtype is None else a.astype(dtype))
    t.stop_gradient = not grad
    return t


def _param(a, grad=True, dtype="float32"):
    p = paddle.create_parameter(list(a.shape), dtype)
    p.set_value(a.astype(dtype))
    p.stop_gradient = not grad
    return p


# name -> builder returning (call, tensors whose gradients are compared)
def _case(name):
    x, w, b = _t(X), _param(W), _param(B)
    cases = {
        "plain": lambda: (lambda: F.linear(x, w, b), [x, w, b]),
        "name_kw": lambda: (lambda: F.linear(x, w, b, name="fc"), [x, w, b]),
        "3d_x": lambda: (lambda: F.linear(_x3, w, b), [_x3, w, b]),
        "frozen_params": lambda: (lambda: F.linear(x, _wf, _bf), [x]),
        "tuple_x": lambda: (lambda: F.linear((x,), w, b), [x, w, b]),
        "tuple2_x": lambda: (lambda: F.linear((x, x * 10), w, b), [x, w, b]),
        "list_x": lambda: (lambda: F.linear([x], w, b), [x, w, b]),
        "numpy_x": lambda: (lambda: F.linear(X, w, b), [w, b]),
        "numpy_w": lambda: (lambda: F.linear(x, W, b), [x, b]),
        "numpy_b": lambda: (lambda: F.linear(x, w, B), [x, w]),
        "1d_x": lambda: (lambda: F.linear(_x1, w, b), [_x1, w, b]),
        "1d_w": lambda: (lambda: F.linear(x, _w1), [x, _w1]),
        "3d_w": lambda: (lambda: F.linear(x, _w3), [x, _w3]),
        "bias_1xN": lambda: (lambda: F.linear(x, w, _b2), [x, w, _b2]),
        "bias_1": lambda: (lambda: F.linear(x, w, _b1), [x, w, _b1]),
        "bias_wrong_len": lambda: (lambda: F.linear(x, w, _bw), [x, w, _bw]),
        "x_f64_w_f32": lambda: (lambda: F.linear(_x64, w), [_x64, w]),
        "x_f32_w_f64": lambda: (lambda: F.linear(x, _w64), [x, _w64]),
        "bias_f64": lambda: (lambda: F.linear(x, w, _b64), [x, w, _b64]),
        "f64_all": lambda: (lambda: F.linear(_x64, _w64, _b64), [_x64, _w64, _b64]),
        "int_x": lambda: (lambda: F.linear(_xi, w), [w]),
        "bad_k": lambda: (lambda: F.linear(_xk, w), [_xk, w]),
        "zero_size_w": lambda: (lambda: F.linear(_xz, _wz), [_xz, _wz]),  # TestLinearAPI_ZeroSize
        "zero_rows": lambda: (lambda: F.linear(_x0, w, b), [_x0, w, b]),
        "nn_linear_3d": lambda: (lambda: _lin(_x3), [_x3, _lin.weight, _lin.bias]),
        "frozen_w_numpy_b": lambda: (lambda: F.linear(x, _wf, B), [x]),
        "frozen_w_grad_b": lambda: (lambda: F.linear(x, _wf, b), [x, b]),
        "no_grad_mode": lambda: (lambda: _no_grad(F.linear, x, w, b), [x, w, b]),
    }
    _x3, _x1 = _t(X3), _t(X[0])
    _wf, _bf = _param(W, grad=False), _param(B, grad=False)
    _w1, _w3 = _param(W[:, 0]), _param(np.stack([W, W * 2]))
    _b2, _b1, _bw = _param(B[None]), _param(B[:1]), _param(B[:3])
    _x64, _w64, _b64 = (
        _t(X, dtype="float64"),
        _param(W, dtype="float64"),
        _param(B, dtype="float64"),
    )
    _xi, _xk = (
        paddle.to_tensor(np.ones([3, 4], "int32")),
        _t(RS.standard_normal([3, 7]).astype("f4")),
    )
    _xz, _wz = _t(X[:, :2]), _t(np.zeros([2, 0], "float32"))
    _x0 = _t(np.zeros([0, 4], "float32"))
    paddle.seed(0)
    _lin = paddle.nn.Linear(4, 5)
    _lin.weight.set_value(W)
    _lin.bias.set_value(B)
    return cases[name]()


CASES = [
    "plain",
    "name_kw",
    "3d_x",
    "frozen_params",
    "tuple_x",
    "tuple2_x",
    "list_x",
    "numpy_x",
    "numpy_w",
    "numpy_b",
    "1d_x",
    "1d_w",
    "3d_w",
    "bias_1xN",
    "bias_1",
    "bias_wrong_len",
    "x_f64_w_f32",
    "x_f32_w_f64",
    "bias_f64",
    "f64_all",
    "int_x",
    "bad_k",
    "zero_size_w",
    "zero_rows",
    "nn_linear_3d",
    "frozen_w_numpy_b",
    "frozen_w_grad_b",
    "no_grad_mode",
]
# Cases that must run through the fused PyLayer, and cases that must be Paddle's own call
# (nothing to accumulate, or inputs our backward does not take); the rest may go either way.
OURS = {"plain", "name_kw", "3d_x", "nn_linear_3d", "frozen_w_grad_b"}
PADDLES = {
    "frozen_params",
    "frozen_w_numpy_b",
    "numpy_b",
    "no_grad_mode",
    "bias_1xN",
    "x_f64_w_f32",
    "bias_f64",
    "1d_x",
    "tuple_x",
}
# The cases unpatched Paddle refuses (a ValueError each), so that a case Paddle accepts cannot
# pass as "both raise": it must compare values.  Paddle 2.6 takes a tuple input and refuses a
# zero-size one; Paddle 3.3 the other way round.
PADDLE_REFUSES = {
    "list_x",
    "numpy_x",
    "numpy_w",
    "numpy_b",
    "bias_wrong_len",
    "x_f64_w_f32",
    "x_f32_w_f64",
    "int_x",
    "bad_k",
    "frozen_w_numpy_b",
} | ({"zero_size_w", "zero_rows"} if PADDLE2 else {"tuple_x", "tuple2_x"})


def _no_grad(fn, *args):
    with paddle.no_grad():
        return fn(*args)


def _run(name):
    call, tensors = _case(name)
    before = stats.linear["forward"]
    try:
        y = call()
        if not y.stop_gradient:
            (y * y).sum().backward()
    except Exception as e:  # noqa: BLE001 - the type is what we compare
        return {"error": e}
    grads = [None if t.grad is None else t.grad.numpy() for t in tensors]
    return {
        "y": y.numpy(),
        "dtype": y.dtype,
        "grads": grads,
        "fused": stats.linear["forward"] - before,
    }


def _plain_and_fused(run, *args):
    """``run(*args)`` with plain Paddle, then with the fused linear on: ``(plain, ours)``."""
    plain = run(*args)
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        return plain, run(*args)
    finally:
        paddle_mgrad.disable()


@pytest.mark.parametrize("name", CASES)
def test_same_result_or_same_error_as_paddle(name):
    plain, ours = _plain_and_fused(_run, name)
    assert ("error" in plain) == (name in PADDLE_REFUSES), plain
    assert plain.get("fused", 0) == 0, "the reference ran through the fused linear"
    if "error" in plain:
        assert isinstance(plain["error"], ValueError), plain["error"]
        assert "error" in ours, f"Paddle raises {plain['error']!r}; ours returned a result"
        # the same exception class as Paddle's, or a subclass of it (FusedLinearError is a ValueError)
        assert isinstance(ours["error"], type(plain["error"])), (plain["error"], ours["error"])
        return
    assert "error" not in ours, f"Paddle accepts {name}; ours raised {ours['error']!r}"
    assert ours["dtype"] == plain["dtype"]
    assert ours["y"].shape == plain["y"].shape
    np.testing.assert_allclose(ours["y"], plain["y"], rtol=1e-6, atol=1e-6)
    for g_ours, g_plain in zip(ours["grads"], plain["grads"]):
        assert (g_ours is None) == (g_plain is None)
        if g_plain is not None:
            assert g_ours.shape == g_plain.shape
            np.testing.assert_allclose(g_ours, g_plain, rtol=1e-5, atol=1e-6)
    if name in OURS:
        assert ours["fused"] == 1, "the fused linear was bypassed"
    if name in PADDLES:
        assert ours["fused"] == 0, "Paddle's own call was expected"


def test_paddle26_accepts_tuple_input():
    """Documents why the tuple case matters: Paddle 2.6 takes ``linear((x,), w)``."""
    x, w = _t(X), _param(W)
    if PADDLE2:
        np.testing.assert_allclose(F.linear((x,), w).numpy(), X @ W, rtol=1e-5, atol=1e-5)
    else:
        with pytest.raises(ValueError, match="must be Tensor"):
            F.linear((x,), w)


class _Seq(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        paddle.seed(12)
        self.body = paddle.nn.Sequential(
            paddle.nn.Linear(6, 8),
            paddle.nn.Tanh(),
            paddle.nn.Linear(8, 8),
            paddle.nn.Tanh(),
            paddle.nn.Linear(8, 3),
        )


def _sequential_run(segments, enabled, main_grad, steps=2):
    from paddle.incubate.distributed.fleet import recompute_sequential

    net = _Seq()
    if main_grad:
        MixPrecisionLayer(net, dtype="bfloat16")
    rs = np.random.RandomState(5)
    if enabled:
        paddle_mgrad.enable(recompute=True, fused_linear=True)
    before = stats.linear["backward"]
    try:
        for _ in range(steps):
            x = _t(rs.standard_normal([4, 6]).astype("float32"))
            if segments:
                y = recompute_sequential(
                    {"segments": segments, "preserve_rng_state": False}, net.body, x
                )
            else:
                y = net.body(x)
            (y * y).sum().backward()
    finally:
        paddle_mgrad.disable()
    grads = [(p.main_grad if main_grad else p.grad).numpy() for p in net.parameters()]
    return grads, stats.linear["backward"] - before


@pytest.mark.parametrize("policy", ["full", "gemm", "save:*Tanh", "budget:0.5"])
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("segments", [1, 2])
def test_paddle_recompute_sequential_with_fused_linear(segments, main_grad, policy, monkeypatch):
    """Paddle's own recompute_sequential with recompute and fused linear enabled, under each
    recompute policy (the variable reaches Paddle's calls to our recompute): gradients equal plain autograd
    wherever unpatched Paddle's recompute_sequential runs, and the same error where it does
    not.  Paddle 2.6 hands the argument tuple to the last segment's first layer (that call goes
    to Paddle's linear; the others are fused); Paddle 3.3 unpacks the previous segment's output
    tensor with ``*args`` when ``segments > 1`` (TypeError with or without paddle_mgrad)."""
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", policy)
    try:
        native, _ = _sequential_run(segments, False, main_grad)
    except TypeError as e:
        assert not PADDLE2 and segments > 1, e  # Paddle 3.3's own bug, see docstring
        with pytest.raises(TypeError):
            _sequential_run(segments, True, main_grad)
        return
    ref, _ = _sequential_run(0, False, main_grad)
    calls = stats.policy.get(policy, {}).get("calls", 0)
    got, fused = _sequential_run(segments, True, main_grad)
    for r, n, g in zip(ref, native, got):
        np.testing.assert_allclose(n, r, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    assert fused > 0
    if policy != "full":  # each step recomputed all segments but the last, under the policy
        assert stats.policy.get(policy, {}).get("calls", 0) - calls == 2 * (segments - 1)


@pytest.mark.parametrize("transpose_weight", [False, True])
@pytest.mark.parametrize("bias", ["none", "1d", "1xN"])
def test_incubate_fused_linear_same_as_paddle(transpose_weight, bias):
    """``paddle.incubate.nn.functional.fused_linear`` (test_fused_matmul_bias patterns):
    3-D x, weight [K, N] or [N, K], bias None/[N]/[1, N] -- same output and gradients."""
    from paddle.incubate.nn.functional import fused_linear as inc

    def run():
        x = _t(X3)
        w = _param(W.T.copy() if transpose_weight else W)
        b = None if bias == "none" else _param(B if bias == "1d" else B[None])
        before = stats.linear["forward"]
        try:
            y = inc(x, w, b, transpose_weight=transpose_weight)
            (y * y).sum().backward()
        except Exception as e:  # noqa: BLE001
            return {"error": e}
        ts = [x, w] + ([b] if b is not None else [])
        return {
            "y": y.numpy(),
            "grads": [t.grad.numpy() for t in ts],
            "fused": stats.linear["forward"] - before,
        }

    plain, ours = _plain_and_fused(run)
    if bias == "1xN":  # not ours: Paddle's function, Paddle's result or error
        if "error" not in ours:
            assert ours["fused"] == 0
        if "error" in plain:
            assert isinstance(ours.get("error"), type(plain["error"])), (plain, ours)
            return
    assert "error" not in ours, ours
    if "error" not in plain:
        np.testing.assert_allclose(ours["y"], plain["y"], rtol=1e-6, atol=1e-6)
        for a, b in zip(ours["grads"], plain["grads"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if bias == "1xN":
        return
    # Paddle's own has no CPU kernel with a bias (fused_gemm_epilogue): ours computes it;
    # either way ours equals float64 numpy
    assert ours["fused"] == 1
    x64, w64 = X3.astype("f8"), W.astype("f8")
    y64 = x64 @ w64 + (B.astype("f8") if bias == "1d" else 0)
    dy = 2 * y64
    np.testing.assert_allclose(ours["y"], y64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours["grads"][0], dy @ w64.T, rtol=1e-5, atol=1e-5)
    dw = (
        dy.reshape(-1, 5).T @ x64.reshape(-1, 4)
        if transpose_weight
        else x64.reshape(-1, 4).T @ dy.reshape(-1, 5)
    )
    np.testing.assert_allclose(ours["grads"][1], dw, rtol=1e-5, atol=1e-5)
    if bias == "1d":
        np.testing.assert_allclose(ours["grads"][2], dy.reshape(-1, 5).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transpose_weight", [False, True])
def test_incubate_fused_linear_left_to_paddle_keeps_its_arguments(transpose_weight):
    """A call the route leaves to Paddle (nothing to accumulate: the weight is frozen) reaches
    Paddle's own ``fused_linear`` with every argument as given: the same output and input
    gradient as without paddle_mgrad."""
    from paddle.incubate.nn.functional import fused_linear as inc

    def run():
        x = _t(X3)
        w = paddle.to_tensor(W.T.copy() if transpose_weight else W)  # stop_gradient: Paddle's
        before = stats.linear["forward"]
        y = inc(x, w, None, transpose_weight=transpose_weight)
        (y * y).sum().backward()
        return y.numpy(), x.grad.numpy(), stats.linear["forward"] - before

    plain, ours = _plain_and_fused(run)
    assert ours[2] == 0  # not ours
    np.testing.assert_array_equal(ours[0], plain[0])
    np.testing.assert_array_equal(ours[1], plain[1])
    np.testing.assert_allclose(plain[0], X3 @ W, rtol=1e-5, atol=1e-5)


def _static_linear_output_name(fn, bias):
    """The output variable's name of ``fn(x, weight, bias, name="user_named")`` in a program
    built under Paddle's static graph (the old IR: there ``name`` names the output variable;
    PIR and eager ignore it)."""
    # Paddle 2.6 builds old-IR programs; 3.x builds PIR ones unless asked for the old IR
    guard = contextlib.nullcontext if PADDLE2 else paddle.pir_utils.OldIrGuard
    with guard():
        paddle.enable_static()
        try:
            with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
                x = paddle.static.data("x", [2, 3], "float32")
                layer = paddle.nn.Linear(3, 4, bias_attr=None if bias else False)
                return fn(x, layer.weight, layer.bias, name="user_named").name
        finally:
            paddle.disable_static()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_static_graph_linear_keeps_its_name(bias):
    """A program built under the static graph after ``enable(fused_linear=True)`` gets
    Paddle's own ``F.linear``, ``name`` included: it names the output variable as without us.
    (Paddle's incubate ``fused_linear`` builds no static program on a CPU: its op is not
    registered there, and on 3.x its old-IR branch calls a PIR-only matmul.)"""
    fn = paddle.nn.functional.linear
    plain = _static_linear_output_name(fn, bias)
    assert plain.startswith("user_named."), plain
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        assert _static_linear_output_name(fn, bias).startswith("user_named.")
    finally:
        paddle_mgrad.disable()
