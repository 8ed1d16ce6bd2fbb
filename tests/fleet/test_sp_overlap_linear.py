"""fleet's sequence-parallel overlap column linear (Paddle 3.x ``SPInnerOverlapLinear``,
``mp_configs.sp_async_reduce_scatter``) with paddle_mgrad's fused linear on: dW/db accumulate
in place into fp32 main_grad through our op; dx is reduce-scattered asynchronously.
Single process: a 2-rank group whose collectives are recorded (2-rank runs: tests/fleet/launch)."""

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import PADDLE2, nonzero_biases
from paddle_mgrad import registry, stats

if not hasattr(spu, "SPInnerOverlapLinear"):
    # a Paddle 3 without it is a failure, not a skip
    assert PADDLE2, paddle.__version__
    pytest.skip(
        f"Paddle {paddle.__version__} has no SPInnerOverlapLinear (a Paddle 3.x class)",
        allow_module_level=True,
    )

from paddle_mgrad.fleet.sp_overlap_linear import SPOverlapLinearWithGradAdd

H, N, S, B = 8, 6, 3, 2  # in features, out features (this rank's shard), local seq, batch


class _Task:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


class Group:
    nranks, rank, id = 2, 0, 0


@pytest.fixture
def comm(monkeypatch):
    """Rank 0 of 2: the other rank's sequence shard is ``other``; reduce-scatter keeps rank 0's
    rows of its input (the other rank's contribution is zero)."""
    rec = {"other": None, "gather": [], "rs": []}

    def all_gather(x):  # sequence_parallel_utils.all_gather (forward)
        return paddle.concat([x, rec["other"]], axis=0)

    def dist_all_gather(out, x, group=None, sync_op=True):  # recompute_allgather (backward)
        assert isinstance(out, paddle.Tensor) and group is Group
        paddle.assign(paddle.concat([x, rec["other"]], axis=0), output=out)
        task = _Task()
        rec["gather"].append((sync_op, task))
        return task

    def reduce_scatter(out, inp, op=None, group=None, sync_op=True, use_calc_stream=False):
        assert group is Group and op == paddle.distributed.ReduceOp.SUM
        paddle.assign(inp[: inp.shape[0] // 2], output=out)
        task = _Task()
        rec["rs"].append((out, sync_op, task))
        return task

    monkeypatch.setattr(spu, "all_gather", all_gather)
    monkeypatch.setattr(paddle.distributed, "all_gather", dist_all_gather)
    monkeypatch.setattr(paddle.distributed.stream, "reduce_scatter", reduce_scatter)
    return rec


def _apply(x, layer, recompute_allgather=False, fused_gradadd=False):
    return spu.SPInnerOverlapLinear.apply(
        x, layer.weight, layer.bias, False, recompute_allgather, fused_gradadd, Group
    )


def test_registry_swaps_the_class_and_restores_it():
    original = spu.SPInnerOverlapLinear
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    assert spu.SPInnerOverlapLinear is SPOverlapLinearWithGradAdd
    assert registry.is_installed("SPInnerOverlapLinear")
    paddle_mgrad.disable()
    assert spu.SPInnerOverlapLinear is original


@pytest.mark.parametrize("recompute_allgather", [False, True])
@pytest.mark.parametrize("fused_gradadd", [False, True])
def test_main_grad_accumulated_in_place(comm, fused_gradadd, recompute_allgather):
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    paddle.seed(1)
    layer = paddle.nn.Linear(H, N)
    MixPrecisionLayer(layer, dtype="bfloat16")
    rs = np.random.RandomState(0)
    w64, b64 = layer.weight.numpy().astype("f8"), layer.bias.numpy().astype("f8")
    stats.reset()
    ptrs, xs_full, dys = [], [], []
    for _ in range(2):  # two micro-steps
        x_np = rs.standard_normal((S, B, H)).astype("float32")
        other = rs.standard_normal((S, B, H)).astype("float32")
        dy_np = rs.standard_normal((2 * S, B, N)).astype("float32")
        comm["other"] = paddle.to_tensor(other)
        x = paddle.to_tensor(x_np)
        x.stop_gradient = False
        y = _apply(x, layer, recompute_allgather, fused_gradadd)
        full = np.concatenate([x_np, other]).astype("f8")
        np.testing.assert_allclose(y.numpy(), full @ w64 + b64, rtol=1e-5, atol=1e-5)
        y.backward(paddle.to_tensor(dy_np))
        # dx: this rank's rows of dy·Wᵀ, reduce-scattered asynchronously, waited for
        np.testing.assert_allclose(
            x.grad.numpy(), (dy_np.astype("f8") @ w64.T)[:S], rtol=1e-5, atol=1e-5
        )
        out, sync_op, task = comm["rs"][-1]
        assert sync_op is False and task.waited
        if recompute_allgather:  # input re-gathered in backward, asynchronously
            assert len(comm["gather"]) == len(ptrs) + 1
            assert comm["gather"][-1][0] is False and comm["gather"][-1][1].waited
        else:
            assert comm["gather"] == []
        xs_full.append(full.reshape(-1, H))
        dys.append(dy_np.reshape(-1, N).astype("f8"))
        ptrs.append((layer.weight.main_grad.data_ptr(), layer.bias.main_grad.data_ptr()))
    assert ptrs[0] == ptrs[1]  # second micro-step accumulated in place
    assert layer.weight.grad is None and layer.bias.grad is None  # nothing reached the hook
    x2, dy2 = np.concatenate(xs_full), np.concatenate(dys)
    assert layer.weight.main_grad.dtype == paddle.float32
    np.testing.assert_allclose(layer.weight.main_grad.numpy(), x2.T @ dy2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.bias.main_grad.numpy(), dy2.sum(0), rtol=1e-5, atol=1e-5)
    assert stats.linear["sp_overlap_backward"] == 2
    assert stats.linear["into_main_grad"] == 4
    assert {layer.weight.name, layer.bias.name} <= stats.fused_params


def test_without_main_grad_and_bias_returns_the_gradient(comm):
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    layer = paddle.nn.Linear(H, N, bias_attr=False)
    rs = np.random.RandomState(2)
    x_np = rs.standard_normal((S, B, H)).astype("float32")
    other = rs.standard_normal((S, B, H)).astype("float32")
    comm["other"] = paddle.to_tensor(other)
    x = paddle.to_tensor(x_np)
    x.stop_gradient = False
    _apply(x, layer).sum().backward()
    full = np.concatenate([x_np, other]).reshape(-1, H).astype("f8")
    np.testing.assert_allclose(
        layer.weight.grad.numpy(), full.T @ np.ones((2 * S * B, N)), rtol=1e-5, atol=1e-5
    )


def test_native_fused_gradadd_on_cpu(comm):
    """Paddle's own SPInnerOverlapLinear refuses mp_fused_linear_param_grad_add unless Paddle
    is compiled for CUDA/XPU (the path ours makes work), before touching main_grad."""
    layer = paddle.nn.Linear(H, N)
    MixPrecisionLayer(layer, dtype="bfloat16")
    comm["other"] = paddle.randn([S, B, H])
    x = paddle.randn([S, B, H])
    x.stop_gradient = False
    # 3.3's backward engine may report only "(External)"; a CUDA wheel has the op but no
    # CPU kernel ("... fused_linear_param_grad_add` is not registered")
    with pytest.raises(
        Exception,
        match=r"NotImplementedError: You set mp_fused_linear_param_grad_add"
        r"|^\(External\) |fused_linear_param_grad_add` is not registered",
    ):
        _apply(x, layer, fused_gradadd=True).sum().backward()
    assert layer.weight.main_grad is None


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_non_fp32_main_grad_is_refused_in_forward(comm, which):
    """A bf16 main_grad: a FusedLinearError from FORWARD naming the parameter, its shape and
    dtype, before any collective; the bad main_grad untouched."""
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    layer = paddle.nn.Linear(H, N)
    MixPrecisionLayer(layer, dtype="bfloat16")
    p = getattr(layer, which)
    bad = paddle.zeros(p.shape).astype("bfloat16")
    p.main_grad = bad
    comm["other"] = None  # an all-gather would fail on it
    x = paddle.randn([S, B, H])
    x.stop_gradient = False
    stats.reset()
    pattern = (
        rf"^{p.name}\.main_grad is paddle\.bfloat16 \[{', '.join(map(str, p.shape))}\], "
        r"expected float32"
    )
    with pytest.raises(paddle_mgrad.FusedLinearError, match=pattern):
        _apply(x, layer, fused_gradadd=True)
    assert stats.linear["sp_overlap_forward"] == 0 and not comm["rs"]
    assert bad.astype("float32").abs().sum().item() == 0


def test_under_non_reentrant_recompute(comm):
    """Inside paddle_mgrad's non-reentrant recompute (the fleet configs' setting): the
    gradient lands in main_grad of the real parameter, equal to the plain-autograd one."""
    from paddle.distributed.fleet.utils import recompute

    paddle_mgrad.enable(recompute=True, fused_linear=True)
    paddle.seed(3)
    layer = paddle.nn.Linear(H, N)
    MixPrecisionLayer(layer, dtype="bfloat16")
    rs = np.random.RandomState(4)
    x_np = rs.standard_normal((S, B, H)).astype("float32")
    comm["other"] = paddle.to_tensor(rs.standard_normal((S, B, H)).astype("float32"))
    x = paddle.to_tensor(x_np)
    x.stop_gradient = False
    stats.reset()
    y = recompute(
        lambda t: paddle.tanh(_apply(t, layer, fused_gradadd=True)), x, use_reentrant=False
    )
    y.sum().backward()
    full = np.concatenate([x_np, comm["other"].numpy()]).reshape(-1, H).astype("f8")
    w64, b64 = layer.weight.numpy().astype("f8"), layer.bias.numpy().astype("f8")
    dy = 1 - np.tanh(full @ w64 + b64) ** 2
    np.testing.assert_allclose(layer.weight.main_grad.numpy(), full.T @ dy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.bias.main_grad.numpy(), dy.sum(0), rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None
    assert stats.recompute["recomputations"] == 1 and stats.linear["sp_overlap_backward"] == 1


@pytest.mark.parametrize("recompute_allgather", [False, True])
@pytest.mark.parametrize("wrt", ["x", "weight", "x+bias"])
def test_paddle_grad_returns_plain_gradients(comm, wrt, recompute_allgather):
    """paddle.grad through the sequence-parallel overlap linear: the gradients asked for
    (dx reduce-scattered), main_grad and .grad untouched (before: 'should return None at k
    position' from Paddle, or main_grad written)."""
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    layer = paddle.nn.Linear(H, N)
    MixPrecisionLayer(layer, dtype="bfloat16")
    rs = np.random.RandomState(5)
    x_np = rs.standard_normal((S, B, H)).astype("float32")
    other = rs.standard_normal((S, B, H)).astype("float32")
    comm["other"] = paddle.to_tensor(other)
    x = paddle.to_tensor(x_np)
    x.stop_gradient = False
    y = _apply(x, layer, recompute_allgather)
    inputs = {"x": [x], "weight": [layer.weight], "x+bias": [x, layer.bias]}[wrt]
    grads = paddle.grad(y.sum(), inputs)
    full = np.concatenate([x_np, other]).reshape(-1, H).astype("f8")
    w64 = layer.weight.numpy().astype("f8")
    want = {
        "x": (np.ones((2 * S, B, N)) @ w64.T)[:S],
        "weight": full.T @ np.ones((2 * S * B, N)),
        "bias": np.full(N, 2.0 * S * B),
    }
    for name, g in zip(wrt.split("+"), grads):
        np.testing.assert_allclose(g.numpy(), want[name], rtol=1e-5, atol=1e-5)
    assert bool(comm["rs"]) == ("x" in wrt.split("+"))  # dx reduce-scattered only when asked
    assert layer.weight.main_grad is None and layer.bias.main_grad is None
    assert layer.weight.grad is None and layer.bias.grad is None


def _policy_run(comm, how, policy, recompute_allgather):
    """Two micro-steps of ``tanh(linear(x))`` through the overlap linear (fused grad add, fp32
    master grads), recompute ``how`` ("none" or a mode) under ``policy``: outputs, input
    gradients, main_grads."""

    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(3)
        layer = nonzero_biases(paddle.nn.Linear(H, N))
        MixPrecisionLayer(layer, dtype="bfloat16")
        rs = np.random.RandomState(4)
        comm["other"] = paddle.to_tensor(rs.standard_normal((S, B, H)).astype("float32"))
        result = {}

        def block(t):
            return paddle.tanh(_apply(t, layer, recompute_allgather, fused_gradadd=True))

        for step in range(2):
            x = paddle.to_tensor(rs.standard_normal((S, B, H)).astype("float32"))
            x.stop_gradient = False
            if how == "none":
                y = block(x * 1.0)
            else:
                y = paddle_mgrad.recompute(
                    block, x * 1.0, use_reentrant=how == "reentrant", policy=policy
                )
            (y * y).sum().backward()
            result[f"y{step}"], result[f"dx{step}"] = y.numpy(), x.grad.numpy()
        result["w"] = layer.weight.main_grad.numpy()
        result["b"] = layer.bias.main_grad.numpy()
        return result
    finally:
        paddle_mgrad.disable()


@pytest.mark.parametrize("recompute_allgather", [False, True])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("policy", ["full", "gemm"])
def test_under_a_recompute_policy_as_without_recompute(
    comm, monkeypatch, policy, mode, recompute_allgather
):
    """Under ``gemm`` its output is kept and not multiplied again; the recomputation still
    saves what its forward saved (``x``, or the gathered input, gathered again): outputs and
    gradients bit-identical to no recompute."""
    ref = _policy_run(comm, "none", None, recompute_allgather)
    stats.reset()
    gathers = []
    real = spu.all_gather
    monkeypatch.setattr(spu, "all_gather", lambda x: gathers.append(1) or real(x))
    got = _policy_run(comm, mode, policy, recompute_allgather)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    # each step: the forward's gather, and the recomputation's (under gemm only where the
    # gathered input is what backward needs)
    assert len(gathers) == 2 * (1 + (policy == "full" or not recompute_allgather))
    if policy == "gemm":
        assert stats.snapshot()["policy"]["gemm"]["gemms_not_recomputed"] == 2
