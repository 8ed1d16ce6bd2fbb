"""FusedLinearWithGradAdd / fused_linear: main_grad accumulation under every recompute."""

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils import recompute as native_recompute
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import PADDLE2, nonzero_biases
from paddle_mgrad import FusedLinearError, FusedLinearWithGradAdd, fused_linear, stats


class Net(paddle.nn.Layer):
    """Two fused linears with a tanh between; parameters read from self (closure)."""

    def __init__(self, bias, d_in=12, d_hidden=20, d_out=6):
        super().__init__()
        self.a = paddle.nn.Linear(d_in, d_hidden, bias_attr=None if bias else False)
        self.b = paddle.nn.Linear(d_hidden, d_out, bias_attr=None if bias else False)
        nonzero_biases(self)

    def forward(self, x):
        h = paddle.tanh(fused_linear(x, self.a.weight, self.a.bias))
        return fused_linear(h, self.b.weight, self.b.bias)


def plain_forward(net, x):
    h = paddle.tanh(paddle.nn.functional.linear(x, net.a.weight, net.a.bias))
    return paddle.nn.functional.linear(h, net.b.weight, net.b.bias)


RECOMPUTES = {
    "none": None,
    "native_reentrant": lambda f, x: native_recompute(f, x, use_reentrant=True),
    "native_non_reentrant": lambda f, x: native_recompute(
        f, x, use_reentrant=False, preserve_rng_state=False
    ),
    "ours_reentrant": lambda f, x: paddle_mgrad.recompute(f, x, use_reentrant=True),
    "ours_non_reentrant": lambda f, x: paddle_mgrad.recompute(f, x, use_reentrant=False),
}


def _data(shape3d, n=4):
    rs = np.random.RandomState(0)
    shape = [2, 3, 12] if shape3d else [6, 12]
    return [rs.standard_normal(shape).astype("float32") for _ in range(n)]


def _reference(bias, data):
    paddle.seed(42)
    ref = Net(bias)
    for x in data:
        xt = paddle.to_tensor(x)
        xt.stop_gradient = False
        (plain_forward(ref, xt) ** 2).sum().backward()
    return {p.name.split(".")[-1] + str(i): p.grad.numpy() for i, p in enumerate(ref.parameters())}


@pytest.mark.parametrize("shape3d", [False, True], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("recompute", list(RECOMPUTES))
def test_main_grad_over_micro_batches(recompute, bias, shape3d):
    data = _data(shape3d)
    ref = _reference(bias, data)
    paddle.seed(42)
    net = Net(bias)
    model = MixPrecisionLayer(net, dtype="bfloat16")
    fired = {p.name: 0 for p in net.parameters()}
    for p in net.parameters():
        p._register_backward_hook(lambda *_, name=p.name: fired.__setitem__(name, fired[name] + 1))
    rc = RECOMPUTES[recompute]
    before = stats.linear["backward"]
    for step, x in enumerate(data):
        xt = paddle.to_tensor(x)
        xt.stop_gradient = False
        y = model(xt) if rc is None else rc(model, xt)
        (y**2).sum().backward()
        assert all(v == step + 1 for v in fired.values()), fired  # once per backward
    assert stats.linear["backward"] - before == 2 * len(data)  # the fused path really ran
    for i, p in enumerate(net.parameters()):
        assert p.grad is None, f"{p.name}.grad must stay None under main_grad"
        assert p.main_grad is not None and p.main_grad.dtype == paddle.float32
        want = ref[p.name.split(".")[-1] + str(i)]
        np.testing.assert_allclose(
            p.main_grad.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
        )


def test_main_grad_allocated_on_real_parameter_and_reused_in_place():
    net = Net(bias=True)
    MixPrecisionLayer(net, dtype="bfloat16")
    x = paddle.randn([4, 12])
    x.stop_gradient = False
    paddle_mgrad.recompute(net, x, use_reentrant=False).sum().backward()
    ptrs = {p.name: p.main_grad.data_ptr() for p in net.parameters()}
    paddle_mgrad.recompute(net, x, use_reentrant=False).sum().backward()
    assert ptrs == {p.name: p.main_grad.data_ptr() for p in net.parameters()}


@pytest.mark.parametrize("bias", [False, True])
def test_plain_parameters_get_grad_once(bias):
    """Without main_grad: .grad equals plain autograd, first and later micro-steps."""
    data = _data(True, n=3)
    ref = _reference(bias, data)
    paddle.seed(42)
    net = Net(bias)
    for x in data:
        xt = paddle.to_tensor(x)
        xt.stop_gradient = False
        (net(xt) ** 2).sum().backward()
    for i, p in enumerate(net.parameters()):
        want = ref[p.name.split(".")[-1] + str(i)]
        np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_dx_matches_plain_autograd():
    paddle.seed(1)
    net = Net(True)
    x = paddle.randn([2, 3, 12])
    x.stop_gradient = False
    (net(x) ** 2).sum().backward()
    g = x.grad.numpy()
    x.clear_gradient()
    (plain_forward(net, x) ** 2).sum().backward()
    np.testing.assert_allclose(g, x.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_frozen_weight_and_input_without_grad():
    lin = paddle.nn.Linear(5, 3)
    lin.weight.stop_gradient = True
    x = paddle.randn([4, 5])  # stop_gradient=True
    fused_linear(x, lin.weight, lin.bias).sum().backward()
    assert lin.weight.grad is None
    np.testing.assert_allclose(lin.bias.grad.numpy(), np.full([3], 4.0), rtol=1e-6, atol=1e-6)


def test_enable_routes_nn_linear_and_disable_restores():
    orig = paddle.nn.functional.linear.__code__
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        lin = paddle.nn.Linear(6, 4)
        MixPrecisionLayer(lin, dtype="bfloat16")
        before = stats.linear["backward"]
        x = paddle.randn([3, 6])
        x.stop_gradient = False
        y = native_recompute(lin, x, use_reentrant=False)
        y.sum().backward()
        assert stats.linear["backward"] == before + 1
        assert lin.weight.grad is None
        np.testing.assert_allclose(
            lin.weight.main_grad.numpy(),
            x.numpy().T @ np.ones([3, 4], "float32"),
            rtol=1e-5,
            atol=1e-5,
        )
    finally:
        paddle_mgrad.disable()
    assert paddle.nn.functional.linear.__code__ is orig


def test_incubate_fused_linear_transpose_weight():
    from paddle.incubate.nn.functional import fused_linear as inc

    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        w = paddle.create_parameter([4, 6], "float32")  # [N, K] with transpose_weight
        b = paddle.create_parameter([4], "float32", is_bias=True)
        w.main_grad = None
        b.main_grad = None
        x = paddle.randn([3, 6])
        before = stats.linear["backward"]
        y = inc(x, w, b, transpose_weight=True)
        y.sum().backward()
        assert stats.linear["backward"] == before + 1
        dy = np.ones([3, 4], "float32")
        np.testing.assert_allclose(w.main_grad.numpy(), dy.T @ x.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b.main_grad.numpy(), dy.sum(0), rtol=1e-6, atol=1e-6)
    finally:
        paddle_mgrad.disable()


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_weight_of_another_shape_met_by_a_recomputation_raises_our_error(use_reentrant):
    """The block's weight swapped after its forward for one of another inner dimension: the
    recomputation's linear raises the error naming the shapes, and ``backward()`` raises it as
    itself, not as Paddle's error around it; grad mode is on again afterwards."""
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        lin = paddle.nn.Linear(4, 3)
        x = paddle.randn([2, 4])
        x.stop_gradient = False
        y = paddle_mgrad.recompute(lambda t: paddle.tanh(lin(t)), x, use_reentrant=use_reentrant)
        lin.weight = paddle.create_parameter([5, 3], "float32")
        with pytest.raises(FusedLinearError, match=r"x \[2, 4\] does not match weight \[5, 3\]"):
            y.sum().backward()
        assert paddle.is_grad_enabled()
    finally:
        paddle_mgrad.disable()


def test_bad_shapes_raise():
    w = paddle.create_parameter([5, 3], "float32")
    with pytest.raises(FusedLinearError, match=r"\[4, 7\]"):
        fused_linear(paddle.randn([4, 7]), w)
    # a bias that does not broadcast: Paddle's linear gets the call and raises its ValueError
    with pytest.raises(ValueError, match=r"\[2\]"):
        fused_linear(paddle.randn([4, 5]), w, paddle.create_parameter([2], "float32"))


def test_pylayer_apply_directly():
    w = paddle.create_parameter([5, 3], "float32")
    w.main_grad = None
    x = paddle.randn([2, 5])
    FusedLinearWithGradAdd.apply(x, w).sum().backward()
    np.testing.assert_allclose(
        w.main_grad.numpy(), x.numpy().T @ np.ones([2, 3]), rtol=1e-5, atol=1e-5
    )
    assert w.grad is None


@pytest.mark.parametrize("nested", [False, True], ids=["one", "nested"])
@pytest.mark.parametrize("steps", [1, 3])
def test_native_reentrant_with_parameter_arguments(steps, nested):
    """Paddle's reentrant recompute copies parameter *arguments* (deep-copying main_grad);
    with only the fused linear enabled, main_grad must still land on the real parameter --
    also when a recompute inside the block copies the copy again, and from the copy's own
    linear after that."""

    def block(a, w, b):
        return paddle.tanh(paddle.nn.functional.linear(a, w, b))

    def outer(a, w, b):
        return native_recompute(block, a, w, b, use_reentrant=True) + block(a, w, b)

    paddle_mgrad.enable(recompute=False, fused_linear=True)
    before = stats.linear["into_main_grad"]
    try:
        paddle.seed(9)
        lin = paddle.nn.Linear(6, 4)
        MixPrecisionLayer(lin, dtype="bfloat16")
        xs = [paddle.randn([5, 6]) for _ in range(steps)]
        for x in xs:
            x.stop_gradient = False
            y = native_recompute(
                outer if nested else block, x, lin.weight, lin.bias, use_reentrant=True
            )
            y.sum().backward()
    finally:
        paddle_mgrad.disable()
    w, b = lin.weight.numpy().astype("f8"), lin.bias.numpy().astype("f8")
    ref_w, ref_b = 0, 0
    for x in xs:
        xn = x.numpy().astype("f8")
        dz = 1 - np.tanh(xn @ w + b) ** 2
        dz *= 2 if nested else 1
        ref_w, ref_b = ref_w + xn.T @ dz, ref_b + dz.sum(0)
    assert lin.weight.grad is None and lin.bias.grad is None
    # Paddle 2.6 hands the PyLayer a tagged EagerParamBase copy: the fused op writes into the
    # real main_grad.  Paddle 3.x hands a plain shared tensor (no link to the parameter): the
    # op returns a fresh gradient that MixPrecisionLayer's hook adds -- correct, not fused.
    linears = 2 if nested else 1
    assert stats.linear["into_main_grad"] - before == (2 * linears * steps if PADDLE2 else 0)
    np.testing.assert_allclose(lin.weight.main_grad.numpy(), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lin.bias.main_grad.numpy(), ref_b, rtol=1e-5, atol=1e-6)


def test_low_precision_grad_accumulators():
    """bf16 weights without main_grad: an existing bf16 .grad is accumulated in place, the
    bias gradient (first seen) is fresh; nothing is refused."""
    w = paddle.create_parameter([5, 3], "float32")
    b = paddle.create_parameter([3], "float32", is_bias=True)
    x = paddle.randn([4, 5])
    dy = paddle.randn([4, 3])
    wb = w.astype("bfloat16")
    wb.stop_gradient = False
    from paddle_mgrad.linear import weight_and_bias_grads

    with paddle.no_grad():
        out_w, out_b = weight_and_bias_grads(
            x.astype("bfloat16"), dy.astype("bfloat16"), w, b, False
        )
    want_w = (
        x.astype("bfloat16").astype("float32").numpy().T
        @ dy.astype("bfloat16").astype("float32").numpy()
    )
    np.testing.assert_allclose(out_w.numpy(), want_w, rtol=1e-5, atol=1e-5)
    assert out_b.dtype == b.dtype

    # now with an existing bf16 .grad-like accumulator on the weight
    class P:  # a stand-in parameter whose .grad is bf16
        stop_gradient = False
        dtype = paddle.bfloat16
        name = "p"
        grad = paddle.zeros([5, 3]).astype("bfloat16")

    p = P()
    ptr = p.grad.data_ptr()
    with paddle.no_grad():
        out_w, out_b = weight_and_bias_grads(
            x.astype("bfloat16"), dy.astype("bfloat16"), p, b, False
        )
    assert out_w is None and p.grad.data_ptr() == ptr
    np.testing.assert_allclose(p.grad.astype("float32").numpy(), want_w, rtol=2e-2, atol=2e-2)
    assert out_b is not None and out_b.dtype == b.dtype


@pytest.mark.parametrize("n", [4, 6], ids=["4x6", "square"])  # square: a wrong transpose runs
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_incubate_transpose_weight_dx(bias, n):
    """transpose_weight=True: y = x·Wᵀ (+b), so dx = dy·W -- checked against float64 numpy."""
    from paddle.incubate.nn.functional import fused_linear as inc

    rs = np.random.RandomState(2)
    xn, wn, bn = (rs.standard_normal(s).astype("float32") for s in ([3, 2, 6], [n, 6], [n]))
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        w = paddle.create_parameter([n, 6], "float32")
        w.set_value(wn)
        b = None
        if bias:
            b = paddle.create_parameter([n], "float32", is_bias=True)
            b.set_value(bn)
        w.main_grad = None
        ptrs = []
        for _ in range(2):  # the second micro-step accumulates into the first one's main_grad
            x = paddle.to_tensor(xn)
            x.stop_gradient = False
            before = stats.linear["backward"]
            y = inc(x, w, b, transpose_weight=True)
            (y * y).sum().backward()
            assert stats.linear["backward"] == before + 1
            ptrs.append(w.main_grad.data_ptr())
    finally:
        paddle_mgrad.disable()
    assert ptrs[0] == ptrs[1]
    x64, w64 = xn.astype("f8"), wn.astype("f8")
    y64 = x64 @ w64.T + (bn.astype("f8") if bias else 0)
    dy = 2 * y64
    np.testing.assert_allclose(y.numpy(), y64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), dy @ w64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        w.main_grad.numpy(), 2 * dy.reshape(-1, n).T @ x64.reshape(-1, 6), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("which", ["weight", "bias"])
@pytest.mark.parametrize("when", ["before_forward", "before_backward"])
def test_non_fp32_main_grad_is_refused(which, when):
    """A bf16 main_grad is not an fp32 master gradient: a FusedLinearError naming the
    parameter and the dtype (in forward when it is already there; from backward when it
    was set after the forward -- as itself, not as the OSError Paddle's engine makes of it,
    and with grad mode back on)."""
    w = paddle.create_parameter([5, 3], "float32")
    b = paddle.create_parameter([3], "float32", is_bias=True)
    w.main_grad = None
    b.main_grad = None
    p = w if which == "weight" else b
    bad = paddle.zeros(p.shape).astype("bfloat16")
    x = paddle.randn([2, 5])
    pattern = rf"{p.name}\.main_grad is paddle\.bfloat16 \[{', '.join(map(str, p.shape))}\], expected float32"
    if when == "before_forward":
        p.main_grad = bad
        with pytest.raises(FusedLinearError, match=pattern):
            fused_linear(x, w, b)
        return
    for run_backward in (
        lambda y: y.sum().backward(),
        lambda y: paddle.autograd.backward([y.sum()]),
    ):
        y = fused_linear(x, w, b)
        p.main_grad = bad
        with pytest.raises(FusedLinearError, match=pattern) as info:
            run_backward(y)
        assert isinstance(info.value.__cause__, OSError)  # Paddle's, chained
        assert paddle.is_grad_enabled()  # Paddle leaves it off after a failed backward
        assert bad.astype("float32").abs().sum().item() == 0  # nothing was written into it
        p.main_grad = None


def test_main_grad_of_another_shape_set_after_forward():
    """main_grad replaced between forward and backward by a float32 tensor of the wrong
    shape: the op's FusedLinearError (naming both shapes) reaches the caller of backward."""
    w = paddle.create_parameter([5, 3], "float32")
    w.main_grad = None
    y = fused_linear(paddle.randn([2, 5]), w, None)
    w.main_grad = paddle.zeros([3, 5])
    with pytest.raises(FusedLinearError, match=r"\[3, 5\].*\[5, 3\]|\[5, 3\].*\[3, 5\]"):
        y.sum().backward()
    assert paddle.is_grad_enabled()


# (input dtype, .grad dtype, accumulated in place?): the op's accumulator rule
# (ops.acc_dtypes(dtype, multi_precision=False)) -- the input dtype or its multi-precision type,
# which is float32 except for float64 inputs (float64, Paddle's MPTypeTrait<double>).
_GRAD_CASES = [
    ("float32", "float32", True),
    ("bfloat16", "bfloat16", True),
    ("bfloat16", "float32", True),
    ("float16", "float16", True),
    ("float16", "float32", True),
    ("float64", "float64", True),
    ("float32", "bfloat16", False),
    ("float32", "float64", False),
    ("bfloat16", "float16", False),
    ("float16", "bfloat16", False),
    ("bfloat16", "float64", False),
    ("float64", "float32", False),
]


@pytest.mark.parametrize(
    "x_dtype,grad_dtype,in_place", _GRAD_CASES, ids=[f"{a}-{b}" for a, b, _ in _GRAD_CASES]
)
def test_grad_accumulator_dtype_rule(x_dtype, grad_dtype, in_place):
    """Without main_grad, an existing .grad is accumulated in place (same data_ptr, beta = 1)
    when the op's accumulator rule allows its dtype; otherwise the gradient comes back fresh in
    the parameter's dtype and .grad is left alone (float64 inputs with a float32 .grad included:
    the op accumulates float64 only in float64)."""
    from paddle_mgrad.linear import weight_and_bias_grads

    rs = np.random.RandomState(5)
    x = paddle.to_tensor(rs.standard_normal((7, 5))).astype(x_dtype)
    dy = paddle.to_tensor(rs.standard_normal((7, 3))).astype(x_dtype)
    g0 = paddle.to_tensor(rs.standard_normal((5, 3))).astype(grad_dtype)

    class P:  # a stand-in parameter (Paddle ties .grad's dtype to the parameter's)
        stop_gradient = False
        dtype = x.dtype
        name = "p"
        grad = g0

    ptr = g0.data_ptr()
    g0_64 = g0.astype("float64").numpy()
    want = x.astype("float64").numpy().T @ dy.astype("float64").numpy()
    with paddle.no_grad():
        out_w, out_b = weight_and_bias_grads(x, dy, P, None, False)
    assert out_b is None
    tol = 1e-12 if "float64" in (x_dtype, grad_dtype) and in_place else 1e-5
    if in_place:
        assert out_w is None and P.grad.data_ptr() == ptr
        got, want = P.grad.astype("float64").numpy(), g0_64 + want
        if grad_dtype in ("bfloat16", "float16"):
            tol = 2e-2
    else:
        assert out_w is not None and out_w.dtype == x.dtype
        assert P.grad.data_ptr() == ptr
        np.testing.assert_array_equal(P.grad.astype("float64").numpy(), g0_64)  # untouched
        got = out_w.astype("float64").numpy()
        if x_dtype in ("bfloat16", "float16"):
            tol = 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# --------------------------------------------------------------- AMP O1, fp64 main_grad, shared weights
def _autocast_fake(orig):
    """Paddle's linear as ``auto_cast`` O1 runs it, with another product dtype: CPU Paddle has
    no bf16/fp16 matmul kernel, so the product runs in float64 for float32 x/weight (the
    dtype differs from x's, as bf16 does on GPU) -- in plain Paddle the casts are recorded."""

    def linear(x, weight, bias=None, name=None):
        return orig(
            x.astype("float64"),
            weight.astype("float64"),
            None if bias is None else bias.astype("float64"),
        )

    return linear


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_autocast_product_dtype_differs_from_x(monkeypatch, bias, main_grad):
    """AMP O1: Paddle's linear returns the autocast dtype for float32 x/weight (bf16 on GPU,
    no bias), so dy is not x's dtype; the input gradient must be computed in dy's dtype and
    returned in x's (before: matmul(dy, float32 weight) -> dtype error).  Same script as plain
    Paddle with the same (faked) autocast: x.grad, .grad / main_grad equal."""
    from paddle_mgrad import registry

    fake = _autocast_fake(registry.original("linear"))
    rs = np.random.RandomState(4)
    data = [rs.standard_normal([2, 3, 5]).astype("float32") for _ in range(2)]

    def run(linear):
        paddle.seed(5)
        lin = paddle.nn.Linear(5, 4, bias_attr=None if bias else False)
        if main_grad:
            MixPrecisionLayer(lin, dtype="bfloat16")
        dxs = []
        for a in data:
            x = paddle.to_tensor(a)
            x.stop_gradient = False
            y = linear(x, lin.weight, lin.bias)
            assert y.dtype == paddle.float64
            (y * y).sum().backward()
            assert x.grad.dtype == paddle.float32
            dxs.append(x.grad.numpy())
        acc = [(p.main_grad if main_grad else p.grad).numpy() for p in lin.parameters()]
        return dxs, acc

    plain = run(fake)
    import paddle_mgrad.linear as linear_mod

    # what our PyLayer's forward calls: Paddle's linear (its op, see linear._paddle_linear)
    monkeypatch.setattr(linear_mod, "_paddle_linear", fake)
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    before = stats.linear["backward"]
    try:
        ours = run(paddle.nn.functional.linear)
    finally:
        paddle_mgrad.disable()
    assert stats.linear["backward"] - before == 2
    for a, b in zip(ours[0] + ours[1], plain[0] + plain[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_half_dy_weight_gradient_uses_the_autocast_product():
    """dy bf16 for float32 x (AMP O1 on GPU): the weight gradient is that of the product the
    forward ran -- x cast to bf16, as autocast cast it -- accumulated in fp32 main_grad."""
    from paddle_mgrad.linear import weight_and_bias_grads

    rs = np.random.RandomState(8)
    x = paddle.to_tensor(rs.standard_normal([6, 5]).astype("float32"))
    dy = paddle.to_tensor(rs.standard_normal([6, 3]).astype("float32")).astype("bfloat16")
    w = paddle.create_parameter([5, 3], "float32")
    b = paddle.create_parameter([3], "float32", is_bias=True)
    w.main_grad = None
    b.main_grad = None
    with paddle.no_grad():
        assert weight_and_bias_grads(x, dy, w, b, False) == (None, None)
    xb = x.astype("bfloat16").astype("float64").numpy()
    dyb = dy.astype("float64").numpy()
    assert w.main_grad.dtype == paddle.float32 and b.main_grad.dtype == paddle.float32
    np.testing.assert_allclose(w.main_grad.numpy(), xb.T @ dyb, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.main_grad.numpy(), dyb.sum(0), rtol=1e-5, atol=1e-5)


def test_float64_parameter_main_grad_follows_the_accumulator_rule():
    """One rule everywhere (ops.mp_dtype): a float64 parameter's main_grad is float64 -- the
    first micro-step allocates it so, the next ones accept it (before: rejected as not
    float32), and it equals plain Paddle's .grad over the same steps; a float32 main_grad on
    a float64 parameter is refused with the expected dtype named."""
    rs = np.random.RandomState(6)
    data = [rs.standard_normal([4, 5]) for _ in range(3)]

    def run(ours):
        paddle.seed(2)
        w = paddle.create_parameter([5, 3], "float64")
        b = paddle.create_parameter([3], "float64", is_bias=True)
        if ours:
            w.main_grad = None
            b.main_grad = None
        for a in data:
            x = paddle.to_tensor(a)
            y = (fused_linear if ours else paddle.nn.functional.linear)(x, w, b)
            (y * y).sum().backward()
        return w, b

    pw, pb = run(False)
    w, b = run(True)
    assert w.grad is None and b.grad is None
    assert w.main_grad.dtype == paddle.float64 and b.main_grad.dtype == paddle.float64
    np.testing.assert_allclose(w.main_grad.numpy(), pw.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b.main_grad.numpy(), pb.grad.numpy(), rtol=1e-12, atol=1e-12)
    w.main_grad = paddle.zeros([5, 3], "float32")
    with pytest.raises(
        FusedLinearError, match=r"main_grad is paddle\.float32 \[5, 3\], expected float64"
    ):
        fused_linear(paddle.to_tensor(data[0]), w, b)


@pytest.mark.parametrize("set_to_zero", [True, False], ids=["zero", "none"])
@pytest.mark.parametrize("other_use", ["matmul", "second_linear", "matmul_and_bias"])
def test_shared_weight_after_clear_grad(set_to_zero, other_use):
    """A weight (and a bias: ``matmul_and_bias``) used by the fused linear and by another op,
    optimizer.clear_grad() between steps: .grad equals plain Paddle's every step.
    clear_grad(set_to_zero=True) (the default) marks .grad "fake empty", so Paddle *replaces*
    it with the next gradient it accumulates: unless the fused op's in-place write clears the
    mark, the dW it had just added is dropped (half the gradient, silently)."""

    def run(ours):
        if ours:
            paddle_mgrad.enable(recompute=False, fused_linear=True)
        try:
            paddle.seed(4)
            lin = paddle.nn.Linear(4, 4)
            opt = paddle.optimizer.SGD(0.0, parameters=lin.parameters())
            grads = []
            for step in range(3):
                x = paddle.to_tensor(np.full([2, 4], step + 1.0, "float32"))
                h = lin(x)
                if other_use == "second_linear":
                    z = paddle.nn.functional.linear(paddle.tanh(h), lin.weight)
                else:
                    z = paddle.matmul(h, lin.weight)
                if other_use == "matmul_and_bias":
                    z = z + lin.bias
                (z * z).sum().backward()
                grads.append([p.grad.numpy() for p in lin.parameters()])
                opt.clear_grad(set_to_zero=set_to_zero)
            return grads
        finally:
            paddle_mgrad.disable()

    plain, ours = run(False), run(True)
    for step, (a, b) in enumerate(zip(ours, plain)):
        for ga, gb in zip(a, b):
            np.testing.assert_allclose(
                ga, gb, rtol=1e-5, atol=1e-5 * np.abs(gb).max(), err_msg=f"step {step}"
            )


def test_the_replayed_linear_leaves_grad_mode_as_it_found_it():
    """The recomputation's linear computes with grad off and must then restore grad mode as it
    was -- not switch it on (a caller with grad off would find it on afterwards)."""
    from paddle_mgrad import linear

    x, w, b = paddle.randn([3, 4]), paddle.randn([4, 5]), paddle.randn([5])
    saved = []
    for enabled in (True, False):
        with paddle.set_grad_enabled(enabled):
            y = linear._recomputed_linear(x, w, b, saved.append)
            assert paddle.is_grad_enabled() is enabled
        np.testing.assert_allclose(y.numpy(), (x @ w + b).numpy(), rtol=1e-6)
    assert [s is x for s in saved] == [True, True]  # x handed to the pack hook, as the PyLayer


@pytest.mark.parametrize("p_dtype", ["float64", "float16"])
@pytest.mark.parametrize("transpose_weight", [False, True])
@pytest.mark.parametrize("want", [(True, True), (True, False), (False, True)])
def test_plain_param_grads_come_in_the_parameters_dtypes(transpose_weight, want, p_dtype):
    """``plain_param_grads`` (a ``paddle.grad`` pass's weight/bias gradients) returns new tensors
    in the parameters' dtypes, as Paddle's linear does, whatever dtype the product ran in:
    float64 or float16 parameters of a float32 product get the float32 gradients in theirs."""
    from paddle_mgrad.linear import plain_param_grads

    rs = np.random.RandomState(5)
    x = rs.standard_normal([2, 3, 4]).astype("float32")
    dy = rs.standard_normal([2, 3, 5]).astype("float32")
    w = paddle.zeros([5, 4] if transpose_weight else [4, 5], dtype=p_dtype)
    b = paddle.zeros([5], dtype=p_dtype)
    dw, db = plain_param_grads(
        paddle.to_tensor(x), paddle.to_tensor(dy), w, b, transpose_weight, *want
    )
    x2, dy2 = x.reshape(-1, 4), dy.reshape(-1, 5)
    for got, wanted, expected in ((dw, want[0], x2.T @ dy2), (db, want[1], dy2.sum(0))):
        if not wanted:
            assert got is None
            continue
        assert got.dtype == getattr(paddle, p_dtype)
        if transpose_weight and got is dw:
            expected = expected.T
        tol = 1e-5 if p_dtype == "float64" else 2e-3  # (within an ulp of float16)
        np.testing.assert_allclose(
            got.astype("float32").numpy(), expected.astype(p_dtype), rtol=tol, atol=tol
        )


@pytest.mark.parametrize("first", [True, False], ids=["first_micro_step", "later"])
def test_weight_and_bias_grads_of_float64_parameters_into_their_main_grad(first):
    """``weight_and_bias_grads`` without dtype names at hand (the overlap linears, the
    zero-bubble store call it so): float64 parameters accumulate into a float64 main_grad --
    their master-gradient dtype -- in place, and nothing is refused."""
    from paddle_mgrad.linear import weight_and_bias_grads

    rs = np.random.RandomState(11)
    x = paddle.to_tensor(rs.standard_normal([2, 3, 4]))
    dy = paddle.to_tensor(rs.standard_normal([2, 3, 5]))
    w = paddle.create_parameter([4, 5], "float64")
    b = paddle.create_parameter([5], "float64", is_bias=True)
    start = [None, None] if first else [rs.standard_normal(s) for s in ([4, 5], [5])]
    for p, v in zip((w, b), start):
        p.main_grad = None if v is None else paddle.to_tensor(v)
    ptrs = [None if p.main_grad is None else p.main_grad.data_ptr() for p in (w, b)]
    with paddle.no_grad():
        out = weight_and_bias_grads(x, dy, w, b, False)
    assert out == (None, None)  # everything went into main_grad
    x2, dy2 = x.numpy().reshape(-1, 4), dy.numpy().reshape(-1, 5)
    for p, v, ptr, g in zip((w, b), start, ptrs, (x2.T @ dy2, dy2.sum(0))):
        assert p.main_grad.dtype == paddle.float64
        if ptr is not None:
            assert p.main_grad.data_ptr() == ptr  # in place
        np.testing.assert_allclose(p.main_grad.numpy(), g + (0 if v is None else v), rtol=1e-12)


def _with_accumulator(p, kind, rs):
    """Give parameter ``p`` the gradient destination ``kind``: ``main_grad_none`` (first
    micro-step), ``main_grad`` (a float32 one holding values), ``grad`` (a ``.grad`` of its own
    dtype, from a backward: ones) or ``fresh`` (neither).  Returns what it holds before, float64."""
    if kind == "main_grad_none":
        p.main_grad = None
        return 0.0
    if kind == "main_grad":
        v = rs.standard_normal(p.shape).astype("float32")
        p.main_grad = paddle.to_tensor(v)
        return v.astype("float64")
    if kind == "grad":
        (p.astype("float32") * 1.0).sum().backward()
        assert p.grad is not None and p.grad.dtype == p.dtype
        return np.ones(p.shape)
    return 0.0


# (no bias with a .grad: Paddle's add_ accumulates that one, as in Paddle's own backward, and its
# CPU kernels have no bf16/fp16 add, with or without paddle_mgrad)
@pytest.mark.parametrize("b_kind", ["none", "main_grad_none", "main_grad", "fresh"])
@pytest.mark.parametrize("w_kind", ["main_grad_none", "main_grad", "grad", "fresh"])
@pytest.mark.parametrize("transpose_weight", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_weight_and_bias_grads_of_half_precision_parameters(
    dtype, transpose_weight, w_kind, b_kind
):
    """The fused op's accumulation for bf16/fp16 inputs and parameters, every kind of gradient
    destination for weight and bias: ``main_grad`` is float32 (allocated so on the first
    micro-step, else accumulated in place), a ``.grad`` of the parameter's dtype is accumulated
    in place, a fresh gradient comes back in the parameter's dtype -- values as a float64
    product of the same inputs."""
    from paddle_mgrad.linear import weight_and_bias_grads

    rs = np.random.RandomState(13)
    K, N = 6, 5
    x = paddle.to_tensor(rs.standard_normal([2, 3, K]).astype("float32")).astype(dtype)
    dy = paddle.to_tensor(rs.standard_normal([2, 3, N]).astype("float32")).astype(dtype)
    half = paddle.nn.initializer.Constant(0.5)  # (Paddle has no default initializer for these)
    w = paddle.create_parameter(
        [N, K] if transpose_weight else [K, N], dtype, default_initializer=half
    )
    b = None
    if b_kind != "none":
        b = paddle.create_parameter([N], dtype, is_bias=True, default_initializer=half)
    before = {"w": _with_accumulator(w, w_kind, rs)}
    if b is not None:
        before["b"] = _with_accumulator(b, b_kind, rs)
    ptrs = {
        name: (p.main_grad if kind == "main_grad" else p.grad).data_ptr()
        for name, p, kind in (("w", w, w_kind), ("b", b, b_kind))
        if kind in ("main_grad", "grad")
    }
    with paddle.no_grad():
        out_w, out_b = weight_and_bias_grads(x, dy, w, b, transpose_weight)
    x2 = x.astype("float32").numpy().astype("float64").reshape(-1, K)
    dy2 = dy.astype("float32").numpy().astype("float64").reshape(-1, N)
    grads = {"w": dy2.T @ x2 if transpose_weight else x2.T @ dy2, "b": dy2.sum(0)}
    for name, p, kind, out in (("w", w, w_kind, out_w), ("b", b, b_kind, out_b)):
        if p is None:
            assert out is None
            continue
        want = before[name] + grads[name]
        if kind.startswith("main_grad"):
            got = p.main_grad
            assert out is None and got.dtype == paddle.float32, (name, got.dtype)
            tol = 1e-5
        elif kind == "grad":
            got = p.grad
            assert out is None and got.dtype == p.dtype
            tol = 2e-2
        else:
            got = out
            assert got.dtype == p.dtype, (name, got.dtype)
            tol = 2e-2
        if name in ptrs:
            assert got.data_ptr() == ptrs[name], name  # in place
        np.testing.assert_allclose(got.astype("float32").numpy(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "x_dtype, p_dtype", [("bfloat16", "float32"), ("float16", "float32"), ("float32", "float64")]
)
def test_a_fresh_weight_gradient_is_accumulated_and_returned_in_the_parameters_dtype(
    x_dtype, p_dtype
):
    """A weight without main_grad or .grad whose dtype is wider than the product's (a float32
    parameter of a bf16/fp16 product, as under autocast; a float64 one of a float32 product),
    and no bias to ride along: its gradient is accumulated in the parameter's dtype, not rounded
    to the product's, and returned in it."""
    from paddle_mgrad.linear import weight_and_bias_grads

    rs = np.random.RandomState(17)
    x = paddle.to_tensor(rs.standard_normal([3, 7, 6]).astype("float32")).astype(x_dtype)
    dy = paddle.to_tensor(rs.standard_normal([3, 7, 5]).astype("float32")).astype(x_dtype)
    w = paddle.create_parameter([6, 5], p_dtype)
    with paddle.no_grad():
        out_w, out_b = weight_and_bias_grads(x, dy, w, None, False)
    assert out_b is None and out_w.dtype == getattr(paddle, p_dtype)
    x2 = x.astype("float32").numpy().astype("float64").reshape(-1, 6)
    dy2 = dy.astype("float32").numpy().astype("float64").reshape(-1, 5)
    np.testing.assert_allclose(out_w.numpy(), x2.T @ dy2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transpose_weight", [False, True])
@pytest.mark.parametrize("x_dtype", [None, "float32", "float64"])
def test_input_grad_in_dys_dtype_then_xs(x_dtype, transpose_weight):
    """``input_grad``: ``dx = dy · Wᵀ`` computed in ``dy``'s dtype -- a weight of another dtype
    cast to it first -- and returned in ``x_dtype``, or in ``dy``'s when that is None (the
    fleet linears, whose collective runs on it)."""
    from paddle_mgrad.linear import input_grad

    rs = np.random.RandomState(19)
    dy = rs.standard_normal([2, 3, 5]).astype("float32")
    w = rs.standard_normal([5, 4] if transpose_weight else [4, 5])  # float64: another dtype
    dx = input_grad(paddle.to_tensor(dy), paddle.to_tensor(w), transpose_weight, x_dtype)
    assert dx.dtype == getattr(paddle, x_dtype or "float32")
    w32 = w.astype("float32")
    want = dy @ (w32 if transpose_weight else w32.T)
    np.testing.assert_allclose(dx.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "bias, weight_is_a_parameter", [(True, False), (False, False), (True, True)]
)
def test_plain_tensor_parameters_get_their_gradient_in_grad(dtype, bias, weight_is_a_parameter):
    """Weight and bias as plain tensors that need a gradient, not parameters (on Paddle 2.6 such
    a tensor has no ``__dict__``, so no ``main_grad`` to find) -- or only the bias so, beside a
    weight with ``main_grad``: the fused linear gives a plain tensor the plain gradient in
    ``.grad``, as Paddle's linear does."""
    rs = np.random.RandomState(23)
    x = paddle.to_tensor(rs.standard_normal([4, 5]).astype(dtype))
    w = paddle.to_tensor(rs.standard_normal([5, 3]).astype(dtype), stop_gradient=False)
    if weight_is_a_parameter:
        w = paddle.create_parameter([5, 3], dtype)
        w.set_value(rs.standard_normal([5, 3]).astype(dtype))
        w.main_grad = None
    b = (
        paddle.to_tensor(rs.standard_normal([3]).astype(dtype), stop_gradient=False)
        if bias
        else None
    )
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        before = stats.linear["backward"]
        (paddle.nn.functional.linear(x, w, b) ** 2).sum().backward()
        assert stats.linear["backward"] == before + 1  # ours
    finally:
        paddle_mgrad.disable()
    x64, w64 = x.numpy().astype("f8"), w.numpy().astype("f8")
    dy = 2 * (x64 @ w64 + (b.numpy() if bias else 0))
    dw = w.main_grad if weight_is_a_parameter else w.grad
    np.testing.assert_allclose(dw.numpy(), x64.T @ dy, rtol=1e-5)
    if bias:
        np.testing.assert_allclose(b.grad.numpy(), dy.sum(0), rtol=1e-5)
