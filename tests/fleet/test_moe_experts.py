"""A hand-written MoE whose expert runs on a zero-row ``[0, K]`` input (no token routed to it)
with paddle_mgrad's fused linear and recompute on, against plain Paddle running the same code:
no crash, the idle expert's fp32 ``main_grad`` exactly 0 (allocated as zeros on the first
micro-step, as Paddle's MixPrecisionLayer hook does; the same allocation afterwards), every other
gradient as plain Paddle's.  (PaddleNLP's Mixtral skips an idle expert instead:
tests/nlp/test_mixtral_moe.py.)  Paddle 2.6.2's ``nn.Linear`` refuses a ``[0, K]`` input, with or
without paddle_mgrad: asserted equal.  Plain Paddle 3.3.1's non-reentrant recompute fails on the
zero-size activation (asserted); paddle_mgrad's does not."""

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils import recompute
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import PADDLE2
from paddle_mgrad import stats

K, N, EXPERTS, TOKENS = 6, 5, 3, 8
IDLE = 2


class HandMoE(paddle.nn.Layer):
    """Top-1 routing given from outside; each expert runs on the rows routed to it (possibly
    none: a ``[0, K]`` input), its output scattered back and scaled by the router's weight."""

    def __init__(self):
        super().__init__()
        self.gate = paddle.nn.Linear(K, EXPERTS, bias_attr=False)
        self.experts = paddle.nn.LayerList([paddle.nn.Linear(K, N) for _ in range(EXPERTS)])

    def forward(self, x, route):
        prob = paddle.nn.functional.softmax(self.gate(x), axis=-1)
        out = paddle.zeros([x.shape[0], N])
        for e, expert in enumerate(self.experts):
            rows = paddle.nonzero(route == e).reshape([-1])  # [m], m may be 0
            y = expert(paddle.gather(x, rows)) * paddle.gather(prob[:, e], rows).unsqueeze(-1)
            out = paddle.index_add(out, rows, 0, y)
        return out


def _routes():
    """Micro-step routes: the idle expert gets no token in the 1st and 3rd, some in the 2nd."""
    rs = np.random.RandomState(5)
    idle = rs.randint(0, IDLE, TOKENS)  # experts 0..IDLE-1 only
    busy = np.arange(TOKENS) % EXPERTS
    return [idle, busy, idle]


def _run(mode, on):
    paddle_mgrad.disable()
    if on:
        paddle_mgrad.enable(recompute=True, fused_linear=True)
    paddle.seed(11)
    moe = HandMoE()
    MixPrecisionLayer(moe, dtype="bfloat16")
    rs = np.random.RandomState(6)
    stats.reset()
    idle_w = moe.experts[IDLE].weight
    record = []
    for step, route_np in enumerate(_routes()):
        x = paddle.to_tensor(rs.standard_normal((TOKENS, K)).astype("float32"), stop_gradient=False)
        c = paddle.to_tensor(rs.standard_normal((TOKENS, N)).astype("float32"))
        route = paddle.to_tensor(route_np)
        if mode == "none":
            y = moe(x, route)
        else:
            # no randomness here; Paddle 2.6's non-reentrant recompute cannot preserve CPU RNG
            y = recompute(
                moe, x, route, use_reentrant=mode == "reentrant", preserve_rng_state=False
            )
        (y * c).sum().backward()
        mg = idle_w.main_grad
        record.append(
            (
                None if mg is None else mg.numpy().copy(),
                None if mg is None else mg.data_ptr(),
                idle_w.grad is None,
            )
        )
        if step == 1:  # what MixPrecisionOptimizer.clear_grad does between steps
            for p in moe.parameters():
                p.main_grad.zero_()
    grads = {n: p.main_grad.numpy() for n, p in moe.named_parameters()}
    return record, grads, x.grad.numpy(), stats.snapshot()


@pytest.mark.parametrize("mode", ["none", "non_reentrant", "reentrant"])
def test_idle_expert_on_zero_rows(mode):
    if PADDLE2:  # nn.Linear refuses the [0, K] input, with or without us: the same error
        got = []
        for on in (False, True):
            with pytest.raises(ValueError) as e:
                _run(mode, on)
            got.append(str(e.value))
        assert got[0] == got[1] and "dims size must not be equal 0" in got[0], got
        return
    if mode == "non_reentrant":
        # Plain Paddle 3.3.1 cannot: its non-reentrant recompute re-saves each activation as a
        # "<name>cpy" tensor sharing the buffer (recompute.py:487, _unsafe_share_buffer_to); a
        # zero-size activation has no buffer, the copy stays uninitialized and backward fails.
        # The reference is then plain Paddle without recompute (the same math).
        with pytest.raises(RuntimeError, match="Tensor not initialized yet"):
            _run(mode, on=False)
    ref_record, ref_grads, ref_dx, _ = _run("none" if mode == "non_reentrant" else mode, on=False)
    record, grads, dx, s = _run(mode, on=True)
    # our op ran for every expert call, the idle one's [0, K] included: 3 micro-steps x
    # (gate + EXPERTS experts) linear backwards, each weight (and bias) into main_grad
    assert s["linear"]["backward"] == 3 * (1 + EXPERTS), s["linear"]
    assert s["linear"]["into_main_grad"] == 3 * (1 + 2 * EXPERTS), s["linear"]
    if mode != "none":
        assert s["recompute"][mode] == 3
    (mg0, ptr0, nograd0), (mg1, ptr1, nograd1), (mg2, ptr2, nograd2) = record
    assert nograd0 and nograd1 and nograd2
    # first micro-step (main_grad None): allocated as exact zeros, as Paddle's hook does
    assert mg0 is not None and mg0.dtype == np.float32 and not mg0.any()
    assert ref_record[0][0] is not None and not ref_record[0][0].any()
    assert mg1.any()  # the 2nd micro-step gave it tokens: a real gradient, in place
    assert ptr1 == ptr0 and ptr2 == ptr0
    assert not mg2.any()  # zeroed, then no token: stays exactly 0, same allocation
    for n in ref_grads:
        np.testing.assert_allclose(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, err_msg=n)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)
