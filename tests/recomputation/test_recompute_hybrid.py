"""fleet's recompute_hybrid with paddle_mgrad on: single-process tests (a 1-rank or fake
2-rank mp group).  The 2-rank pipeline run with recompute_interval is tests/fleet/launch."""

import importlib

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker
from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer
from paddle.incubate.distributed.fleet import recompute_hybrid as incubate_recompute_hybrid

import paddle_mgrad
from helpers import nonzero_biases, register_counter_generator
from paddle_mgrad import RecomputeError, registry, stats
from userlayers import SEEN, Block, SaveAll

# (the package re-exports the function under the module's name: fetch the module itself)
rh_module = importlib.import_module("paddle.distributed.fleet.recompute.recompute_hybrid")


class Group:
    """What recompute_hybrid reads of an mp group (no communication at nranks=1)."""

    def __init__(self, nranks=1, rank=0):
        self.nranks, self.rank = nranks, rank


def hybrid(ctx, function, *args, **kwargs):
    return rh_module.recompute_hybrid(ctx, function, *args, **kwargs)


def _x(seed=3, shape=(2, 3, 8)):
    x = paddle.to_tensor(np.random.RandomState(seed).standard_normal(shape).astype("float32"))
    x.stop_gradient = False
    return x


def test_every_alias_runs_ours():
    paddle_mgrad.enable(recompute=True)
    stats.reset()
    x = _x()
    for fn in (rh_module.recompute_hybrid, incubate_recompute_hybrid, pp_layers.recompute_hybrid):
        fn({"mp_group": Group()}, paddle.tanh, x).sum().backward()
    assert stats.recompute["hybrid"] == 3
    assert stats.recompute["recomputations"] == 3
    paddle_mgrad.disable()
    assert rh_module.recompute_hybrid.__code__ is registry.original("recompute_hybrid").__code__


def _train(use_hybrid, ctx=None, micro=2):
    """Block (params on self) + SaveAll with a parameter *argument*, under MixPrecisionLayer."""
    paddle.seed(99)
    blk = Block(bias=True)
    extra = paddle.create_parameter([8, 8], "float32")
    model = MixPrecisionLayer(blk, dtype="bfloat16")
    extra.main_grad = None  # main_grad written by SaveAll's backward itself
    ptrs = []
    for m in range(micro):
        x = _x(seed=m)

        def f(a, w):
            return blk(SaveAll.apply(a, w, None))

        y = hybrid(ctx or {"mp_group": Group()}, f, x, extra) if use_hybrid else f(x, extra)
        y.sum().backward()
        ptrs.append(blk.fc1.weight.main_grad.data_ptr())
    grads = {
        p.name.split("_")[0] + str(i): p.main_grad.numpy() for i, p in enumerate(model.parameters())
    }
    grads["extra"] = extra.main_grad.numpy()
    return grads, ptrs, [blk.fc1.weight.grad, blk.fc2.weight.grad, extra.grad], extra


def test_parameters_and_main_grad_kept():
    plain, _, _, _ = _train(False)
    paddle_mgrad.enable(recompute=True)
    SEEN.clear()
    ours, ptrs, leftover, extra = _train(True)
    assert ptrs[0] == ptrs[1]  # main_grad accumulated in place, on the real parameter
    assert all(g is None for g in leftover)
    # the PyLayer's backward saw the real parameter argument (with main_grad), every time
    assert SEEN and all(s[0] == id(extra) and s[1] for s in SEEN)
    assert plain.keys() == ours.keys()
    for k in plain:
        np.testing.assert_allclose(ours[k], plain[k], rtol=1e-6, atol=1e-6, err_msg=k)


def test_native_recompute_hybrid_on_cpu():
    """Paddle's own recompute_hybrid cannot preserve RNG on CPU (the bug ours fixes)."""
    with pytest.raises(Exception, match="not support current device"):
        _train(True)


def _tracker_seed():
    tracker = get_rng_state_tracker()
    if "pmg_test_seed" not in tracker.states_:
        tracker.add("pmg_test_seed", 4321)
    return tracker


def test_rng_replayed_cpu_generator_and_mp_tracker():
    tracker = _tracker_seed()

    def f(a):
        with tracker.rng_state("pmg_test_seed"):
            a = F.dropout(a, 0.5)  # the model-parallel tracker's generator
        return F.dropout(paddle.tanh(a), 0.3)  # the global CPU generator

    def run(use_hybrid):
        saved = tracker.get_states_tracker()
        paddle.seed(5)
        x = _x()
        y = hybrid({"mp_group": Group()}, f, x) if use_hybrid else f(x)
        (y * y).sum().backward()
        tracker.set_states_tracker(saved)
        return y.numpy(), x.grad.numpy()

    y0, g0 = run(False)
    paddle_mgrad.enable(recompute=True)
    y1, g1 = run(True)
    np.testing.assert_array_equal(y1, y0)
    np.testing.assert_allclose(g1, g0, rtol=1e-6)
    assert (g0 == 0).any()  # dropout really dropped something


def test_a_custom_state_registered_with_paddle_is_replayed(monkeypatch):
    """A user's generator registered with Paddle 3.x's ``custom_state_manager``, which Paddle's
    own recompute_hybrid replays: the recomputation draws what the forward drew, and the
    caller's later state is back after backward."""
    counter = register_counter_generator(monkeypatch)
    draws = []

    def f(a):
        draws.append(counter["n"])
        counter["n"] += 1
        return paddle.tanh(a) * float(draws[-1] + 2)

    paddle_mgrad.enable(recompute=True)
    x = _x()
    y = hybrid({"mp_group": Group()}, f, x)
    counter["n"] = 40
    y.sum().backward()
    assert draws == [0, 0] and counter["n"] == 40
    ref = _x()
    (paddle.tanh(ref) * 2.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), ref.grad.numpy())


def test_nondeterministic_recomputation_raises():
    paddle_mgrad.enable(recompute=True)
    calls = []

    def f(a):
        calls.append(1)
        return paddle.tanh(a if len(calls) == 1 else paddle.concat([a, a]))

    y = hybrid({"mp_group": Group()}, f, _x())
    with pytest.raises(RecomputeError, match=r"not deterministic.*\[2, 3, 8\].*\[4, 3, 8\]"):
        y.sum().backward()


def test_reentrant_recompute_checks_outputs_too():
    """The output check lives in the reentrant core shared with paddle_mgrad.recompute."""
    calls = []

    def f(a):
        calls.append(1)
        return paddle.tanh(a if len(calls) == 1 else a.astype("float64"))

    y = paddle_mgrad.recompute(f, _x(), use_reentrant=True)
    with pytest.raises(RecomputeError, match="float64"):
        y.sum().backward()


@pytest.mark.parametrize("offload,partition", [(True, False), (False, True), (True, True)])
def test_offload_and_partition(monkeypatch, offload, partition):
    """partition=True keeps only this rank's slice of each saved input and all-gathers it in
    backward (fake 2-rank group: the other rank's slice comes from the test)."""
    x = _x()
    full = x.numpy().reshape(-1)
    half = full.size // 2
    gathered = []

    def fake_all_gather(parts, t, group=None, sync_op=True):
        np.testing.assert_array_equal(t.numpy(), full[:half])  # rank 0 kept its slice only
        assert t.place.is_cpu_place()
        gathered.append(group)
        parts.extend([t, paddle.to_tensor(full[half:])])

    monkeypatch.setattr(paddle.distributed, "all_gather", fake_all_gather)

    def f(a, w):
        return paddle.matmul(paddle.tanh(a), w)

    w = paddle.create_parameter([8, 4], "float32")
    y0 = f(x, w)
    y0.sum().backward()
    gx, gw = x.grad.numpy(), w.grad.numpy()
    x.clear_gradient()
    w.clear_gradient()

    paddle_mgrad.enable(recompute=True)
    group = Group(nranks=2, rank=0)
    y = hybrid({"mp_group": group, "offload": offload, "partition": partition}, f, x, w)
    y.sum().backward()
    np.testing.assert_array_equal(y.numpy(), y0.numpy())
    np.testing.assert_allclose(x.grad.numpy(), gx, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), gw, rtol=1e-6)
    assert gathered == ([group] if partition else [])


def test_tuple_outputs_as_fleet():
    """Pipeline stages pass masks/ids through: non-float outputs come back stop_gradient."""
    paddle_mgrad.enable(recompute=True)
    lin = nonzero_biases(paddle.nn.Linear(8, 8))
    mask = paddle.ones([2, 3, 8])  # stop_gradient input returned as is
    ids = paddle.to_tensor([1, 2, 3])

    def f(a, m, i):
        return lin(a) * m, m, i * 2  # PyLayer marks every output differentiable

    weights = paddle.to_tensor(
        np.random.RandomState(4).standard_normal([2, 3, 8]).astype("float32")
    )
    x = _x()
    h, m, i = hybrid({"mp_group": Group()}, f, x, mask, ids)
    assert not h.stop_gradient and i.stop_gradient
    ((h * weights).sum() + m.sum()).backward()
    got = [t.numpy() for t in (h, i, x.grad, lin.weight.grad, lin.bias.grad)]
    lin.clear_gradients()
    x = _x()  # the same block without recompute: the values to equal
    h, m, i = f(x, mask, ids)
    ((h * weights).sum() + m.sum()).backward()
    for a, b in zip(got, (h, i, x.grad, lin.weight.grad, lin.bias.grad)):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-6, atol=1e-6)


def test_needs_mp_group():
    paddle_mgrad.enable(recompute=True)
    with pytest.raises(ValueError, match="mp_group"):
        hybrid({"offload": True}, paddle.tanh, _x())


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_inputs_needing_no_grad_still_train_the_block(fused):
    """Frozen inputs for recompute_hybrid (a first pipeline stage behind frozen embeddings): no
    argument needs a gradient, the block's parameters get exactly the gradients of no
    recompute, and a block with nothing to train stays untouched and unrecomputed."""

    def run(use_hybrid, freeze_all=False):
        paddle_mgrad.disable()
        paddle_mgrad.enable(recompute=True, fused_linear=fused)
        paddle.seed(99)
        blk = Block(bias=True)
        for p in blk.parameters():
            p.stop_gradient = freeze_all
        MixPrecisionLayer(blk, dtype="bfloat16")
        for m in range(2):
            x = _x(seed=m)
            x.stop_gradient = True
            y = hybrid({"mp_group": Group()}, blk, x) if use_hybrid else blk(x)
            assert y.stop_gradient == freeze_all
            y.sum().backward()
        return [None if p.main_grad is None else p.main_grad.numpy() for p in blk.parameters()]

    ref = run(False)
    assert all(g is not None for g in ref)
    stats.reset()
    for g, r in zip(run(True), ref):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
    assert stats.recompute["reentrant_as_non_reentrant"] == 2
    assert stats.recompute["recomputations"] == 2
    stats.reset()
    assert all(g is None for g in run(True, freeze_all=True))
    assert stats.recompute["recomputations"] == 0
