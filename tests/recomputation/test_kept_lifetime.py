"""How long what a recompute policy keeps from a block's forward lives
(:mod:`paddle_mgrad.recomputation.non_reentrant`, :class:`.autograd.recomputing.KeptOutputs`,
:mod:`.recomputation.saved_sublayers`).

A backward that frees the graph (no ``retain_graph``) lets go of a kept value once it read it,
as Paddle lets go of a saved tensor once the op that saved it ran its backward: a graph still
alive after its backward -- ``loss = model(x); loss.backward()`` in a loop holds the last
``loss`` through the next step's forward -- holds no more under a policy than under full
recompute.  What is read again after it was let go of (a ``PyLayer`` that reads its saved
tensor twice) is recomputed, bit-identical; a backward that retains the graph keeps what it
read for the next one."""

import gc

import numpy as np
import paddle
import policy_runs
import pytest
from decoder import D, Decoder, custom_forward

import paddle_mgrad
from paddle_mgrad import _compat, stats

MODES = ("reentrant", "non_reentrant")
#: rows of the input: the kept values are kilobytes, well above the allocator's rounding
ROWS = 64


class _Stack(paddle.nn.Layer):
    """Two decoder layers, each a recompute block (as a model's layers are)."""

    def __init__(self):
        super().__init__()
        self.layers = paddle.nn.LayerList([Decoder(), Decoder()])

    def forward(self, x, mode, policy):
        for layer in self.layers:
            x = paddle_mgrad.recompute(
                custom_forward(layer), x, use_reentrant=mode == "reentrant", policy=policy
            )
        return x


def _allocated():
    now, _ = _compat.HOST_MEMORY_STATS
    return now("Allocated", 0)


def _held_by_the_graph(policy, mode):
    """Bytes the host allocator holds after a step's backward while the step's loss (and so
    its graph) is alive, above what it held before the step; the bytes the policy kept in
    that step."""
    paddle.seed(3)
    net = _Stack()
    x = paddle.randn([ROWS, D])
    for _ in range(4):  # (gradients allocated; a budget plan measured, then made)
        net(x, mode, policy).sum().backward()
    gc.collect()
    stats.reset()
    before = _allocated()
    loss = net(x, mode, policy).sum()
    loss.backward()
    held = _allocated() - before
    kept = stats.snapshot()["policy"].get(policy, {}).get("kept_bytes", 0)
    del loss
    return held, kept


@pytest.mark.skipif(_compat.HOST_MEMORY_STATS is None, reason="no host allocator statistics")
@pytest.mark.parametrize("policy", ["gemm", "save:mlp", "save:self_attn", "budget:1"])
@pytest.mark.parametrize("mode", MODES)
def test_a_graph_alive_after_its_backward_holds_nothing_its_policy_kept(policy, mode, monkeypatch):
    # (budget: the plan keeps candidates, not only the step's last block whole, which spares
    # as much at times in these small blocks: test_last_block.py)
    policy_runs.never_the_last_block(monkeypatch)
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        # (a policy runs a reentrant call non-reentrant, whose graph holds the block's input
        # until it dies; the reentrant engine's node lets go of it after its backward)
        full, _ = _held_by_the_graph(None, "non_reentrant")
        held, kept = _held_by_the_graph(policy, mode)
    finally:
        paddle_mgrad.disable()
    assert kept > 0  # (the policy kept something in that step)
    assert held == full, f"{policy}: {held - full} bytes more than full recompute ({kept} kept)"


class _Exp(paddle.autograd.PyLayer):
    """``exp`` whose backward reads its saved output twice."""

    @staticmethod
    def forward(ctx, x):
        y = paddle.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensor()
        (b,) = ctx.saved_tensor()
        return g * ((a + b) * 0.5)


class _ExpLayer(paddle.nn.Layer):
    def forward(self, x):
        return _Exp.apply(x)


class _Block(paddle.nn.Layer):
    """``tanh(exp(lin(x)))``; ``last``: ``exp(lin(x))`` (backward reads ``exp``'s saved
    tensor before anything in the block is recomputed)."""

    def __init__(self, last=False):
        super().__init__()
        self.lin = paddle.nn.Linear(D, D)
        self.exp = _ExpLayer()
        self.last = last

    def forward(self, x):
        y = self.exp(self.lin(x))
        return y if self.last else paddle.tanh(y)


def _grads(how, policy=None, last=False):
    paddle.seed(5)
    net = _Block(last)
    x = paddle.randn([ROWS, D])
    x.stop_gradient = False
    if how == "none":
        out = net(x * 1.0)
    else:
        out = paddle_mgrad.recompute(net, x * 1.0, use_reentrant=how == "reentrant", policy=policy)
    out.sum().backward()
    return [out.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in net.parameters()]


@pytest.mark.parametrize(
    "policy, last, replays",
    [
        # the replay for tanh's saved output skips exp; the second read runs it
        ("save:exp", False, 2),
        # the second read comes first: the one replay runs exp
        ("save:exp", True, 1),
        # exp's saved output is recomputed at each read; the first replay took the kept
        # linear output and let go of it, the second multiplies again
        ("gemm", False, 2),
        ("gemm", True, 2),
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_a_value_read_again_after_it_was_let_go_of_is_recomputed(mode, policy, last, replays):
    """A ``PyLayer`` that reads its saved tensor twice: what the first read let go of -- the
    kept ``exp`` sublayer's saved output, the linear's kept output the replay handed on --
    is recomputed for the second, with its block: the same gradients as no recompute."""
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        plain = _grads("none", last=last)
        stats.reset()
        got = _grads(mode, policy, last)
        counters = stats.snapshot()
    finally:
        paddle_mgrad.disable()
    for a, b in zip(got, plain):
        np.testing.assert_array_equal(a, b)
    kept = counters["policy"][policy]
    assert kept["sublayers_kept" if policy == "save:exp" else "kept_outputs"] == 1, kept
    assert counters["recompute"]["recomputations"] == replays, counters["recompute"]


@pytest.mark.parametrize("policy, attention_runs", [("save:self_attn", 1), ("save:mlp", 3)])
@pytest.mark.parametrize("mode", MODES)
def test_a_backward_that_retains_the_graph_keeps_what_it_read(
    monkeypatch, policy, attention_runs, mode
):
    """``backward(retain_graph=True)`` then ``backward()``: the second reads the kept values
    again (the kept attention is not run again) and the gradients add up as without
    recompute.  (Plain linears: our fused linear's node refuses a second backward.)"""
    runs = []
    attention = type(Decoder().self_attn)
    real = attention.forward
    monkeypatch.setattr(
        attention, "forward", lambda this, *a, **k: runs.append(1) or real(this, *a, **k)
    )
    results = []
    paddle_mgrad.enable(recompute=True, fused_linear=False)
    try:
        for how in ("none", mode):
            paddle.seed(9)
            net = Decoder()
            x = paddle.randn([ROWS, D])
            x.stop_gradient = False
            runs.clear()
            if how == "none":
                out = net(x * 1.0)
            else:
                out = paddle_mgrad.recompute(
                    custom_forward(net), x * 1.0, use_reentrant=how == "reentrant", policy=policy
                )
            forward_runs = len(runs)
            out.sum().backward(retain_graph=True)
            out.sum().backward()
            results.append(
                [out.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in net.parameters()]
            )
    finally:
        paddle_mgrad.disable()
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    # the forward ran attention once, and each of the two replays where it is not kept
    assert (forward_runs, len(runs)) == (1, attention_runs)
