"""Recompute policies (:mod:`paddle_mgrad.recomputation.policy`): ``gemm`` keeps every fused
linear's output from the forward and the recomputation multiplies nothing; a callable chooses
per linear.  Every output, input gradient, ``.grad`` and ``main_grad`` must be bit-identical
to the same model without recompute -- with in-place ops after a linear (each kind of
:data:`in_place_ops.IN_PLACE`: a kept output changed in place must be recomputed), in both
modes, with and without bias, over two micro-steps (``main_grad`` None, then accumulated)."""

import numpy as np
import paddle
import policy_runs
import pytest
from in_place_ops import IN_PLACE
from paddle.distributed.fleet.utils import recompute as paddles_recompute
from policy_runs import assert_identical

import paddle_mgrad
from helpers import nonzero_biases
from paddle_mgrad import EnvError, linear, stats
from paddle_mgrad.autograd import recomputing
from paddle_mgrad.recomputation import budget, policy as policy_mod

MODES = ("reentrant", "non_reentrant")
D, F, ROWS = 8, 12, 3


class MLP(paddle.nn.Layer):
    """A llama-style MLP block: ``down(silu(gate(h)) * up(h))``, ``op`` applied in place to
    ``gate``'s output (``where="gate"``) or to the block's result before ``out`` (``"mid"``)."""

    def __init__(self, op=None, where="gate", bias=True):
        super().__init__()
        bias_attr = None if bias else False
        self.pre = paddle.nn.Linear(D, D, bias_attr=bias_attr)
        self.gate = paddle.nn.Linear(D, F, bias_attr=bias_attr)
        self.up = paddle.nn.Linear(D, F, bias_attr=bias_attr)
        self.down = paddle.nn.Linear(F, D, bias_attr=bias_attr)
        self.op, self.where = op, where
        nonzero_biases(self)

    def block(self, h):
        g = self.gate(h)
        if self.op is not None and self.where == "gate":
            g = self.op(g)
        m = paddle.nn.functional.silu(g) * self.up(h)
        if self.op is not None and self.where == "mid":
            m = self.op(m)
        return self.down(m)


def mlp_and_input():
    """A seeded :class:`MLP` and an input that needs a gradient."""
    paddle.seed(7)
    net = MLP()
    x = paddle.randn([ROWS, D])
    x.stop_gradient = False
    return net, x


def train(how, policy=None, op=None, where="gate", bias=True, micro=2, after=None):
    """``micro`` micro-steps of :class:`MLP` (``pre`` outside the block) with recompute ``how``
    ("none" or a mode) under ``policy`` (:func:`policy_runs.train`)."""
    return train_net(
        lambda: MLP(None if op is None else IN_PLACE[op], where, bias),
        how,
        policy,
        micro,
        after,
    )


def train_net(make_net, how, policy=None, micro=2, after=None):
    """:func:`train` of the :class:`MLP`-like model ``make_net()`` (``block`` recomputed,
    ``pre`` outside it)."""
    return policy_runs.train(
        make_net,
        how,
        policy,
        micro,
        block=lambda net: net.block,
        block_input=lambda net, x: net.pre(x),
        after=after,
        seed=7,
        data_seed=1,
        rows=ROWS,
        d=D,
    )


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("op", [None, *sorted(IN_PLACE)])
@pytest.mark.parametrize("mode", MODES)
def test_gemm_policy_equals_no_recompute(mode, op, bias):
    assert_identical(train(mode, "gemm", op, bias=bias), train("none", op=op, bias=bias))


@pytest.mark.parametrize("mode", MODES)
def test_gemm_policy_with_an_in_place_op_after_the_mlp(mode):
    assert_identical(train(mode, "gemm", "add_", "mid"), train("none", op="add_", where="mid"))


def _count_gemms_in_backward(monkeypatch, policy, op):
    """Paddle linears run while backward runs (the recomputation's GEMMs), and the stats."""
    calls = []
    real = linear._paddle_linear
    monkeypatch.setattr(linear, "_paddle_linear", lambda *a: calls.append(1) or real(*a))
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(7)
        net = MLP(None if op is None else IN_PLACE[op])
        h = net.pre(paddle.randn([ROWS, D]))
        out = paddle_mgrad.recompute(net.block, h, use_reentrant=False, policy=policy)
        calls.clear()  # (the forward's own linears)
        out.sum().backward()
        return len(calls), stats.snapshot()["policy"]
    finally:
        paddle_mgrad.disable()


@pytest.mark.parametrize(
    "policy, op, recomputed, kept",
    [
        ("full", None, 3, None),
        ("gemm", None, 0, 3),
        ("gemm", "add_", 1, 2),  # gate's output changed in place: that one is recomputed
        ("gemm", "mp_allreduce", 1, 2),
    ],
)
def test_what_the_recomputation_multiplies(monkeypatch, policy, op, recomputed, kept):
    n, counters = _count_gemms_in_backward(monkeypatch, policy, op)
    assert n == recomputed
    if kept is None:
        assert counters == {}
        return
    # gate and up [ROWS, F], down [ROWS, D], fp32
    sizes = {"gate": ROWS * F, "up": ROWS * F, "down": ROWS * D}
    kept_names = ["up", "down"] if op else ["gate", "up", "down"]
    flops = {"gate": 2 * ROWS * D * F, "up": 2 * ROWS * D * F, "down": 2 * ROWS * F * D}
    assert counters == {
        "gemm": {
            "calls": 1,
            "kept_outputs": kept,
            "kept_bytes": 4 * sum(sizes[k] for k in kept_names),
            "replays": 1,
            "gemms_not_recomputed": kept,
            "gemm_flops_not_recomputed": sum(flops[k] for k in kept_names),
            "sublayers_kept": 0,
            "sublayers_not_recomputed": 0,
            "blocks_kept_whole": 0,
        }
    }


def test_policy_from_the_environment_reaches_paddles_own_recompute(monkeypatch):
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", " GEMM ")
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        net, x = mlp_and_input()
        h = net.pre(x)
        paddles_recompute(net.block, h, use_reentrant=False).sum().backward()
        # a reentrant call with a policy runs on the non-reentrant engine (counted so)
        paddles_recompute(net.block, net.pre(paddle.randn([ROWS, D]))).sum().backward()
    finally:
        paddle_mgrad.disable()
    snap = stats.snapshot()
    assert snap["policy"]["gemm"]["calls"] == 2
    assert snap["policy"]["gemm"]["gemms_not_recomputed"] == 6
    assert snap["recompute"]["reentrant_as_non_reentrant"] == 1


def test_a_bad_policy_is_named(monkeypatch):
    with pytest.raises(
        ValueError,
        match=r"policy='gemms'.*accepted: full, gemm, "
        r"save:<pattern>\[,<pattern>...\]",
    ):
        policy_mod.resolve("gemms")
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", "selective")
    with pytest.raises(EnvError, match=r"PADDLE_MGRAD_RECOMPUTE_POLICY='selective'.*full"):
        policy_mod.resolve()
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", "")
    assert policy_mod.resolve() is None  # empty: full
    assert policy_mod.resolve("full") is None


def test_a_callable_policy_chooses_per_linear():
    asked = []

    def wide_only(call):
        asked.append(call)
        return call.out_shape[-1] == F  # gate and up, not down

    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        net, x = mlp_and_input()
        h = net.pre(x)
        paddle_mgrad.recompute(net.block, h, use_reentrant=False, policy=wide_only).sum().backward()
    finally:
        paddle_mgrad.disable()
    assert [
        c.weight is p for c, p in zip(asked, (net.gate.weight, net.up.weight, net.down.weight))
    ] == [True] * 3
    assert [(c.kind, c.x_shape, c.out_shape, c.flops, c.out_bytes, c.dtype) for c in asked] == [
        ("gemm", (ROWS, D), (ROWS, F), 2 * ROWS * D * F, 4 * ROWS * F, "paddle.float32")
    ] * 2 + [("gemm", (ROWS, F), (ROWS, D), 2 * ROWS * F * D, 4 * ROWS * D, "paddle.float32")]
    counters = stats.snapshot()["policy"]["wide_only"]
    assert (counters["kept_outputs"], counters["gemms_not_recomputed"]) == (2, 2)
    # and the callable's choice is bit-identical too
    assert_identical(train("non_reentrant", wide_only), train("none"))


def test_an_output_changed_after_the_block_is_recomputed():
    """The block's result (``down``'s kept output) scaled in place after the block: the
    recomputation must not hand back the changed values (``down``'s input gradient needs
    none of them, and the ops after it saved none: without recompute this works)."""
    after = lambda out: out.scale_(3.0)  # noqa: E731
    for mode in MODES:
        assert_identical(train(mode, "gemm", after=after), train("none", after=after))


@pytest.mark.parametrize("mode", MODES)
def test_paddle_grad_then_backward_under_gemm(monkeypatch, mode):
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        net, x = mlp_and_input()
        h = net.pre(x)
        out = paddle_mgrad.recompute(net.block, h, use_reentrant=mode == "reentrant", policy="gemm")
        gemms = []
        real = linear._paddle_linear
        monkeypatch.setattr(linear, "_paddle_linear", lambda *a: gemms.append(1) or real(*a))
        # paddle.grad replays the block (a copy of the graph), twice; then one backward
        (gx,) = paddle.grad([out.sum()], [x], retain_graph=True)
        (gx2,) = paddle.grad([out.sum()], [x], retain_graph=True)
        out.sum().backward()
        assert gemms == []  # no replay multiplied, the second and third neither
        monkeypatch.undo()
        paddle.seed(7)  # the same model without recompute
        plain = MLP()
        xp = paddle.to_tensor(x.numpy())
        xp.stop_gradient = False
        o = plain.block(plain.pre(xp))
        (gp,) = paddle.grad([o.sum()], [xp], retain_graph=True)
        o.sum().backward()
    finally:
        paddle_mgrad.disable()
    np.testing.assert_array_equal(gx.numpy(), gp.numpy())
    np.testing.assert_array_equal(gx2.numpy(), gp.numpy())
    # each of the three passes replayed the block, and none multiplied
    counters = stats.snapshot()["policy"]["gemm"]
    assert (counters["replays"], counters["gemms_not_recomputed"]) == (3, 9), counters
    for p, q in zip(net.parameters(), plain.parameters()):
        np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())


def test_offload_keeps_the_reentrant_engine():
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        net, x = mlp_and_input()
        h = net.pre(x)
        paddle_mgrad.recompute(net.block, h, offload_indices=[0], policy="gemm").sum().backward()
    finally:
        paddle_mgrad.disable()
    snap = stats.snapshot()
    assert snap["policy"] == {} and snap["recompute"]["reentrant_as_non_reentrant"] == 0
    assert snap["recompute"]["reentrant"] == 1


def test_a_callable_policy_is_asked_about_a_3d_input():
    """A [batch, rows, D] input: the GEMM's K is the last dimension (not the second), in what
    the policy is asked and in what the recomputation counts as not multiplied; a policy that
    keeps only the last linear's output (after ones it did not keep) has its bytes counted."""
    asked = []

    def down_only(call):
        asked.append(call)
        return call.out_shape[-1] == D

    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        net, _ = mlp_and_input()
        h = net.pre(paddle.randn([2, ROWS, D]))
        paddle_mgrad.recompute(net.block, h, use_reentrant=False, policy=down_only).sum().backward()
    finally:
        paddle_mgrad.disable()
    assert [(c.x_shape, c.flops) for c in asked] == [((2, ROWS, D), 2 * 2 * ROWS * D * F)] * 2 + [
        ((2, ROWS, F), 2 * 2 * ROWS * F * D)
    ]
    counters = stats.snapshot()["policy"]["down_only"]
    assert counters == {
        "calls": 1,
        "kept_outputs": 1,
        "kept_bytes": 4 * 2 * ROWS * D,
        "replays": 1,
        "gemms_not_recomputed": 1,
        "gemm_flops_not_recomputed": 2 * 2 * ROWS * F * D,
        "sublayers_kept": 0,
        "sublayers_not_recomputed": 0,
        "blocks_kept_whole": 0,
    }


class _KeepEvery:
    """A callable policy without a ``__name__`` (an object with ``__call__``)."""

    def __call__(self, call):
        return True


def test_a_callable_policy_without_a_name_is_counted_as_callable():
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        net, x = mlp_and_input()
        paddle_mgrad.recompute(
            net.block, net.pre(x), use_reentrant=False, policy=_KeepEvery()
        ).sum().backward()
    finally:
        paddle_mgrad.disable()
    assert list(stats.snapshot()["policy"]) == ["callable"]


def test_a_kept_output_changed_after_the_block_and_needed_inside_it_is_recomputed():
    """The block returns a linear's output that its own backward needs (``y * y``), and the
    caller changes it in place after the block.  Without recompute Paddle refuses that
    backward; a recomputation can still compute the gradient of what the block computed, and
    under ``gemm`` it must do so from the recomputed ``y``, not from the changed one it kept:
    the gradients equal full recompute's."""

    def run(policy):
        paddle_mgrad.enable(recompute=True, fused_linear=True)
        try:
            paddle.seed(3)
            lin = paddle.nn.Linear(D, D)
            x = paddle.randn([ROWS, D])
            x.stop_gradient = False

            def block(h):
                y = lin(h)
                return y, y * y

            y, z = paddle_mgrad.recompute(block, x, use_reentrant=False, policy=policy)
            y.scale_(3.0)
            z.sum().backward()
            return x.grad.numpy(), lin.weight.grad.numpy()
        finally:
            paddle_mgrad.disable()

    full, gemm = run("full"), run("gemm")
    for a, b in zip(gemm, full):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("diverges", ["one_more_linear", "fewer_rows", "another_weight"])
@pytest.mark.parametrize("policy", ["full", "gemm"])
def test_a_replay_that_diverges_from_its_forward_raises_recompute_error(policy, diverges):
    """A block whose replay does not repeat its forward (a data-dependent branch): the
    determinism check's RecomputeError, under ``gemm`` as under ``full`` -- a kept output is
    handed back only to the call that made it, never to another linear or another input."""
    calls = []
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(3)
        lin, other = paddle.nn.Linear(D, D), paddle.nn.Linear(D, F)
        extra = paddle.nn.Linear(D, D)

        def block(h):
            calls.append(1)
            replay = len(calls) > 1
            if replay and diverges == "fewer_rows":
                h = h[:-1]
            y = (other if replay and diverges == "another_weight" else lin)(h)
            if replay and diverges == "one_more_linear":
                y = y + extra(h)
            return paddle.tanh(y).sum(-1, keepdim=True) * h  # (tanh saves its output)

        x = paddle.randn([ROWS, D])
        x.stop_gradient = False
        out = paddle_mgrad.recompute(block, x, use_reentrant=False, policy=policy)
        with pytest.raises(paddle_mgrad.RecomputeError, match="is not deterministic"):
            out.sum().backward()
    finally:
        paddle_mgrad.disable()


def test_kept_outputs_in_call_order():
    """:class:`KeptOutputs` alone, as a block's forward and then its recomputation use it: the
    forward offers each linear's output; ``forward_done`` drops the ones changed in place
    since they were offered (not one changed before: an all-reduce inside the linear) and
    counts the bytes of the rest; the recomputation that follows (no ``rewind`` before the
    first) takes them in call order, and None where it must compute: not kept, changed after
    the forward, another input or weight shape than the forward's, past the forward's calls."""
    x = paddle.ones([2, ROWS, D])
    w_in, w_out = paddle.ones([D, F]), paddle.ones([F, D])
    not_kept, kept_y, changed_before, changed_during = (paddle.ones([2, ROWS, F]) for _ in range(4))
    last = paddle.ones([2, ROWS, D])
    changed_before.scale_(2.0)  # before it is offered
    kept = recomputing.KeptOutputs(lambda x, weight, y: y is not not_kept)
    for y in (not_kept, kept_y, changed_before, changed_during):
        kept.add(x, w_in, y)
    kept.add(kept_y, w_out, last)
    changed_during.scale_(2.0)
    kept.forward_done()
    assert (kept.kept, kept.kept_bytes) == (3, 4 * 2 * ROWS * (F + F + D))

    def replay(first_x=x):
        return [
            kept.take(first_x, w_in),
            kept.take(x, w_in),
            kept.take(x, w_in),
            kept.take(x, w_in),
            kept.take(kept_y, w_out),
            kept.take(x, w_in),
        ]

    taken = replay()
    assert [t is None for t in taken] == [True, False, False, True, False, True]
    for (t, stop_gradient), y in zip(
        [taken[1], taken[2], taken[4]], [kept_y, changed_before, last]
    ):
        assert t.data_ptr() == y.data_ptr() and stop_gradient == y.stop_gradient
    gemm_flops = 2 * 2 * ROWS * F * D  # [2, ROWS, D] @ [D, F] and [2, ROWS, F] @ [F, D]
    assert (kept.skipped, kept.skipped_flops) == (3, 3 * gemm_flops)
    # a second replay from the start: after the output changed, with another input shape
    kept.rewind(False)
    last.scale_(2.0)
    taken = replay(first_x=paddle.ones([2, ROWS - 1, D]))
    assert [t is None for t in taken] == [True, False, False, True, True, True]
    assert (kept.skipped, kept.skipped_flops) == (2, 2 * gemm_flops)
    kept.rewind(False)
    assert kept.take(x, w_out) is None  # the weight's shape differs from the forward's
    assert kept.take(paddle.ones([2, ROWS, F]), w_in) is None  # the input's does


@pytest.mark.parametrize("policy", ["gemm", "save:down"])
def test_a_block_that_changes_its_input_keeps_nothing_for_its_policy(policy):
    """A block that changes its argument in place is never recomputed (its activations are
    kept from the forward): its policy keeps no output and no sublayer, and counts no bytes."""
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        net, x = mlp_and_input()

        def block(h):
            h.scale_(2.0)
            return net.block(h)

        paddle_mgrad.recompute(
            block, net.pre(x), use_reentrant=False, policy=policy
        ).sum().backward()
    finally:
        paddle_mgrad.disable()
    counters = stats.snapshot()["policy"][policy]
    assert counters == {
        "calls": 1,
        "kept_outputs": 0,
        "kept_bytes": 0,
        "replays": 0,
        "gemms_not_recomputed": 0,
        "gemm_flops_not_recomputed": 0,
        "sublayers_kept": 0,
        "sublayers_not_recomputed": 0,
        "blocks_kept_whole": 0,
    }
    assert stats.snapshot()["recompute"]["kept_from_forward"] == 1


def test_a_save_policy_is_made_once_per_name(monkeypatch):
    """``save:<pattern>,...`` resolves to a policy that keeps no GEMM output and holds the
    patterns, made once per name (a fresh cache here: the one of the process may be filled)."""
    monkeypatch.setattr(policy_mod, "_NAMED", {})
    made = policy_mod.resolve("save:mlp.down,*Norm")
    assert made == policy_mod.Policy(
        "save:mlp.down,*Norm", gemm=False, patterns=("mlp.down", "*Norm")
    )
    with pytest.warns(RuntimeWarning, match="matches no sublayer"):  # (no Layer in the block)
        assert made.plan(lambda h: h, (), {}) == budget.Plan()
    assert policy_mod.resolve("save:mlp.down,*Norm") is made


class UserLinear(paddle.autograd.PyLayer):
    """A user's own linear: Paddle's linear inside a ``PyLayer`` forward (grad off there), the
    gradients by hand in its backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return paddle.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensor()
        return dy.matmul(weight, transpose_y=True), x.matmul(dy, transpose_x=True), dy.sum(0)


class UserMLP(MLP):
    """:class:`MLP` whose gate, up and down run through :class:`UserLinear`."""

    def block(self, h):
        def lin(layer, v):
            return UserLinear.apply(v, layer.weight, layer.bias)

        g = lin(self.gate, h)
        if self.op is not None:
            g = self.op(g)
        return lin(self.down, paddle.nn.functional.silu(g) * lin(self.up, h))


@pytest.mark.parametrize("op, kept", [(None, 3), ("add_", 2)])
@pytest.mark.parametrize("mode", MODES)
def test_gemm_policy_keeps_the_linears_inside_a_users_pylayer(mode, op, kept):
    """A linear inside a user's ``PyLayer`` runs with grad off: it is still a GEMM of the block,
    kept by ``gemm`` (and recomputed where its output was changed in place)."""

    def make():
        return UserMLP(None if op is None else IN_PLACE[op])

    ref = train_net(make, "none")
    stats.reset()
    got = train_net(make, mode, "gemm")
    assert_identical(got, ref)
    counters = stats.snapshot()["policy"]["gemm"]
    assert counters["kept_outputs"] == 2 * kept
    assert counters["gemms_not_recomputed"] == 2 * kept


class FrozenGateMLP(MLP):
    """:class:`MLP` with a frozen gate: Paddle's own linear, with grad on, saving ``h``."""

    def __init__(self):
        super().__init__()
        self.gate.weight.stop_gradient = self.gate.bias.stop_gradient = True


@pytest.mark.parametrize("mode", MODES)
def test_gemm_policy_recomputes_a_frozen_linear(mode):
    """A frozen linear with grad on is Paddle's, saving tensors for backward: it is
    recomputed (the recomputation must save what the forward saved), the others kept."""

    ref = train_net(FrozenGateMLP, "none")
    stats.reset()
    got = train_net(FrozenGateMLP, mode, "gemm")
    assert_identical(got, ref)
    assert stats.snapshot()["policy"]["gemm"]["gemms_not_recomputed"] == 2 * 2


class NoGradGateMLP(MLP):
    """:class:`MLP` whose gate runs in a no-grad region: its output needs no gradient (the
    ops after it save nothing of it), and ``gemm`` keeps it all the same."""

    def block(self, h):
        with paddle.no_grad():
            g = self.gate(h)
        return self.down(paddle.nn.functional.silu(g) * self.up(h))


@pytest.mark.parametrize("mode", MODES)
def test_a_kept_output_that_needed_no_gradient_comes_back_as_one(mode):
    """The recomputation hands the no-grad gate's kept output back needing no gradient, as the
    forward made it: the ops after it then save what they saved in the forward."""
    ref = train_net(NoGradGateMLP, "none")
    stats.reset()
    got = train_net(NoGradGateMLP, mode, "gemm")
    assert_identical(got, ref)
    assert stats.snapshot()["policy"]["gemm"]["gemms_not_recomputed"] == 2 * 3
