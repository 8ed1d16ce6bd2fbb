"""fleet's overlap column linear (mp_async_allreduce) with paddle_mgrad's fused linear on:
dW/db accumulate in place into fp32 main_grad through our op; dx is all-reduced.
Single process, the all-reduce recorded (2-rank runs: tests/fleet/launch)."""

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.layers.mpu import mp_layers
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import nonzero_biases
from paddle_mgrad import stats
from paddle_mgrad.fleet.overlap_linear import OverlapLinearWithGradAdd


class _Task:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


class _PG:
    def all_reduce(self, t, op, sync_op=False):  # Paddle's own class calls this
        return _Task()


class Group:
    nranks, rank, id, process_group = 2, 0, 0, _PG()


@pytest.fixture
def reduced(monkeypatch):
    calls = []

    def all_reduce(t, op=None, group=None, sync_op=True):
        task = _Task()
        calls.append((t, group, sync_op, task))
        return task

    monkeypatch.setattr(paddle.distributed, "all_reduce", all_reduce)
    return calls


def _apply(cls, x, layer, fused_gradadd):
    return cls.apply(x, layer.weight, layer.bias, False, True, True, fused_gradadd, Group)


def test_registry_swaps_the_class_and_restores_it():
    original = mp_layers.InnerOverlapLinear
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    assert mp_layers.InnerOverlapLinear is OverlapLinearWithGradAdd
    paddle_mgrad.disable()
    assert mp_layers.InnerOverlapLinear is original


@pytest.mark.parametrize("fused_gradadd", [False, True])
def test_main_grad_accumulated_in_place(reduced, fused_gradadd):
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    paddle.seed(1)
    layer = paddle.nn.Linear(8, 6)
    MixPrecisionLayer(layer, dtype="bfloat16")
    rs = np.random.RandomState(0)
    xs = [rs.standard_normal((2, 5, 8)).astype("float32") for _ in range(2)]
    dys = [rs.standard_normal((2, 5, 6)).astype("float32") for _ in range(2)]
    w64 = layer.weight.numpy().astype("f8")
    stats.reset()
    ptrs = []
    for x_np, dy_np in zip(xs, dys):
        x = paddle.to_tensor(x_np)
        x.stop_gradient = False
        y = _apply(mp_layers.InnerOverlapLinear, x, layer, fused_gradadd)
        np.testing.assert_allclose(y.numpy(), x_np @ w64 + layer.bias.numpy(), rtol=1e-5, atol=1e-5)
        y.backward(paddle.to_tensor(dy_np))
        np.testing.assert_allclose(x.grad.numpy(), dy_np @ w64.T, rtol=1e-5, atol=1e-5)
        t, group, sync_op, task = reduced[-1]
        assert group is Group and sync_op is False and task.waited  # async dx all-reduce
        ptrs.append((layer.weight.main_grad.data_ptr(), layer.bias.main_grad.data_ptr()))
    assert ptrs[0] == ptrs[1]  # second micro-step accumulated in place
    assert layer.weight.grad is None and layer.bias.grad is None  # nothing reached the hook
    x2 = np.concatenate([x.reshape(-1, 8) for x in xs]).astype("f8")
    dy2 = np.concatenate([d.reshape(-1, 6) for d in dys]).astype("f8")
    assert layer.weight.main_grad.dtype == paddle.float32
    np.testing.assert_allclose(layer.weight.main_grad.numpy(), x2.T @ dy2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.bias.main_grad.numpy(), dy2.sum(0), rtol=1e-5, atol=1e-5)
    assert stats.linear["overlap_backward"] == 2
    assert stats.linear["into_main_grad"] == 4
    assert {layer.weight.name, layer.bias.name} <= stats.fused_params


def test_without_main_grad_returns_the_gradient(reduced):
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    layer = paddle.nn.Linear(8, 6)
    x_np = np.random.RandomState(2).standard_normal((3, 8)).astype("float32")
    x = paddle.to_tensor(x_np)
    x.stop_gradient = False
    _apply(mp_layers.InnerOverlapLinear, x, layer, False).sum().backward()
    np.testing.assert_allclose(
        layer.weight.grad.numpy(), x_np.T.astype("f8") @ np.ones((3, 6)), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(layer.bias.grad.numpy(), np.full(6, 3.0), rtol=1e-6)


def test_native_fused_gradadd_on_cpu():
    """Paddle's own InnerOverlapLinear refuses mp_fused_linear_param_grad_add where its op is
    GPU-only (the path ours makes work)."""
    layer = paddle.nn.Linear(8, 6)
    MixPrecisionLayer(layer, dtype="bfloat16")
    x = paddle.randn([3, 8])
    x.stop_gradient = False
    # CPU wheel 2.6 names it ("NotImplementedError: You set mp_fused_linear_param_grad_add=True
    # ..."); 3.3's backward engine reports only "(External)"; a CUDA wheel has the op but no
    # CPU kernel ("... fused_linear_param_grad_add` is not registered")
    with pytest.raises(
        Exception,
        match=r"NotImplementedError: You set mp_fused_linear_param_grad_add"
        r"|^\(External\) $|fused_linear_param_grad_add` is not registered",
    ):
        _apply(mp_layers.InnerOverlapLinear, x, layer, True).sum().backward()
    assert layer.weight.main_grad is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("which", ["weight", "bias"])
def test_non_fp32_main_grad_is_refused_in_forward(reduced, which, dtype):
    """A low-precision main_grad on the overlap path: a FusedLinearError from FORWARD naming
    the parameter, its shape and dtype (as our linear does), not an OSError out of Paddle's
    backward engine; nothing is computed, nothing all-reduced, the bad main_grad untouched."""
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    layer = paddle.nn.Linear(8, 6)
    MixPrecisionLayer(layer, dtype="bfloat16")
    p = getattr(layer, which)
    bad = paddle.zeros(p.shape).astype(dtype)
    p.main_grad = bad
    x = paddle.randn([3, 8])
    x.stop_gradient = False
    stats.reset()
    pattern = (
        rf"^{p.name}\.main_grad is paddle\.{dtype} \[{', '.join(map(str, p.shape))}\], "
        r"expected float32"
    )
    with pytest.raises(paddle_mgrad.FusedLinearError, match=pattern):
        _apply(mp_layers.InnerOverlapLinear, x, layer, True)
    assert stats.linear["overlap_forward"] == 0 and not reduced
    assert bad.astype("float32").abs().sum().item() == 0


def test_fuse_matmul_bias_without_bias_falls_back_to_linear(reduced):
    """fuse_matmul_bias with no bias: no epilogue to fuse, and fused_gemm_epilogue(x, w, None)
    fails (in Paddle too) -- Paddle's linear computes the same product; gradients as usual."""
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    layer = paddle.nn.Linear(8, 6, bias_attr=False)
    MixPrecisionLayer(layer, dtype="bfloat16")
    rs = np.random.RandomState(3)
    x_np = rs.standard_normal((2, 5, 8)).astype("float32")
    x = paddle.to_tensor(x_np)
    x.stop_gradient = False
    y = mp_layers.InnerOverlapLinear.apply(x, layer.weight, None, True, True, True, False, Group)
    w64 = layer.weight.numpy().astype("f8")
    np.testing.assert_allclose(y.numpy(), x_np @ w64, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.ones((2, 5, 6)) @ w64.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        layer.weight.main_grad.numpy(),
        x_np.reshape(-1, 8).T.astype("f8") @ np.ones((10, 6)),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("wrt", ["x", "weight", "x+bias"])
def test_paddle_grad_returns_plain_gradients(reduced, wrt):
    """paddle.grad through the overlap linear: the gradients asked for (dx all-reduced),
    None-free for the others, main_grad untouched (before: 'should return None at k
    position' from Paddle, or main_grad written)."""
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    layer = paddle.nn.Linear(8, 6)
    MixPrecisionLayer(layer, dtype="bfloat16")
    rs = np.random.RandomState(4)
    x_np = rs.standard_normal((5, 8)).astype("float32")
    x = paddle.to_tensor(x_np)
    x.stop_gradient = False
    y = _apply(mp_layers.InnerOverlapLinear, x, layer, False)
    inputs = {"x": [x], "weight": [layer.weight], "x+bias": [x, layer.bias]}[wrt]
    grads = paddle.grad((y * y).sum(), inputs)
    dy = 2 * (x_np.astype("f8") @ layer.weight.numpy().astype("f8") + layer.bias.numpy())
    want = {
        "x": dy @ layer.weight.numpy().astype("f8").T,
        "bias": dy.sum(0),
        "weight": x_np.T.astype("f8") @ dy,
    }
    for name, g in zip(wrt.split("+"), grads):
        np.testing.assert_allclose(g.numpy(), want[name], rtol=1e-5, atol=1e-4)
    assert bool(reduced) == ("x" in wrt.split("+"))  # dx all-reduced only when asked for
    assert layer.weight.main_grad is None and layer.bias.main_grad is None
    assert layer.weight.grad is None and layer.bias.grad is None


def _bit_identical_with_recompute(run):
    """``run(recompute)`` without, then with recompute (paddle_mgrad on): every array it returns
    equal bit for bit; the recompute's policy counters."""
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        plain = run(False)
        stats.reset()
        ours = run(True)
        counters = stats.snapshot()["policy"]
    finally:
        paddle_mgrad.disable()
    for a, b in zip(ours, plain):
        np.testing.assert_array_equal(a, b)
    return counters


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("policy", ["full", "gemm", "gemm_in_place"])
def test_under_a_recompute_policy_as_without_recompute(reduced, policy, use_reentrant):
    """The overlap linear inside a recompute block (fleet's TP column linear under PaddleNLP's
    recompute): output, input gradient and ``main_grad`` bit-identical to the block run without
    recompute, with the dx all-reduce done once per backward; under ``gemm`` the recomputation
    hands back the output kept from the forward instead of multiplying again -- unless the
    output is changed in place after it (``gemm_in_place``): then it multiplies again, bias
    included."""
    paddle.seed(3)
    layer = nonzero_biases(paddle.nn.Linear(8, 6))
    MixPrecisionLayer(layer, dtype="bfloat16")
    x_np = np.random.RandomState(5).standard_normal((2, 5, 8)).astype("float32")
    in_place = policy == "gemm_in_place"
    policy = "gemm" if in_place else policy

    def block(x):
        y = _apply(mp_layers.InnerOverlapLinear, x, layer, True)
        if in_place:
            y.scale_(3.0)
        return paddle.tanh(y) * 2.0

    def run(recompute):
        for p in layer.parameters():
            p.main_grad = None
        x = paddle.to_tensor(x_np)
        x.stop_gradient = False
        if recompute:
            y = paddle_mgrad.recompute(block, x, use_reentrant=use_reentrant, policy=policy)
        else:
            y = block(x)
        before = len(reduced)
        (y * y).sum().backward()
        assert len(reduced) - before == 1  # one dx all-reduce per backward
        return [y.numpy(), x.grad.numpy()] + [p.main_grad.numpy() for p in layer.parameters()]

    counters = _bit_identical_with_recompute(run)
    if in_place:
        assert counters["gemm"]["gemms_not_recomputed"] == 0
    elif policy == "gemm":
        assert counters["gemm"]["gemms_not_recomputed"] == 1
        assert counters["gemm"]["kept_bytes"] == 2 * 5 * 6 * 4
    else:
        assert counters == {}


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_kept_output_of_a_frozen_overlap_linear_comes_back_needing_no_gradient(
    reduced, use_reentrant
):
    """A frozen overlap linear fed by a tensor that needs no gradient (a LoRA base layer after a
    frozen embedding): its output needs none in the forward, so the op after it saves nothing of
    it there; under ``gemm`` the recomputation hands the kept output back needing none too, and
    the ops after it save what they saved in the forward: bit-identical to no recompute."""
    paddle.seed(3)
    layer = nonzero_biases(paddle.nn.Linear(8, 6))
    for p in layer.parameters():
        p.stop_gradient = True
    scale = paddle.create_parameter([6], "float32")
    scale.set_value(np.linspace(0.5, 1.5, 6).astype("float32"))
    x_np = np.random.RandomState(5).standard_normal((2, 5, 8)).astype("float32")

    def block(x):
        y = _apply(mp_layers.InnerOverlapLinear, x, layer, True)
        return paddle.sin(y) * scale

    def run(recompute):
        scale.clear_gradient()
        x = paddle.to_tensor(x_np)  # needs no gradient
        if recompute:
            y = paddle_mgrad.recompute(block, x, use_reentrant=use_reentrant, policy="gemm")
        else:
            y = block(x)
        (y * y).sum().backward()
        return [y.numpy(), scale.grad.numpy()]

    counters = _bit_identical_with_recompute(run)
    assert counters["gemm"]["gemms_not_recomputed"] == 1
