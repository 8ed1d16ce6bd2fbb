"""Where non-reentrant recompute keeps a recomputed activation: on its holder, until backward
takes it.

The recomputation stores a view of each recomputed tensor on the holder that stands for it in
the graph; the unpack that hands it to backward takes it off again, so the activation is freed
with its use, as Paddle's own recompute frees it, and not when the graph dies (with
``retain_graph=True`` that is much later: every block's activations would pile up).  After a
failed determinism check nothing recomputed stays behind either.  White-box: the frames are
recorded as the recompute makes them.
"""

import numpy as np
import paddle
import pytest

import paddle_mgrad
from paddle_mgrad import RecomputeError
from paddle_mgrad.recomputation import non_reentrant


@pytest.fixture
def frames(monkeypatch):
    made = []
    real = non_reentrant._Frame.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(non_reentrant._Frame, "__init__", init)
    return made


def _dropped(frame):
    """The holders of the frame that stand for dropped (recomputed) activations."""
    hs = [ref() for ref in frame.holders]
    assert all(h is not None for h in hs)  # retain_graph keeps the graph, hence its holders
    return [h for h in hs if not h.kept]


def test_backward_takes_each_recomputed_view_off_its_holder(frames):
    blk = paddle.nn.Sequential(paddle.nn.Linear(6, 6), paddle.nn.Tanh(), paddle.nn.Linear(6, 6))
    x = paddle.randn([3, 6])
    x.stop_gradient = False
    ys = [paddle_mgrad.recompute(blk, x, use_reentrant=False) for _ in range(2)]
    loss = (ys[0] * ys[1]).sum()
    loss.backward(retain_graph=True)
    assert len(frames) == 2
    for frame in frames:
        dropped = _dropped(frame)
        assert dropped, "the block saved activations"
        assert all(h.value is None for h in dropped)
    g = x.grad.numpy().copy()
    loss.backward()  # a second recomputation, the same gradients again
    assert all(h.value is None for f in frames for h in _dropped(f))
    assert abs(x.grad.numpy() - 2 * g).max() < 1e-5


def test_a_failed_determinism_check_keeps_nothing_recomputed(frames):
    calls = []

    def fn(x):
        calls.append(1)
        h = paddle.tanh(x)
        h = paddle.tanh(h) * paddle.tanh(h)
        if len(calls) > 1:
            h = paddle.tanh(paddle.concat([h, h]))[:4]  # the rerun saves another shape
        return h.sum()

    x = paddle.randn([4])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(fn, x, use_reentrant=False)
    with pytest.raises(RecomputeError):
        y.backward(retain_graph=True)
    (frame,) = frames
    assert all(h.value is None for h in _dropped(frame))


@pytest.mark.parametrize("check", ["shapes", "values"])
def test_a_recomputation_reruns_the_fused_linear_without_its_pylayer(check):
    """Under non-reentrant recompute the fused linear's PyLayer runs in the forward only: the
    recomputation (whose graph is never back-propagated) runs Paddle's linear and hands the
    saved input to the pack hook itself.  Gradients as plain Paddle's, the determinism check
    (shapes, or values) still passes."""
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    from paddle_mgrad import stats

    def two_blocks():
        return [
            paddle.nn.Sequential(paddle.nn.Linear(5, 5), paddle.nn.ReLU(), paddle.nn.Linear(5, 5))
            for _ in range(2)
        ]

    paddle.seed(3)
    blocks, ref = two_blocks(), two_blocks()
    for a, b in zip(blocks, ref):
        for p, q in zip(a.parameters(), b.parameters()):
            q.set_value(p.numpy())
    MixPrecisionLayer(paddle.nn.LayerList(blocks), dtype="bfloat16")
    data = paddle.randn([3, 5]).numpy()

    def run(layers, fused):
        x = paddle.to_tensor(data)
        x.stop_gradient = False
        if fused:
            paddle_mgrad.enable(recompute=True, fused_linear=True)
        try:
            h = x
            for blk in layers:
                h = (
                    paddle_mgrad.recompute(blk, h, use_reentrant=False, determinism_check=check)
                    if fused
                    else blk(h)
                )
            before = dict(stats.linear)
            (h * h).sum().backward()
            return x, before
        finally:
            paddle_mgrad.disable()

    forwards = stats.linear["forward"]
    x_ref, _ = run(ref, False)
    x, before = run(blocks, True)
    assert before["forward"] - forwards == 4  # the forward's four linears, PyLayers
    assert stats.linear["forward"] == before["forward"]  # none in the recomputations
    assert stats.linear["backward"] - before["backward"] == 4
    assert stats.recompute["recomputations"] >= 2
    np.testing.assert_allclose(x.grad.numpy(), x_ref.grad.numpy(), rtol=1e-5, atol=1e-6)
    for a, b in zip(blocks, ref):
        for p, q in zip(a.parameters(), b.parameters()):
            np.testing.assert_allclose(p.main_grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-6)


class _SavesItsInputs(paddle.autograd.PyLayer):
    """``x * w`` that saves both and records what backward gets back."""

    seen = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensor()
        _SavesItsInputs.seen.append((x, w))
        return dy * w, None


def _block_input(data):
    x = paddle.to_tensor(data)
    x.stop_gradient = False
    return x, x * 1.0  # the block's argument is no leaf


@pytest.mark.parametrize("changes_its_input", [False, True], ids=["usual", "changes_its_input"])
def test_the_blocks_arguments_are_kept_as_themselves(changes_its_input):
    """What a block saves of its tensor arguments -- here one that is no leaf and a frozen
    parameter -- comes back to backward as the very object, not a recomputed view.  A block
    that changes its arguments in place (the parameter as a running statistic is updated)
    keeps its activations from the forward, the changed tensor as a detached alias, the
    parameter as itself.  Gradients equal the block's without recompute."""
    paddle.seed(3)
    w = paddle.create_parameter([4], "float32")
    w.stop_gradient = True
    data = paddle.randn([3, 4]).numpy()

    def block(h, w):
        if changes_its_input:
            h.scale_(2.0)
            w.scale_(1.0)
        return paddle.tanh(_SavesItsInputs.apply(h, w))

    def run(recompute):
        x, h = _block_input(data)
        y = paddle_mgrad.recompute(block, h, w, use_reentrant=False) if recompute else block(h, w)
        _SavesItsInputs.seen.clear()
        y.sum().backward()
        return x.grad.numpy(), h, list(_SavesItsInputs.seen)

    want, _, _ = run(False)
    got, h, seen = run(True)
    np.testing.assert_array_equal(got, want)
    ((sx, sw),) = seen
    assert sw is w
    assert (sx is h) != changes_its_input


def test_a_block_that_changes_its_input_backpropagates_twice():
    """Its activations, kept from the forward, stay kept after the first backward
    (``retain_graph``): the second is not a recomputation from the changed input."""
    data = paddle.randn([3, 4]).numpy()

    def block(h):
        h.scale_(2.0)
        return paddle.tanh(paddle.tanh(h) * h)

    def run(recompute):
        x, h = _block_input(data)
        y = paddle_mgrad.recompute(block, h, use_reentrant=False) if recompute else block(h)
        y.sum().backward(retain_graph=True)
        y.sum().backward()
        return x.grad.numpy()

    np.testing.assert_array_equal(run(True), run(False))


def test_a_frozen_parameter_the_block_reaches_itself_is_kept_as_itself():
    """A parameter that needs no gradient and is no argument (a frozen layer's weight) is kept
    as well: backward gets the very object back, not a recomputed view."""
    w = paddle.create_parameter([4], "float32")
    w.stop_gradient = True
    x, h = _block_input(paddle.randn([3, 4]).numpy())
    _SavesItsInputs.seen.clear()
    y = paddle_mgrad.recompute(
        lambda h: paddle.tanh(_SavesItsInputs.apply(h, w)), h, use_reentrant=False
    )
    y.sum().backward()
    ((_, sw),) = _SavesItsInputs.seen
    assert sw is w


# -- one frame driven by hand: what no block makes Paddle hand to the hooks --------------------
def _saves_nothing():
    pass


def _dropped_tensor(shape=(2, 3)):
    """A tensor the frame drops: no parameter, no argument, no leaf that needs a gradient."""
    return paddle.ones(list(shape))


def test_a_saved_none_is_kept_as_none_without_a_recomputation():
    calls = []
    frame = non_reentrant._Frame(lambda: calls.append(1), (), {}, False)
    holder = frame.pack(None)
    frame.forward_done()
    assert holder.kept
    assert frame.unpack(holder) is None
    assert calls == []


def test_a_recomputation_that_saves_a_tensor_where_the_forward_saved_none_names_it():
    a = paddle.ones([2, 3])
    a.stop_gradient = False
    frame = non_reentrant._Frame(lambda: paddle.tanh(a), (), {}, False)
    frame.pack(None)
    holder = frame.pack(_dropped_tensor())
    frame.forward_done()
    with pytest.raises(
        RecomputeError,
        match=r"saved tensor #0: forward saved None, "
        r"recomputation saved ",
    ):
        frame.unpack(holder)


def test_a_recomputation_that_saves_less_names_the_first_missing_none():
    frame = non_reentrant._Frame(_saves_nothing, (), {}, False)
    frame.pack(None)
    holder = frame.pack(_dropped_tensor())
    frame.forward_done()
    with pytest.raises(
        RecomputeError,
        match=r"recomputation saved 0 tensors, the forward saved "
        r"2 \(first missing: #0, forward saved None\)",
    ):
        frame.unpack(holder)


def test_without_the_check_a_tensor_not_reproduced_is_named():
    """``determinism_check="none"``: a recomputation that saves fewer tensors is not checked,
    but the unpack of a tensor it did not reproduce raises, naming the block."""
    frame = non_reentrant._Frame(_saves_nothing, (), {}, False, "none")
    holder = frame.pack(_dropped_tensor())
    frame.forward_done()
    with pytest.raises(
        RecomputeError,
        match=r"^recompute\(_saves_nothing\): saved tensor #0 "
        r"was not reproduced by recomputation$",
    ):
        frame.unpack(holder)


def test_a_failed_check_skips_dead_holders_and_keeps_the_kept_ones():
    """After a failed determinism check the dropped holders hold nothing; a holder whose graph
    died is skipped, a kept one still holds its tensor."""
    w = paddle.create_parameter([2, 3], "float32")
    frame = non_reentrant._Frame(lambda: paddle.tanh(w[:1]), (), {}, False)
    dropped = frame.pack(_dropped_tensor())
    dead = frame.pack(_dropped_tensor())
    kept = frame.pack(w)
    frame.forward_done()
    del dead
    with pytest.raises(RecomputeError, match="is not deterministic"):
        frame.unpack(dropped)
    assert dropped.value is None
    assert kept.value is w


def test_a_tensor_saved_during_the_recomputation_is_never_unpacked():
    """The recomputed graph is never back-propagated: its unpack hook refuses (the error
    reaches the caller through Paddle's C++ as a line of an ``OSError``)."""
    a = paddle.ones([2, 3])
    a.stop_gradient = False

    def block():
        y = paddle.tanh(a)
        paddle.grad(y.sum(), a)

    frame = non_reentrant._Frame(block, (), {}, False)
    holder = frame.pack(_dropped_tensor())
    frame.forward_done()
    with pytest.raises(
        Exception,
        match=r"(?m)RecomputeError: internal: a tensor saved during "
        r"recomputation was unpacked$",
    ):
        frame.unpack(holder)
