"""paddle_mgrad.recompute against plain autograd and against Paddle's own recompute.

Cases that unpatched Paddle gets wrong run against it too, as plain tests that
assert Paddle's wrong behaviour explicitly (the error text, the copy handed to
backward, the wrong value) next to ours being right: if Paddle ever fixes one,
the assertion fails and tells us.  Paddle's non-reentrant recompute runs with
``preserve_rng_state=False`` where the case is not about random state, so that
Paddle 2.6's CPU RNG refusal does not hide the bug the test is about.
"""

import json
import re

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils import recompute as native_recompute
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import PADDLE2, nonzero_biases, run_probe_script
from paddle_mgrad import RecomputeError, stats
from userlayers import SEEN, Block, SaveAll, SaveWeightAlone


def run_with(impl, function, *args, **kwargs):
    if impl == "native":
        if not kwargs.get("use_reentrant", True):
            # not about RNG: keep Paddle 2.6's "RNG perserve is not support current device:
            # cpu" from hiding the bug under test
            kwargs.setdefault("preserve_rng_state", False)
        return native_recompute(function, *args, **kwargs)
    if impl == "enabled":  # our fix reached through Paddle's own name
        paddle_mgrad.enable(recompute=True)
        return native_recompute(function, *args, **kwargs)
    return paddle_mgrad.recompute(function, *args, **kwargs)


def make_data(n_micro=3, shape=(2, 3, 8)):
    rs = np.random.RandomState(7)
    return [rs.standard_normal(shape).astype("float32") for _ in range(n_micro)]


def reference_grads(bias, data, d_in=8):
    """float64 numpy reference of sum over micro-batches of d(sum(block(x)))/dW."""
    paddle.seed(99)
    blk = Block(d_in=d_in, bias=bias)
    w1, w2 = (blk.fc1.weight.numpy().astype("f8"), blk.fc2.weight.numpy().astype("f8"))
    b1 = blk.fc1.bias.numpy().astype("f8") if bias else 0.0
    # (fc2's bias does not change any gradient of sum(block(x)))
    g = {"w1": 0, "w2": 0, "b1": 0, "b2": 0}
    for x in data:
        x2 = x.reshape(-1, d_in).astype("f8")
        h = np.tanh(x2 @ w1 + b1)
        dy = np.ones((x2.shape[0], w2.shape[1]))
        g["w2"] = g["w2"] + h.T @ dy
        g["b2"] = g["b2"] + dy.sum(0)
        dh = (dy @ w2.T) * (1 - h * h)
        g["w1"] = g["w1"] + x2.T @ dh
        g["b1"] = g["b1"] + dh.sum(0)
    return g


MODES = ["none", "reentrant", "non_reentrant"]


def train_micro(impl, mode, layer_cls, bias, data, mix=True, x_needs_grad=True):
    paddle.seed(99)
    blk = Block(bias=bias, layer_cls=layer_cls)
    model = MixPrecisionLayer(blk, dtype="bfloat16") if mix else blk
    SEEN.clear()
    for x in data:
        xt = paddle.to_tensor(x)
        xt.stop_gradient = not x_needs_grad
        if mode == "none":
            y = model(xt)
        else:
            y = run_with(impl, model, xt, use_reentrant=(mode == "reentrant"))
        y.sum().backward()
    return blk


def check_main_grads(blk, ref, bias):
    pairs = [(blk.fc1.weight, ref["w1"]), (blk.fc2.weight, ref["w2"])]
    if bias:
        pairs += [(blk.fc1.bias, ref["b1"]), (blk.fc2.bias, ref["b2"])]
    for p, r in pairs:
        assert p.grad is None, f"{p.name}: .grad should stay None under main_grad"
        assert p.main_grad is not None, f"{p.name}: main_grad lost"
        assert p.main_grad.dtype == paddle.float32
        np.testing.assert_allclose(p.main_grad.numpy(), r, rtol=1e-5, atol=1e-5)


def _weight_ids(blk):
    return {id(p) for p in blk.parameters()}


# ----------------------------------------------------------------- main_grad
@pytest.mark.parametrize("layer_cls", [SaveWeightAlone, SaveAll], ids=["save_weight", "save_all"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", ["ours", "enabled"])
def test_main_grad_matches_reference(impl, mode, layer_cls, bias):
    data = make_data()
    blk = train_micro(impl, mode, layer_cls, bias, data)
    ids = _weight_ids(blk)
    assert SEEN, "user backward never ran"
    for wid, has_mg, name, _ in SEEN:
        assert wid in ids, f"backward got a copy ({name}) instead of the parameter"
        assert has_mg
    check_main_grads(blk, reference_grads(bias, data), bias)


SAVE_FOR_BACKWARD_NONE = "save_for_backward only support Tensor, list of Tensor, tuple of Tensor"


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_native_non_reentrant_save_weight_alone(bias):
    """Paddle 2.6 hands the user's backward a '<name>cpy' copy without main_grad (the
    backward then returns dW as .grad, which MixPrecisionLayer's hook folds in: the sums
    are right, the in-place main_grad path is lost).  Paddle 3.3 hands the parameter."""
    data = make_data(2)
    blk = train_micro("native", "non_reentrant", SaveWeightAlone, bias, data)
    ids = _weight_ids(blk)
    assert len(SEEN) == 4
    for wid, has_mg, name, _ in SEEN:
        if PADDLE2:
            assert wid not in ids and not has_mg and name.endswith("cpy"), name
        else:
            assert wid in ids and has_mg and not name.endswith("cpy"), name
    check_main_grads(blk, reference_grads(bias, data), bias)


def test_native_non_reentrant_save_all_none_bias():
    """Paddle 2.6: ``save_for_backward(x, w, None)`` raises ValueError under recompute."""
    data = make_data(2)
    if PADDLE2:
        with pytest.raises(ValueError, match=SAVE_FOR_BACKWARD_NONE):
            train_micro("native", "non_reentrant", SaveAll, False, data)
        return
    blk = train_micro("native", "non_reentrant", SaveAll, False, data)
    check_main_grads(blk, reference_grads(False, data), False)


@pytest.mark.parametrize("impl", ["ours", "native"])
def test_save_for_backward_with_none(impl):
    got = {}

    class P(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, None, x)
            return x * 3

        @staticmethod
        def backward(ctx, dy):
            a, b, c = ctx.saved_tensor()
            got["saved"] = (a is not None, b, c is not None)
            return dy * 3

    x = paddle.randn([4])
    x.stop_gradient = False
    if impl == "native" and PADDLE2:  # 2.6 rejects None in save_for_backward under hooks
        with pytest.raises(ValueError, match=SAVE_FOR_BACKWARD_NONE):
            run_with(impl, lambda t: P.apply(t * 1.0) * 2, x, use_reentrant=False)
        return
    y = run_with(impl, lambda t: P.apply(t * 1.0) * 2, x, use_reentrant=False)
    y.sum().backward()
    assert got["saved"] == (True, None, True)
    np.testing.assert_allclose(x.grad.numpy(), np.full([4], 6.0))


# ----------------------------------------------------------- python attributes
@pytest.mark.parametrize("impl", ["ours", "native"])
@pytest.mark.parametrize("layer_cls", [SaveWeightAlone, SaveAll], ids=["save_weight", "save_all"])
def test_param_python_attribute_survives(impl, layer_cls):
    """Ours hands backward the parameter with its Python attributes; Paddle (both
    versions) hands a '<name>cpy' copy without them (2.6 first refuses SaveAll's None)."""
    paddle.seed(3)
    blk = Block(bias=False, layer_cls=layer_cls)
    for p in blk.parameters():
        p.sequence_parallel = True
    SEEN.clear()
    x = paddle.randn([4, 8])
    x.stop_gradient = False
    if impl == "native" and PADDLE2 and layer_cls is SaveAll:
        with pytest.raises(ValueError, match=SAVE_FOR_BACKWARD_NONE):
            run_with(impl, blk, x, use_reentrant=False)
        return
    y = run_with(impl, blk, x, use_reentrant=False)
    y.sum().backward()
    if impl == "native":  # Paddle's bug, asserted so that a fix shows
        assert [s[3] for s in SEEN] == [None, None]
        assert all(s[0] not in _weight_ids(blk) and s[2].endswith("cpy") for s in SEEN)
    else:
        assert [s[3] for s in SEEN] == [True, True]
        assert all(s[0] in _weight_ids(blk) for s in SEEN)
    assert blk.fc1.weight.grad is not None and blk.fc2.weight.grad is not None


def test_param_grad_without_main_grad_matches_plain():
    """Params without main_grad: .grad equals no-recompute .grad (each mode)."""
    x = paddle.randn([3, 8])
    grads = {}
    for mode in MODES:
        paddle.seed(5)
        blk = Block(bias=True, layer_cls=SaveAll)
        xt = x.detach()
        xt.stop_gradient = False
        y = (
            blk(xt)
            if mode == "none"
            else paddle_mgrad.recompute(blk, xt, use_reentrant=(mode == "reentrant"))
        )
        (y * y).sum().backward()
        grads[mode] = [p.grad.numpy() for p in blk.parameters()] + [xt.grad.numpy()]
    for mode in MODES[1:]:
        for a, b in zip(grads["none"], grads[mode]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------ reentrant #70508
class _UsesArgWeight(paddle.autograd.PyLayer):
    """Backward accumulates into w.main_grad with add_ (Paddle issue #70508)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return paddle.matmul(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensor()
        dw = paddle.matmul(x, dy, transpose_x=True)
        if w.main_grad is None:
            w.main_grad = dw
        else:
            w.main_grad.add_(dw)
        dx = None if x.stop_gradient else paddle.matmul(dy, w, transpose_y=True)
        return dx, None


def _arg_weight_run(impl, x_needs_grad, steps=2):
    paddle.seed(11)
    lin = nonzero_biases(paddle.nn.Linear(8, 4, bias_attr=False))
    MixPrecisionLayer(lin, dtype="bfloat16")
    w = lin.weight
    xs = [paddle.randn([5, 8]) for _ in range(steps)]
    for x in xs:
        x.stop_gradient = not x_needs_grad
        y = run_with(
            impl, lambda a, b: paddle.tanh(_UsesArgWeight.apply(a, b)), x, w, use_reentrant=True
        )
        y.sum().backward()
    ref = 0
    wn = w.numpy().astype("f8")
    for x in xs:
        xn = x.numpy().astype("f8")
        ref = ref + xn.T @ (1 - np.tanh(xn @ wn) ** 2)
    return w, ref


@pytest.mark.parametrize("x_needs_grad", [True, False])
@pytest.mark.parametrize("impl", ["ours", "enabled", "native"])
def test_reentrant_param_argument_keeps_main_grad(impl, x_needs_grad):
    if impl == "native":
        # Paddle's reentrant recompute rebuilds the parameter argument as a copy whose
        # main_grad is lost (#70508): the user's backward fails on w.main_grad
        with pytest.raises(OSError, match="object has no attribute 'main_grad'"):
            _arg_weight_run(impl, x_needs_grad)
        paddle.framework._dygraph_tracer()._has_grad = True  # a failed backward leaves grad off
        return
    w, ref = _arg_weight_run(impl, x_needs_grad)
    assert w.grad is None
    assert w.main_grad is not None, "main_grad was written to a copy"
    np.testing.assert_allclose(w.main_grad.numpy(), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ non-leaf tensors
def test_recomputed_non_leaf_shares_buffer_and_keeps_flags():
    seen = {"fwd_ptrs": []}

    class Keep(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, h):
            ctx.save_for_backward(h)
            return h * 2

        @staticmethod
        def backward(ctx, dy):
            (h,) = ctx.saved_tensor()
            seen["bwd_ptr"] = h.data_ptr()
            seen["stop_gradient"] = h.stop_gradient
            seen["attr"] = getattr(h, "tag", None)
            return dy * 2

    def fn(x):
        h = paddle.tanh(x)
        if not PADDLE2:  # plain tensors take Python attributes on 3.x only
            h.tag = "hidden"
        seen["fwd_ptrs"].append(h.data_ptr())
        return Keep.apply(h)

    x = paddle.randn([6])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(fn, x, use_reentrant=False)
    y.sum().backward()
    assert len(seen["fwd_ptrs"]) == 2  # forward + one recomputation
    assert seen["bwd_ptr"] == seen["fwd_ptrs"][1], "saved tensor is a copy, not a view"
    assert seen["stop_gradient"] is False
    if not PADDLE2:
        assert seen["attr"] == "hidden"
    np.testing.assert_allclose(
        x.grad.numpy(), 2 * (1 - np.tanh(x.numpy()) ** 2), rtol=1e-6, atol=1e-6
    )


# ----------------------------------------------------------------------- RNG
class DropNet(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.blocks = paddle.nn.LayerList([Block(bias=True, dropout=0.3) for _ in range(3)])
        self.head = nonzero_biases(paddle.nn.Linear(8, 1))

    def forward(self, x, rc=None, use_reentrant=True):
        for b in self.blocks:
            x = (
                b(x)
                if rc is None
                else rc(b, x, use_reentrant=use_reentrant, preserve_rng_state=True)
            )
        return self.head(x).mean()


def _train_dropnet(rc, use_reentrant, steps=3):
    paddle.seed(2024)
    np.random.seed(2024)
    net = DropNet()
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=net.parameters())
    losses = []
    for _ in range(steps):
        x = paddle.randn([4, 8])
        x.stop_gradient = False
        loss = net(x, rc, use_reentrant)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss.numpy())
    return np.array(losses), [p.numpy() for p in net.parameters()]


@pytest.mark.parametrize(
    "impl,use_reentrant", [("ours", True), ("ours", False), ("native", True), ("native", False)]
)
def test_dropout_bit_identical_over_steps(impl, use_reentrant):
    ref_l, ref_p = _train_dropnet(None, use_reentrant)
    rc = paddle_mgrad.recompute if impl == "ours" else native_recompute
    if impl == "native" and not use_reentrant and PADDLE2:
        with pytest.raises(RuntimeError, match="RNG perserve is not support current device: cpu"):
            _train_dropnet(rc, use_reentrant)
        return
    got_l, got_p = _train_dropnet(rc, use_reentrant)
    assert np.array_equal(ref_l, got_l), (ref_l, got_l)
    for a, b in zip(ref_p, got_p):
        assert np.array_equal(a, b)


def test_mp_tracker_dropout_same_in_a_second_backward():
    """fleet's model-parallel RNG tracker (real, on the CPU): a block drawing its dropout
    mask under ``tracker.rng_state()``; a second backward (retain_graph=True) re-runs the
    recomputation and must replay the same mask: 2x the gradient of one backward, which
    equals plain autograd without recompute.  On Paddle 2.6 the first replay advanced the
    saved snapshot (the tracker kept our dict), so the second drew another mask."""
    from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

    tracker = get_rng_state_tracker()
    name = "paddle_mgrad_test_dropout"
    if name not in tracker.get_states_tracker():
        tracker.add(name, 77)
    w = paddle.randn([8, 8])

    def fn(x):
        h = paddle.matmul(x, w)
        with get_rng_state_tracker().rng_state(name):
            h = paddle.nn.functional.dropout(h, 0.5)
        return paddle.tanh(h)

    start = tracker.get_states_tracker()
    x = paddle.randn([16, 8])
    xp = x.detach()
    xp.stop_gradient = False
    (fn(xp) ** 2).sum().backward()  # plain, no recompute
    tracker.set_states_tracker(dict(start))
    x.stop_gradient = False
    y = paddle_mgrad.recompute(fn, x, use_reentrant=False)
    (y**2).sum().backward(retain_graph=True)
    g1 = x.grad.numpy().copy()
    (y**2).sum().backward()
    np.testing.assert_allclose(g1, xp.grad.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 2 * g1, rtol=1e-6, atol=1e-6)


def test_rng_state_restored_after_recompute():
    """Recomputation must not advance or reset the caller's generators."""
    import random

    x = paddle.randn([8])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(
        lambda t: paddle.nn.functional.dropout(t, 0.5) * 2, x, use_reentrant=False
    )
    state = (paddle.get_rng_state(), np.random.get_state(), random.getstate())
    y.sum().backward()
    drawn = (paddle.rand([6]).numpy(), np.random.rand(6), random.random())
    paddle.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])
    expected = (paddle.rand([6]).numpy(), np.random.rand(6), random.random())
    assert np.array_equal(drawn[0], expected[0])
    assert np.array_equal(drawn[1], expected[1]) and drawn[2] == expected[2]


# ----------------------------------------------------------------------- AMP
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_amp_state_replayed(use_reentrant):
    from paddle.framework import core

    tracer = paddle.framework._dygraph_tracer()
    seen = []

    def fn(x):
        white, black = tracer._get_amp_op_list()
        seen.append((tracer._amp_level, tracer._amp_dtype, sorted(white), sorted(black)))
        return paddle.tanh(x) * x

    x = paddle.randn([5])
    x.stop_gradient = False
    saved = (tracer._amp_level, tracer._amp_dtype, tracer._get_amp_op_list())
    try:
        tracer._amp_level = core.AmpLevel.O1
        tracer._amp_dtype = "float16"
        tracer._set_amp_op_list({"my_white_op"}, {"my_black_op", "tanh"})
        y = paddle_mgrad.recompute(fn, x, use_reentrant=use_reentrant)
    finally:
        tracer._amp_level, tracer._amp_dtype = saved[0], saved[1]
        tracer._set_amp_op_list(*saved[2])
    y.sum().backward()
    assert len(seen) == 2
    assert seen[0] == seen[1]
    assert seen[1][0] == core.AmpLevel.O1 and seen[1][1] == "float16"
    assert tracer._amp_level == saved[0]  # replay did not leak out of backward


# ------------------------------------------------------------- determinism
NONDETERMINISTIC_ADVICE = (
    ". Gradients would be wrong. Make the block's saved tensors depend only on its inputs (use "
    "preserve_rng_state=True for dropout, avoid data-dependent branches)."
)


@pytest.mark.parametrize("kind", ["shape", "fewer", "extra", "dtype"])
def test_nondeterministic_recomputation_raises(kind):
    calls = []

    def fn(x):
        calls.append(1)
        first = len(calls) == 1
        if kind == "shape":
            h = x if first else paddle.concat([x, x])
            return (paddle.tanh(h)).sum()
        if kind == "dtype":
            h = x if first else x.astype("float64")
            return paddle.tanh(h).sum().astype("float32")
        h = paddle.tanh(x)
        if first == (kind == "fewer"):
            h = paddle.tanh(h)  # one more saved tensor in the forward (fewer) or the rerun (extra)
        return h.sum()

    x = paddle.randn([4])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(fn, x, use_reentrant=False)
    with pytest.raises(RecomputeError) as e:
        y.backward()
    msg = str(e.value)
    assert "recompute(" in msg and "fn) is not deterministic" in msg
    if kind == "shape":
        assert "forward saved shape=[4], dtype=paddle.float32, recomputation saved" in msg
        assert "shape=[8]" in msg
    if kind == "dtype":
        assert "dtype=paddle.float64" in msg
    if kind == "fewer":  # the count check after the rerun, naming the first missing tensor
        assert re.search(
            r"recomputation saved 1 tensors, the forward saved 2 "
            r"\(first missing: #1, forward saved \[4\]\)",
            msg,
        ), msg
    if kind == "extra":  # the rerun's pack hook saw more tensors than the forward saved
        assert re.search(
            r"recomputation saved an extra tensor #1 Tensor\(name='[^']*', "
            r"shape=\[4\], dtype=paddle.float32\); the forward saved only 1",
            msg,
        ), msg
    assert msg.endswith(NONDETERMINISTIC_ADVICE), msg
    assert isinstance(e.value, RuntimeError)
    assert paddle.framework._dygraph_tracer()._has_grad  # grad mode back on after the error


def test_a_recomputation_saving_many_more_tensors_names_three():
    """Five tensors more in the recomputation than in the forward: the error names the first
    three, separated by "; "."""
    calls = []

    def fn(x):
        calls.append(1)
        h = paddle.tanh(x)
        for _ in range(5 if len(calls) > 1 else 0):
            h = paddle.tanh(h)
        return h.sum()

    x = paddle.randn([4])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(fn, x, use_reentrant=False)
    with pytest.raises(RecomputeError) as e:
        y.backward()
    problems = str(e.value).split(" is not deterministic: ")[1][: -len(NONDETERMINISTIC_ADVICE)]
    one = (
        r"recomputation saved an extra tensor #{} Tensor\(name='[^']*', shape=\[4\], "
        r"dtype=paddle.float32\); the forward saved only 1"
    )
    assert re.fullmatch("; ".join(one.format(i) for i in (1, 2, 3)), problems), problems


def test_leaf_needing_grad_is_kept_not_recomputed():
    """A leaf that needs a gradient (neither a parameter nor an argument: read from a
    closure) is held as the object itself: backward gets *that* tensor, so an attribute
    assigned to it in backward (``t.main_grad = ...``) lands on it, not on a view."""
    leaf = paddle.randn([3, 4])
    leaf.stop_gradient = False
    seen = {}

    class Mul(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, x, t):
            ctx.save_for_backward(x, t)
            return x * t

        @staticmethod
        def backward(ctx, dy):
            x, t = ctx.saved_tensor()
            seen["same"] = t is leaf
            seen["ptr"] = t.data_ptr()
            return dy * t, dy * x

    x = paddle.randn([3, 4])
    x.stop_gradient = False
    before = stats.recompute["recomputations"]
    y = paddle_mgrad.recompute(lambda a: Mul.apply(paddle.tanh(a), leaf), x, use_reentrant=False)
    y.sum().backward()
    assert stats.recompute["recomputations"] == before + 1  # tanh(a) was recomputed
    assert seen["same"], "backward got a view of the leaf, not the leaf"
    assert seen["ptr"] == leaf.data_ptr()
    np.testing.assert_allclose(leaf.grad.numpy(), np.tanh(x.numpy()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["ours", "native"])
def test_nondeterministic_shape_native_is_silently_wrong(impl):
    """A recomputation that saves a differently shaped tensor: Paddle back-propagates
    through it without a word and returns a wrong gradient; ours raises."""
    calls = []

    def fn(x):
        calls.append(1)
        h = x if len(calls) == 1 else paddle.concat([x * 3, x])
        return paddle.tanh(h).sum()

    x = paddle.randn([4])
    x.stop_gradient = False
    right = 1 - np.tanh(x.numpy().astype("f8")) ** 2
    y = run_with(impl, fn, x, use_reentrant=False)
    if impl == "ours":
        with pytest.raises(RecomputeError, match=r"shape=\[8\]"):
            y.backward()
        return
    y.backward()  # no error
    assert x.grad is not None and x.grad.shape == [4]
    assert not np.allclose(x.grad.numpy(), right, rtol=1e-3, atol=1e-3), "Paddle now gets it right"


# ----------------------------------------------- parity with Paddle's recompute
def _grads_of(fn_builder, impl, use_reentrant):
    paddle.seed(21)
    layer = nonzero_biases(paddle.nn.Linear(6, 6))
    xa = paddle.randn([3, 6])
    xb = paddle.randn([3, 6])
    xa.stop_gradient = False
    xb.stop_gradient = False
    out = fn_builder(
        layer, xa, xb, lambda *a, **k: run_with(impl, *a, use_reentrant=use_reentrant, **k)
    )
    loss = (
        sum(o.sum() for o in out if o is not None) if isinstance(out, (list, tuple)) else out.sum()
    )
    loss.backward()
    grads = [
        t.grad.numpy() if t.grad is not None else None for t in (xa, xb, layer.weight, layer.bias)
    ]
    return grads


def _kwargs_case(layer, xa, xb, rc):
    def f(a, b=None, scale=1.0):  # (tanh saves its output: recomputed with the same scale)
        return paddle.tanh(layer(a) * scale) + (b if b is not None else 0)

    return rc(f, xa, b=xb, scale=2.0)


def _tuple_case(layer, xa, xb, rc):
    def f(pair):
        return layer(pair[0]) + pair[1]

    return rc(f, (xa, xb))


def _none_output_case(layer, xa, xb, rc):
    def f(a, b):
        return layer(a), None, b * 2

    return rc(f, xa, xb)


def _no_grad_input_case(layer, xa, xb, rc):
    mask = paddle.ones([3, 6])  # needs no grad

    def f(a, m):
        return layer(a) * m

    return rc(f, xa, mask)


def _nested_case(layer, xa, xb, rc):
    def inner(a):
        return paddle.tanh(layer(a))

    def outer(a, b):
        return rc(inner, a) * b

    return rc(outer, xa, xb)


# Cases where unpatched Paddle silently returns wrong gradients (no exception).
NATIVE_WRONG = {
    True: {("tuple", True)},  # 2.6: first tensor of a tuple argument loses its grad
    False: set(),
}

CASES = {
    "kwargs": _kwargs_case,
    "tuple": _tuple_case,
    "none_output": _none_output_case,
    "no_grad_input": _no_grad_input_case,
    "nested": _nested_case,
}


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_plain_autograd(case, use_reentrant):
    """Ours equals no recompute; Paddle's own is recorded for comparison."""
    ref = _grads_of(
        lambda layer, a, b, rc: CASES[case](layer, a, b, lambda f, *x, **k: f(*x, **k)),
        "ours",
        use_reentrant,
    )
    got = _grads_of(CASES[case], "ours", use_reentrant)
    for r, g in zip(ref, got):
        if r is None:
            assert g is None
        else:
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
    # Where Paddle's own recompute works, we must agree with it too.
    try:
        native = _grads_of(CASES[case], "native", use_reentrant)
    except Exception:
        return  # Paddle fails this case; we do not
    agree = all(
        (n is None) == (g is None) and (n is None or np.allclose(n, g, rtol=1e-6, atol=1e-6))
        for n, g in zip(native, got)
    )
    if (case, use_reentrant) in NATIVE_WRONG.get(PADDLE2, ()):
        assert not agree, "Paddle fixed this case: update NATIVE_WRONG"
    else:
        assert agree


def test_retain_graph_backward_twice():
    x = paddle.randn([4])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(lambda t: paddle.tanh(t) * t, x, use_reentrant=False)
    y.sum().backward(retain_graph=True)
    g1 = x.grad.numpy().copy()
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * g1, rtol=1e-6)


def test_no_grad_context_just_runs():
    x = paddle.randn([4])
    with paddle.no_grad():
        y = paddle_mgrad.recompute(paddle.tanh, x, use_reentrant=False)
    np.testing.assert_allclose(y.numpy(), np.tanh(x.numpy()), rtol=1e-6, atol=1e-7)


def test_stats_count_calls():
    before = dict(stats.recompute)
    x = paddle.randn([4])
    x.stop_gradient = False
    paddle_mgrad.recompute(paddle.tanh, x, use_reentrant=False).sum().backward()
    assert stats.recompute["non_reentrant"] == before["non_reentrant"] + 1
    assert stats.recompute["recomputations"] == before["recomputations"] + 1


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_parameter_storage_untouched_by_backward(use_reentrant):
    """Saved parameters must keep their buffer (Paddle 2.6 moves it out of what unpack returns)."""
    paddle.seed(8)
    blk = Block(bias=True)
    before = {p.name: (p.data_ptr(), p.numpy().copy()) for p in blk.parameters()}
    for _ in range(2):
        x = paddle.randn([3, 8])
        x.stop_gradient = False
        paddle_mgrad.recompute(blk, x, use_reentrant=use_reentrant).sum().backward()
    for p in blk.parameters():
        assert p._is_initialized()
        assert p.data_ptr() == before[p.name][0]
        assert np.array_equal(p.numpy(), before[p.name][1])


def test_reentrant_offload_indices_same_grads():
    paddle.seed(4)
    lin = nonzero_biases(paddle.nn.Linear(6, 6))
    x = paddle.randn([3, 6])
    grads = []
    for kwargs in ({}, {"offload_indices": [0]}):
        xt = x.detach()
        xt.stop_gradient = False
        paddle_mgrad.recompute(
            lambda a: paddle.tanh(lin(a)), xt, use_reentrant=True, **kwargs
        ).sum().backward()
        grads.append((xt.grad.numpy(), lin.weight.grad.numpy().copy()))
        lin.clear_gradients()
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="use_reentrant=True"):
        paddle_mgrad.recompute(paddle.tanh, x, use_reentrant=False, offload_indices=[0])


def test_reentrant_keyword_only_arguments():
    lin = nonzero_biases(paddle.nn.Linear(4, 4))

    def f(a, *, scale, bias=None):
        return lin(a) * scale + (0 if bias is None else bias)

    x = paddle.randn([2, 4])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(f, x, scale=3.0, use_reentrant=True)  # non-tensor kw-only: fine
    y.sum().backward()
    np.testing.assert_allclose(
        x.grad.numpy(), 3 * lin.weight.numpy().sum(1)[None].repeat(2, 0), rtol=1e-5, atol=1e-6
    )
    b = paddle.randn([4])
    b.stop_gradient = False
    with pytest.raises(ValueError, match="bias"):  # a kw-only tensor needing grad cannot be routed
        paddle_mgrad.recompute(f, x, scale=1.0, bias=b, use_reentrant=True)
    y = paddle_mgrad.recompute(f, x, scale=1.0, bias=b, use_reentrant=False)  # works here
    y.sum().backward()
    np.testing.assert_allclose(b.grad.numpy(), np.full([4], 2.0), rtol=1e-6)


@pytest.mark.probe
def test_second_backward_through_reentrant_recompute_is_an_error_not_a_crash():
    """Crash probe (subprocess, no signal): a second ordinary backward through the same
    reentrant recompute -- retain_graph then backward, backward twice, through another output
    of the block, paddle.grad after a backward -- with our fused linears inside.  Plain Paddle's
    reentrant recompute segfaults there (its PyLayer's context is released after the first
    backward); ours raises RecomputeError naming the cause and use_reentrant=False.  The first
    backward equals a run without recompute, and a fresh forward/backward afterwards is right."""
    r = run_probe_script("reentrant_twice_probe.py", "ours")
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])  # < 0: killed by a signal
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])
    assert set(res) == {
        "retain_then_backward",
        "backward_twice",
        "multi_output",
        "retain_then_grad",
    }
    for mode, out in res.items():
        assert out["first_ok"] and out["fresh_ok"] and out["grad_enabled_after"], (mode, out)
        assert out["error"] == "RecomputeError", (mode, out)
        assert "recompute(Block, use_reentrant=True)" in out["message"], (mode, out)
        assert "already ran" in out["message"] and "use_reentrant=False" in out["message"]


@pytest.mark.probe
def test_plain_paddle_reentrant_recompute_crashes_on_a_second_backward():
    """For the record (why the guard exists): Paddle's own reentrant recompute dies on
    ``backward(retain_graph=True); backward()`` (SIGSEGV on 3.3.1 and 2.6.2).  If a Paddle
    release fixes it, this fails and tells us."""
    r = run_probe_script("reentrant_twice_probe.py", "native", "retain_then_backward")
    assert r.returncode != 0 and "RESULT " not in r.stdout, (r.returncode, r.stdout[-2000:])


# -------------------------------------------- inputs needing no grad, outputs that are inputs
def _frozen_input_run(mode, impl, mix, fused, micro=2, frozen=()):
    """Two micro-steps of a Sequential fed by data (stop_gradient=True), as LoRA behind
    frozen embeddings; returns per-parameter (.grad, main_grad) as numpy or None."""
    paddle_mgrad.disable()
    if impl == "enabled" or fused:
        paddle_mgrad.enable(recompute=True, fused_linear=fused)
    paddle.seed(5)
    m = paddle.nn.Sequential(
        nonzero_biases(paddle.nn.Linear(8, 16)),
        paddle.nn.GELU(),
        nonzero_biases(paddle.nn.Linear(16, 8)),
    )
    for name, p in m.named_parameters():
        p.stop_gradient = name in frozen
    if mix:
        MixPrecisionLayer(m, dtype="float16")
    rs = np.random.RandomState(11)
    outs = []
    for _ in range(micro):
        x = paddle.to_tensor(rs.standard_normal([4, 8]).astype("float32"))  # needs no grad
        if mode == "none":
            y = m(x)
        elif impl == "ours":
            y = paddle_mgrad.recompute(m, x, use_reentrant=(mode == "reentrant"))
        else:
            y = native_recompute(m, x, use_reentrant=(mode == "reentrant"))
        outs.append((y.stop_gradient, y.numpy()))
        y.pow(2).mean().backward()
    got = {}
    for name, p in m.named_parameters():
        mg = getattr(p, "main_grad", None)
        got[name] = (None if p.grad is None else p.grad.numpy(), None if mg is None else mg.numpy())
    paddle_mgrad.disable()
    return outs, got


def _assert_same_grads(got, ref):
    assert got.keys() == ref.keys()
    for name in ref:
        for kind, g, r in zip((".grad", "main_grad"), got[name], ref[name]):
            assert (g is None) == (r is None), (
                f"{name}{kind}: {g is None=} vs reference {r is None=}"
            )
            if r is not None:
                np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=f"{name}{kind}")


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("mix", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("impl", ["ours", "enabled"])
def test_reentrant_inputs_need_no_grad_params_still_get_gradients(impl, mix, fused):
    """Every input stop_gradient=True, use_reentrant=True: a reentrant PyLayer would give the
    block's own parameters no .grad / main_grad at all, silently (fused or plain linear)."""
    ref_outs, ref = _frozen_input_run("none", "ours", mix, fused)
    assert all(pair[1 if mix else 0] is not None for pair in ref.values())
    outs, got = _frozen_input_run("reentrant", impl, mix, fused)
    _assert_same_grads(got, ref)
    for (sg, y), (rsg, ry) in zip(outs, ref_outs):
        assert sg == rsg is False
        np.testing.assert_allclose(y, ry, rtol=1e-6, atol=1e-6)


def test_plain_paddle_reentrant_drops_gradients_of_a_block_with_frozen_inputs():
    """What the fix is about: Paddle's own reentrant recompute leaves them None."""
    _, got = _frozen_input_run("reentrant", "native", mix=False, fused=False)
    assert all(g is None and mg is None for g, mg in got.values()), "Paddle fixed it"


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_frozen_inputs_some_params_frozen(mode):
    frozen = ("0.weight", "2.bias")
    _, ref = _frozen_input_run("none", "ours", True, True, frozen=frozen)
    _, got = _frozen_input_run(mode, "ours", True, True, frozen=frozen)
    _assert_same_grads(got, ref)
    assert got["0.weight"] == (None, None)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_block_with_nothing_to_train_runs_without_error_or_recomputation(use_reentrant):
    """Inputs and parameters all frozen: no error, outputs stop_gradient as without
    recompute, and backward never recomputes the block."""
    frozen = ("0.weight", "0.bias", "2.weight", "2.bias")
    stats.reset()
    for fused in (False, True):
        outs, got = _frozen_input_run(
            "reentrant" if use_reentrant else "non_reentrant", "ours", True, fused, frozen=frozen
        )
        ref_outs, _ = _frozen_input_run("none", "ours", True, fused, frozen=frozen)
        assert all(g == (None, None) for g in got.values())
        for (sg, y), (rsg, ry) in zip(outs, ref_outs):
            assert sg is True and rsg is True
            np.testing.assert_allclose(y, ry, rtol=1e-6, atol=1e-6)
    assert stats.recompute["recomputations"] == 0


def test_reentrant_with_frozen_inputs_and_trainable_parameter_argument():
    """The parameter-argument anchor path (a trainable parameter passed in) together with
    parameters read from self: both get their gradient once."""
    paddle.seed(3)
    lin = nonzero_biases(paddle.nn.Linear(4, 4))
    w = paddle.create_parameter([4, 4], "float32")
    x = paddle.randn([2, 4])

    def f(h, weight):
        return paddle.matmul(lin(h), weight)

    f(x, w).sum().backward()
    ref = [p.grad.numpy().copy() for p in (lin.weight, lin.bias, w)]
    for p in (lin.weight, lin.bias, w):
        p.clear_gradient(False)
    paddle_mgrad.recompute(f, x, w, use_reentrant=True).sum().backward()
    for p, r in zip((lin.weight, lin.bias, w), ref):
        np.testing.assert_allclose(p.grad.numpy(), r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("used", ["both", "out_only"])
@pytest.mark.parametrize("mix", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_reentrant_block_returning_its_non_leaf_input(fused, mix, used):
    """A reentrant block returning its own non-leaf input beside a (fused) linear's output:
    handed to Paddle 2.6.2's PyLayer as it is, backward fails with "SystemError: (Fatal)
    Unable to find next node in the GradTensorHolder"."""

    def run(recomputed):
        paddle_mgrad.disable()
        paddle_mgrad.enable(recompute=True, fused_linear=fused)
        paddle.seed(8)
        lin = nonzero_biases(paddle.nn.Linear(4, 4))
        if mix:
            MixPrecisionLayer(lin, dtype="float16")
        x = paddle.randn([2, 4])
        x.stop_gradient = False
        f = lambda h: (lin(h), h)  # noqa: E731
        h = x * 1.0
        out, same = (
            paddle_mgrad.recompute(f, h, use_reentrant=True, preserve_rng_state=False)
            if recomputed
            else f(h)
        )
        loss = out.sum() + (same * same).sum() if used == "both" else out.sum()
        loss.backward()
        gw = lin.weight.main_grad if mix else lin.weight.grad
        res = (x.grad.numpy(), gw.numpy(), out.numpy(), same.numpy())
        paddle_mgrad.disable()
        return res

    for g, r in zip(run(True), run(False)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------- found by the differential fuzzer
def _ref_and_ours(build, use_reentrant=True):
    """``build(rc)`` -> (loss-able outputs, tensors whose grads to compare); no recompute vs ours."""
    res = []
    for rc in (
        lambda f, *a, **k: f(*a, **k),
        lambda f, *a, **k: paddle_mgrad.recompute(f, *a, use_reentrant=use_reentrant, **k),
    ):
        paddle.seed(4)
        outs, watch = build(rc)
        loss = sum((o * (i + 1)).sum() for i, o in enumerate(outs) if not o.stop_gradient)
        loss.backward()
        res.append(
            (
                [o.numpy() for o in outs],
                [o.stop_gradient for o in outs],
                [None if t.grad is None else t.grad.numpy() for t in watch],
            )
        )
    return res


def _assert_equal_runs(ref, got):
    (ro, rs, rg), (go, gs, gg) = ref, got
    for a, b in zip(ro + rg, go + gg):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
    return rs, gs


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_block_returning_its_leaf_input_that_needs_grad(use_reentrant):
    """Reentrant: Paddle's PyLayer took the returned input for an in-place result and
    raised "Leaf Var ... that doesn't stop gradient can't use inplace strategy" (plain
    Paddle's reentrant recompute too); now the same as without recompute."""

    def build(rc):
        lin = nonzero_biases(paddle.nn.Linear(4, 4))
        x = paddle.randn([2, 4])
        x.stop_gradient = False
        out, same = rc(lambda h: (lin(h), h), x)
        return [out, same], [x, lin.weight]

    ref, got = _ref_and_ours(build, use_reentrant)
    _assert_equal_runs(ref, got)


def test_plain_paddle_reentrant_refuses_to_return_a_leaf_input():
    lin = nonzero_biases(paddle.nn.Linear(4, 4))
    x = paddle.randn([2, 4])
    x.stop_gradient = False
    with pytest.raises(ValueError, match="inplace"):
        native_recompute(lambda h: (lin(h), h), x)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_block_returning_an_input_that_needs_no_grad_keeps_it_stop_gradient(use_reentrant):
    """A mask passed through a reentrant block came back differentiable; it stays
    stop_gradient=True, as without recompute."""

    def build(rc):
        lin = nonzero_biases(paddle.nn.Linear(4, 4))
        x = paddle.randn([2, 4])
        x.stop_gradient = False
        mask = paddle.ones([2, 4])
        out, m = rc(lambda h, k: (lin(h) * k, k), x, mask)
        return [out, m], [x, lin.weight]

    ref, got = _ref_and_ours(build, use_reentrant)
    rs, gs = _assert_equal_runs(ref, got)
    assert rs == gs == [False, True]


@pytest.mark.parametrize("inputs_need_grad", [True, False])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_block_returning_a_dict(use_reentrant, inputs_need_grad):
    """Reentrant: plain Paddle's PyLayer refuses a dict ("At least one output of
    `PyLayer.forward` is a `Tensor`"); ours returns the same dict as no recompute."""

    def build(rc):
        lin = nonzero_biases(paddle.nn.Linear(4, 4))
        x = paddle.randn([2, 4])
        x.stop_gradient = not inputs_need_grad
        out = rc(lambda h: {"y": lin(h), "z": paddle.tanh(h) * 2.0}, x)
        assert isinstance(out, dict) and list(out) == ["y", "z"]
        return [out["y"], out["z"]], [x, lin.weight, lin.bias]

    ref, got = _ref_and_ours(build, use_reentrant)
    _assert_equal_runs(ref, got)


def test_reentrant_block_output_made_under_no_grad():
    """An output computed under paddle.no_grad() inside the block (the input needs a
    gradient, the output does not depend on it differentiably): backward raised
    RuntimeError "none of the recomputed outputs needs a gradient"; now, as without
    recompute, no gradient flows from it and the rest is right."""

    def build(rc):
        lin = nonzero_biases(paddle.nn.Linear(4, 4))
        x = paddle.randn([2, 4])
        x.stop_gradient = False

        def f(h):
            with paddle.no_grad():
                c = lin(h)
            return c, lin(h)

        c, y = rc(f, x)
        return [c, y], [x, lin.weight]

    ref, got = _ref_and_ours(build, True)
    _assert_equal_runs(ref, got)
    # the no_grad output alone: a loss of it alone gives nothing (and no error)
    lin = nonzero_biases(paddle.nn.Linear(4, 4))
    x = paddle.randn([2, 4])
    x.stop_gradient = False

    def g(h):
        with paddle.no_grad():
            return lin(h) * 1.0

    out = paddle_mgrad.recompute(g, x)
    if not out.stop_gradient:
        out.sum().backward()
    assert x.grad is None or not np.any(x.grad.numpy())
    assert lin.weight.grad is None


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_views_of_the_argument_and_of_activations(use_reentrant):
    """A block of strided views (Paddle 3.x: a transpose or a slice shares its input's buffer
    with other strides or an offset) -- of its argument and of an activation: what Paddle saves
    of them comes back as views as well, and the gradients equal those without recompute."""
    paddle.seed(1)
    w = paddle.create_parameter([3, 5], "float32")
    data = paddle.randn([4, 3]).numpy()

    def block(h):
        u = paddle.tanh(h.transpose([1, 0]))[:, 1:]
        return paddle.matmul(u.transpose([1, 0]), w)

    def run(recompute):
        x = paddle.to_tensor(data)
        x.stop_gradient = False
        h = x * 1.0
        y = paddle_mgrad.recompute(block, h, use_reentrant=use_reentrant) if recompute else block(h)
        (y * y).sum().backward()
        grads = x.grad.numpy(), w.grad.numpy()
        w.clear_gradient()
        return grads

    for got, want in zip(run(True), run(False)):
        np.testing.assert_array_equal(got, want)
