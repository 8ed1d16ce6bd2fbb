"""In-place ops inside a recompute block, as real models do them, against no recompute and
against plain Paddle.

After a linear (fleet's ``RowParallelLinear`` all-reduces its output in place; PaddleFormers'
qwen/glm/gemma/ernie families change linear outputs in place), on an intermediate value, and on
the block's own input; every op of :data:`in_place_ops.IN_PLACE`; both recompute modes, our
fused linear on and off, ``main_grad`` (``MixPrecisionLayer``) and ``.grad``, two micro-steps
(``main_grad`` None, then accumulated).  Every output, input gradient, ``.grad`` and
``main_grad`` must be bit-identical to the same model without recompute, and equal plain
Paddle's recompute where plain Paddle is right.

A non-reentrant recomputation re-runs our fused linear without its PyLayer: its output must
be no leaf, or Paddle refuses the in-place op ("Leaf Var () that doesn't stop gradient can't
use inplace strategy") -- what stopped tensor parallelism and 7 of 11 PaddleFormers families.
"""

import weakref

import numpy as np
import paddle
import pytest
from in_place_ops import IN_PLACE
from paddle.distributed.fleet.utils import recompute as native_recompute
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from paddle_mgrad import RecomputeError, stats

MODES = ("reentrant", "non_reentrant")
D = 4


class Net(paddle.nn.Layer):
    """``pre`` outside the block; inside: ``op`` on the block's input, after ``lin``, or on an
    intermediate value (``y * 1.5``: a scale, which saves nothing), then ``lin2``."""

    def __init__(self, where, op, bias):
        super().__init__()
        bias_attr = None if bias else False
        self.pre = paddle.nn.Linear(D, D, bias_attr=bias_attr)
        self.lin = paddle.nn.Linear(D, D, bias_attr=bias_attr)
        self.lin2 = paddle.nn.Linear(D, D, bias_attr=bias_attr)
        self.where, self.op = where, op

    def block(self, h):
        if self.where == "block_input":
            h = self.op(h)
        y = self.lin(h)
        if self.where == "linear_out":
            y = self.op(y)
        elif self.where == "intermediate":
            y = self.op(y * 1.5)
        return self.lin2(paddle.tanh(y))


def train(op, where, how, fused, mix=True, bias=True, micro=2):
    """Two micro-steps of ``Net`` with recompute ``how`` ("none", a mode, or "native_<mode>":
    Paddle's own recompute, paddle_mgrad off); every result as float64 numpy (or None)."""
    paddle_mgrad.disable()
    if not how.startswith("native"):
        paddle_mgrad.enable(recompute=True, fused_linear=fused)
    try:
        paddle.seed(3)
        net = Net(where, IN_PLACE[op], bias)
        if mix:
            MixPrecisionLayer(net, dtype="float16")
        rs = np.random.RandomState(0)
        result = {}
        for step in range(micro):
            x = paddle.to_tensor(rs.standard_normal([3, D]).astype("float32"))
            x.stop_gradient = False
            h = net.pre(x)
            if how == "none":
                out = net.block(h)
            else:
                mode = how.replace("native_", "")
                kwargs = {"use_reentrant": mode == "reentrant"}
                if how.startswith("native"):
                    kwargs["preserve_rng_state"] = False  # Paddle 2.6: no CPU RNG state
                    out = native_recompute(net.block, h, **kwargs)
                else:
                    out = paddle_mgrad.recompute(net.block, h, **kwargs)
            (out * paddle.arange(D * 3, dtype="float32").reshape([3, D])).sum().backward()
            result[f"out{step}"] = out.numpy().astype("float64")
            result[f"x{step}.grad"] = x.grad.numpy().astype("float64")
        for name, p in net.named_parameters():
            for attr in ("grad", "main_grad"):
                t = getattr(p, attr, None)
                result[f"{name}.{attr}"] = None if t is None else t.numpy().astype("float64")
        return result
    finally:
        paddle_mgrad.disable()
        assert paddle.is_grad_enabled()


def assert_same(got, ref, exact=True):
    assert sorted(got) == sorted(ref)
    for key in ref:
        g, r = got[key], ref[key]
        assert (g is None) == (r is None), key
        if r is not None:
            if exact:
                np.testing.assert_array_equal(g, r, err_msg=key)
            else:
                np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["linear_out", "intermediate"])
@pytest.mark.parametrize("op", sorted(IN_PLACE))
def test_in_place_op_in_block_equals_no_recompute(op, where, mode, fused):
    ref = train(op, where, "none", fused)
    assert ref["lin.weight.main_grad"] is not None and ref["lin.weight.grad"] is None
    assert_same(train(op, where, mode, fused), ref)
    # ... and plain Paddle's own recompute agrees (there, our linear is off)
    assert_same(train(op, where, "native_" + mode, fused), ref, exact=False)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["add_", "mp_allreduce"])
def test_in_place_after_linear_with_grad_and_without_bias(op, mode):
    """``.grad`` instead of ``main_grad``; no bias (the linear's output then comes from
    Paddle's matmul)."""
    for bias in (True, False):
        ref = train(op, "linear_out", "none", True, mix=False, bias=bias)
        assert ref["lin.weight.grad"] is not None
        assert_same(train(op, "linear_out", mode, True, mix=False, bias=bias), ref)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("op", sorted(IN_PLACE))
def test_block_changing_its_input_in_place_non_reentrant_keeps_its_activations(op, fused):
    """The recomputation would start from the changed input (plain Paddle's non-reentrant
    recompute computes wrong gradients there): the block's saved tensors are kept from the
    forward instead, and it is never recomputed."""
    ref = train(op, "block_input", "none", fused)
    before = stats.snapshot()["recompute"]
    got = train(op, "block_input", "non_reentrant", fused)
    after = stats.snapshot()["recompute"]
    assert_same(got, ref)
    assert after["kept_from_forward"] - before["kept_from_forward"] == 2  # each micro-step
    assert after["recomputations"] == before["recomputations"]


def test_plain_paddle_non_reentrant_is_silently_wrong_when_the_block_changes_its_input():
    """What the test above protects against: Paddle's own non-reentrant recompute re-runs the
    block from the changed input, with no error (if Paddle fixes it, this fails and says so)."""
    ref = train("add_", "block_input", "none", False)
    got = train("add_", "block_input", "native_non_reentrant", False)
    assert not np.allclose(got["lin.weight.main_grad"], ref["lin.weight.main_grad"])


@pytest.mark.parametrize("op", sorted(IN_PLACE))
def test_block_changing_its_input_in_place_reentrant_is_a_clear_error(op):
    """The reentrant mode has no activations to keep (its forward runs without grad): it
    refuses in the forward, naming the argument, instead of plain Paddle's in-place error in
    backward (or, for ``paddle.assign(..., output=x)``, its wrong gradients)."""
    with pytest.raises(RecomputeError, match=r"changed its tensor argument #0 \(shape=\[3, 4\]"):
        train(op, "block_input", "reentrant", True)
    # the process is as before: the next training equals a fresh one
    assert paddle.is_grad_enabled()
    ref = train("add_", "linear_out", "none", True)
    assert_same(train("add_", "linear_out", "reentrant", True), ref)


def test_block_changing_its_input_unchanged_blocks_still_recompute():
    """The usual block (no in-place op on its input) drops its activations and recomputes."""
    before = stats.snapshot()["recompute"]
    train("add_", "linear_out", "non_reentrant", True)
    after = stats.snapshot()["recompute"]
    assert after["kept_from_forward"] == before["kept_from_forward"]
    assert after["recomputations"] - before["recomputations"] == 2


def test_replayed_linear_output_is_no_leaf():
    """The recomputation's stand-in for our linear: a non-leaf that needs a gradient, sharing
    the buffer Paddle's linear computed (no copy), with what the linear would return."""
    from paddle_mgrad import linear as linear_mod

    packed = []
    x = paddle.randn([3, D])
    lin = paddle.nn.Linear(D, D)
    y = linear_mod._recomputed_linear(x, lin.weight, lin.bias, packed.append)
    assert packed == [x]
    assert not y.stop_gradient and not y.is_leaf
    np.testing.assert_array_equal(
        y.numpy(), paddle.nn.functional.linear(x, lin.weight, lin.bias).numpy()
    )
    assert paddle.is_grad_enabled()


@pytest.mark.parametrize("ending", ["backward", "raises_in_forward"])
@pytest.mark.parametrize("op", ["add_", "relu_", "multiply_"])
def test_no_graph_outlives_its_step(op, ending):
    """A block that changes its input in place keeps its saved tensors from the forward: none of
    them -- nor the changed argument, whose grad node is now inside the block -- may be held
    from inside the graph by reference (a cycle through C++ that no garbage collector sees:
    the block's graph would live for good, and paddle.grad would later refuse every graph with
    a fused linear, taking a stale node for one of them).  Also when the forward raises."""
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        lin, lin2, pre = (paddle.nn.Linear(D, D) for _ in range(3))
        refs = []

        def block(h):
            IN_PLACE[op](h)
            y = lin(h)
            z = paddle.tanh(y)
            refs.extend(weakref.ref(t) for t in (h, y, z))
            if ending == "raises_in_forward":
                raise RuntimeError("user code fails in the forward")
            return lin2(z)

        x = paddle.randn([3, D])
        x.stop_gradient = False
        try:
            paddle_mgrad.recompute(block, pre(x), use_reentrant=False).sum().backward()
        except RuntimeError:
            assert ending == "raises_in_forward"
        assert paddle.is_grad_enabled()
    finally:
        paddle_mgrad.disable()
    del block
    alive = [
        name
        for name, r in zip(("argument", "linear output", "tanh output"), refs)
        if r() is not None
    ]
    assert not alive, alive


class _Square(paddle.autograd.PyLayer):
    """``x * x`` that saves its input itself (a ``PyLayer`` save: the very object)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensor()
        return 2.0 * g * x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", ["replayed", "argument_only", "no_linear", "pylayer_argument"])
def test_an_argument_changed_after_the_block_raises(block, mode):
    """A tensor argument changed in place after the block returned, before backward: the
    replay would start from the changed value (and a kept argument would hand it to backward
    itself) -- silently wrong gradients, in both of plain Paddle's recompute modes.  Plain
    Paddle without recompute refuses the first two (the linear saved the argument); ours
    refuses each in both modes, by name, and the next step trains.  ``pylayer_argument``
    saves nothing but the argument itself: nothing is recomputed, and backward reading the
    argument must tell."""
    paddle.seed(3)
    lin = paddle.nn.Linear(D, D)
    fn = {
        "replayed": lambda t: paddle.tanh(lin(t)),
        "argument_only": lambda t: lin(t),
        "no_linear": lambda t: paddle.tanh(t + 1.0),
        "pylayer_argument": _Square.apply,
    }[block]
    reentrant = mode == "reentrant"
    paddle_mgrad.enable(recompute=True)
    try:
        x = paddle.randn([3, D])
        x.stop_gradient = False
        h = x * 1.0
        out = paddle_mgrad.recompute(fn, h, use_reentrant=reentrant)
        h.scale_(2.0)
        with pytest.raises(
            RecomputeError,
            match=r"tensor argument #0 .* has been modified by an "
            r"inplace operation after the block was called "
            r"\(inplace version 1, 0 at the call\)",
        ):
            out.sum().backward()
        assert paddle.is_grad_enabled()
        x.clear_gradient()
        h = x * 1.0
        paddle_mgrad.recompute(fn, h, use_reentrant=reentrant).sum().backward()
        got = x.grad.numpy()
        h.scale_(2.0)  # after backward: nothing to replay any more
    finally:
        paddle_mgrad.disable()
    x.clear_gradient()
    fn(x * 1.0).sum().backward()
    np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-6)
