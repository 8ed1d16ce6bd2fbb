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
        return [paddle.nn.Sequential(paddle.nn.Linear(5, 5), paddle.nn.ReLU(),
                                     paddle.nn.Linear(5, 5)) for _ in range(2)]

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
                h = paddle_mgrad.recompute(blk, h, use_reentrant=False,
                                           determinism_check=check) if fused else blk(h)
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
