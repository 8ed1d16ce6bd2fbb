"""The ``save:<pattern>`` recompute policy (:mod:`paddle_mgrad.recomputation.saved_sublayers`):
the matched sublayers of a block run once, their saved tensors and outputs kept from the
forward, and the recomputation skips them.  Every output, input gradient, ``.grad`` and
``main_grad`` must be bit-identical to the same model without recompute -- with dropout in and
after a kept sublayer (the random state jumps over it), in-place ops on a kept sublayer's output
or on its input (each kind of :data:`in_place_ops.IN_PLACE`), in both modes, over two
micro-steps (``main_grad`` None, then accumulated) -- and the recomputation must not run a kept
sublayer."""

import collections
import functools
import os
import threading
import time
import warnings

import numpy as np
import paddle
import policy_runs
import pytest
from decoder import MLP, ROWS, D, Decoder, F, custom_forward
from in_place_ops import IN_PLACE
from paddle.distributed.fleet.utils import recompute as paddles_recompute
from policy_runs import assert_identical

import paddle_mgrad
from helpers import PADDLE2, nonzero_biases
from paddle_mgrad import EnvError, RecomputeError, stats
from paddle_mgrad.recomputation import policy as policy_mod, saved_sublayers

MODES = ("reentrant", "non_reentrant")
PADDLE2_REFUSAL = "On Paddle 2.6 non-reentrant recompute needs saved-tensor hooks"


def train(how, policy=None, after=None, inside=None, micro=2, call=custom_forward):
    """``micro`` micro-steps of a :class:`Decoder` with recompute ``how`` ("none" or a mode)
    under ``policy`` (:func:`policy_runs.train`); ``call(net)`` is what recompute runs."""
    return policy_runs.train(
        lambda: Decoder(IN_PLACE.get(after), IN_PLACE.get(inside)),
        how,
        policy,
        micro,
        block=call,
        rows=ROWS,
        d=D,
    )


def no_wrapper_left(net):
    return [
        name for name, layer in [("", net), *net.named_sublayers()] if "forward" in layer.__dict__
    ]


POLICIES = (
    "save:*MLP",
    "save:self_attn",
    "save:mlp,self_attn",
    "save:self_attn.q_proj",
    "save:*Norm",
    "save:Decoder",
    "save:nothing_matches",
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_save_policy_equals_no_recompute(mode, policy):
    assert_identical(train(mode, policy), train("none"))


@pytest.mark.parametrize("op", sorted(IN_PLACE))
@pytest.mark.parametrize("where", ["after", "inside"])
@pytest.mark.parametrize("mode", MODES)
def test_in_place_ops_on_a_kept_sublayers_output_or_input(mode, where, op):
    """``after``: the MLP's output changed in place once it returned (the held alias shares
    the change: the MLP is replayed); ``inside``: the MLP changes its own input in place (the
    ops after it would see another value: replayed)."""
    kw = {where: op}
    assert_identical(train(mode, "save:mlp", **kw), train("none", **kw))


class _Counting:
    """Counts the forward calls of the sublayers of ``net`` by name, through their classes
    (so the policy's wrapper on the instance still runs the original)."""

    def __init__(self, monkeypatch, net):
        self.calls = []
        for layer in net.sublayers():
            cls = type(layer)
            if getattr(cls, "_counted", False):
                continue
            real = cls.forward

            def counted(this, *a, _real=real, **k):
                self.calls.append(self.names.get(id(this)))
                return _real(this, *a, **k)

            monkeypatch.setattr(cls, "forward", counted)
            monkeypatch.setattr(cls, "_counted", True, raising=False)
        self.names = {id(layer): name for name, layer in net.named_sublayers()}


@pytest.mark.parametrize(
    "policy, replayed, kept",
    [
        (
            "full",
            [
                "input_layernorm",
                "self_attn",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.dropout",
                "self_attn.o_proj",
                "dropout",
                "post_attention_layernorm",
                "mlp",
                "mlp.gate",
                "mlp.up",
                "mlp.down",
            ],
            None,
        ),
        (
            "save:mlp",
            [
                "input_layernorm",
                "self_attn",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.dropout",
                "self_attn.o_proj",
                "dropout",
                "post_attention_layernorm",
            ],
            ["mlp"],
        ),
        (
            "save:self_attn,*Norm",
            ["dropout", "mlp", "mlp.gate", "mlp.up", "mlp.down"],
            ["input_layernorm", "self_attn", "post_attention_layernorm"],
        ),
        ("save:Decoder", [], [""]),  # the block's own Layer: never recomputed
    ],
)
def test_what_the_recomputation_runs(monkeypatch, policy, replayed, kept):
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(11)
        net = Decoder()
        counting = _Counting(monkeypatch, net)
        h = paddle.randn([ROWS, D])
        h.stop_gradient = False
        out = paddle_mgrad.recompute(custom_forward(net), h, use_reentrant=False, policy=policy)
        counting.calls.clear()  # (the forward's own calls)
        out.sum().backward()
    finally:
        paddle_mgrad.disable()
    assert counting.calls == replayed
    assert no_wrapper_left(net) == []
    counters = stats.snapshot()["policy"].get(policy)
    if kept is None:
        assert counters is None
        return
    assert counters["calls"] == 1 and counters["sublayers_kept"] == len(kept)
    assert counters["replays"] == (0 if kept == [""] else 1)
    assert counters["sublayers_not_recomputed"] == (0 if kept == [""] else len(kept))
    assert counters["kept_bytes"] > 0
    assert counters["gemms_not_recomputed"] == counters["kept_outputs"] == 0
    assert counters["gemm_flops_not_recomputed"] == 0


def test_kept_bytes_are_the_saved_tensors_and_outputs_of_the_kept_sublayer():
    """``save:mlp.down`` keeps what ``down``'s linear saves (its input [ROWS, F]; the weight
    is a parameter, kept anyway at no cost) and its output [ROWS, D], fp32."""
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(11)
        net = Decoder()
        h = paddle.randn([ROWS, D])
        h.stop_gradient = False
        paddle_mgrad.recompute(net, h, use_reentrant=False, policy="save:mlp.down").sum().backward()
    finally:
        paddle_mgrad.disable()
    counters = stats.snapshot()["policy"]["save:mlp.down"]
    assert counters["kept_bytes"] == 4 * (ROWS * F + ROWS * D)
    assert counters["sublayers_not_recomputed"] == 1


def test_kept_bytes_of_a_sublayer_that_saves_several_tensors():
    """``save:mlp``, each buffer once: gate's and up's linears save their input [ROWS, D] (one
    buffer), silu its input (gate's output) and output [ROWS, F], the multiply silu's output and
    up's output [ROWS, F], down its input [ROWS, F]; and the output [ROWS, D]: 2 D + 4 F floats
    per row (3 D + 5 F summed over what was saved)."""
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(11)
        net = Decoder()
        h = paddle.randn([ROWS, D])
        h.stop_gradient = False
        paddle_mgrad.recompute(net, h, use_reentrant=False, policy="save:mlp").sum().backward()
    finally:
        paddle_mgrad.disable()
    assert stats.snapshot()["policy"]["save:mlp"]["kept_bytes"] == 4 * ROWS * (2 * D + 4 * F)


@pytest.mark.parametrize("how", ["layer", "bound_method", "closure", "partial", "argument", "list"])
def test_the_blocks_layer_is_found_however_the_block_is_passed(monkeypatch, how):
    paddle.seed(11)
    net = Decoder()

    def through_argument(layer, h):
        return layer(h)

    function, args = {
        "layer": (net, ()),
        "bound_method": (net.forward, ()),
        "closure": (custom_forward(net), ()),
        "partial": (functools.partial(lambda layer, h: layer(h), net), ()),
        "argument": (through_argument, (net,)),
        "list": (run_layers([net]), ()),  # fleet's pipeline: a closure over its layers
    }[how]
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        h = paddle.randn([ROWS, D])
        h.stop_gradient = False
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a block whose Layer is not found warns
            out = paddle_mgrad.recompute(function, *args, h, use_reentrant=False, policy="save:mlp")
        out.sum().backward()
    finally:
        paddle_mgrad.disable()
    assert stats.snapshot()["policy"]["save:mlp"]["sublayers_not_recomputed"] == 1


def run_layers(layers):
    def execute(h):
        for layer in layers:
            h = layer(h)
        return h

    return execute


def test_a_pipeline_segment_is_its_slice_of_the_stages_layers():
    """Fleet's pipeline recomputes a segment of a stage: a closure over the stage's whole layer
    list and the segment's bounds (Paddle's own ``PipelineLayer.forward_function``).  Its
    Layers are the segment's, not the stage's first ones (which a budget would plan for)."""
    import types

    from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import PipelineLayer

    paddle.seed(11)
    stage = [
        nonzero_biases(paddle.nn.Linear(D, D)),
        Decoder(),
        nonzero_biases(paddle.nn.Linear(D, D)),
    ]
    segment = PipelineLayer.forward_function(types.SimpleNamespace(run_function=stage), 1, 2)
    assert saved_sublayers.block_layers(segment, (), {}) == [stage[1]]
    assert saved_sublayers.block_layers(run_layers(stage), (), {}) == stage  # (no bounds)


def test_patterns_match_class_names_and_paths_outermost_first():
    paddle.seed(11)
    net = Decoder()

    def names(*patterns):
        layers = saved_sublayers.matching(patterns, net, (), {})
        found = {id(layer): name for name, layer in [("", net), *net.named_sublayers()]}
        return [found[id(layer)] for layer in layers]

    assert names("*Norm") == ["input_layernorm", "post_attention_layernorm"]
    assert names("mlp") == ["mlp"]
    assert names("MLP") == ["mlp"]
    assert names("mlp", "mlp.gate") == ["mlp"]  # gate runs inside mlp
    assert names("mlp.*") == ["mlp.gate", "mlp.up", "mlp.down"]
    assert names("gate") == names("mlp.gate") == ["mlp.gate"]  # a path's ending matches too
    with pytest.warns(RuntimeWarning):
        assert names("lp.gate") == []  # (whole components only)
    assert names("*proj") == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj"]
    assert names("Decoder", "mlp") == [""]  # the whole block
    assert names("*") == [""]
    with pytest.warns(
        RuntimeWarning,
        match=r"save:nope matches no sublayer of the block "
        r"Decoder: it is recomputed whole",
    ):
        assert names("nope") == []
    with pytest.warns(RuntimeWarning, match=r"save:decoder matches no sublayer"):
        assert names("decoder") == []  # (the block's own Layer matches by class name only)


def test_a_saved_tensor_changed_after_the_forward_raises_as_without_recompute():
    """``tanh`` saves its output; the kept sublayer returns it and the caller changes it in
    place.  Without recompute Paddle refuses the backward; a kept sublayer must not hand the
    changed value to its tanh's backward."""

    class Tanh(paddle.nn.Layer):
        def forward(self, h):
            return paddle.tanh(h)

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.lin = nonzero_biases(paddle.nn.Linear(D, D))
            self.act = Tanh()

        def forward(self, h):
            y = self.act(self.lin(h))
            y.scale_(2.0)
            return y * h

    paddle.seed(11)
    net = Block()
    h = paddle.randn([ROWS, D])
    h.stop_gradient = False
    with pytest.raises(Exception, match="modified by an inplace operation"):
        net(h).sum().backward()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        for mode in MODES:
            out = paddle_mgrad.recompute(
                net, h, use_reentrant=mode == "reentrant", policy="save:act"
            )
            with pytest.raises(
                RecomputeError,
                match=(
                    r"^recompute\(Block\): saved tensor #\d+ Tensor\(name='[^']*', "
                    rf"shape=\[{ROWS}, {D}\], dtype=paddle.float32\), kept from the forward by "
                    r"the recompute policy 'save:act', has been modified by an inplace "
                    r"operation after the forward saved it: its inplace version is 1, the "
                    r"forward saved version 0; its gradient would be wrong \(without recompute "
                    r"Paddle refuses this too\)\. Compute that change out of place\.$"
                ),
            ):
                out.sum().backward()
            assert paddle.is_grad_enabled()
            # and the next step is clean: without the in-place change it trains
            assert no_wrapper_left(net) == []
    finally:
        paddle_mgrad.disable()


@pytest.mark.parametrize("mode", MODES)
def test_an_error_in_a_kept_sublayer_leaves_nothing_behind(mode):
    paddle.seed(11)
    net = Decoder()
    net.eval()  # (no dropout: the plain run below compares without replaying the RNG)
    fail = {"now": True}
    real = MLP.forward

    def failing(this, h):
        if fail["now"]:
            raise ValueError("user code failed")
        return real(this, h)

    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        net.mlp.forward = failing.__get__(net.mlp)  # the user's own instance forward
        h = paddle.randn([ROWS, D])
        h.stop_gradient = False
        with pytest.raises(ValueError, match="user code failed"):
            paddle_mgrad.recompute(net, h, use_reentrant=mode == "reentrant", policy="save:mlp")
        # the instance is as the user left it, and the next step trains
        assert no_wrapper_left(net) == ["mlp"] and net.mlp.__dict__["forward"].__func__ is failing
        fail["now"] = False
        stats.reset()
        out = paddle_mgrad.recompute(net, h, use_reentrant=mode == "reentrant", policy="save:mlp")
        out.sum().backward()
        assert stats.snapshot()["policy"]["save:mlp"]["sublayers_not_recomputed"] == 1
        assert net.mlp.__dict__["forward"].__func__ is failing
    finally:
        paddle_mgrad.disable()
    g = h.grad.numpy()
    h2 = paddle.to_tensor(h.numpy())
    h2.stop_gradient = False
    net(h2).sum().backward()
    np.testing.assert_array_equal(g, h2.grad.numpy())


@pytest.mark.parametrize("mode", MODES)
def test_backward_twice_and_paddle_grad(monkeypatch, mode):
    """``paddle.grad`` replays the block (a copy of the graph), then ``backward`` replays it
    again: each replay skips the kept sublayer (none runs attention again) and jumps the random
    state over it."""
    stats.reset()
    x = paddle.randn([ROWS, D])
    x.stop_gradient = False
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(11)
        net = Decoder()
        counting = _Counting(monkeypatch, net)
        out = paddle_mgrad.recompute(
            custom_forward(net), x * 1.0, use_reentrant=mode == "reentrant", policy="save:self_attn"
        )
        counting.calls.clear()
        (g1,) = paddle.grad([out.sum()], [x], retain_graph=True)
        (g2,) = paddle.grad([out.sum()], [x], retain_graph=True)
        out.sum().backward()
        assert counting.calls.count("mlp") == 3 and "self_attn" not in counting.calls
        monkeypatch.undo()
        paddle.seed(11)  # the same model without recompute (the same fused linear)
        plain = Decoder()
        xp = paddle.to_tensor(x.numpy())
        xp.stop_gradient = False
        o = plain(xp * 1.0)
        o.sum().backward()
    finally:
        paddle_mgrad.disable()
    np.testing.assert_array_equal(o.numpy(), out.numpy())
    for g in (g1, g2, x.grad):
        np.testing.assert_array_equal(g.numpy(), xp.grad.numpy())
    for p, q in zip(net.parameters(), plain.parameters()):
        np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
    counters = stats.snapshot()["policy"]["save:self_attn"]
    assert (counters["replays"], counters["sublayers_not_recomputed"]) == (3, 3)


def test_the_environment_reaches_paddles_own_recompute(monkeypatch):
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", " save: *MLP , self_attn ")
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(11)
        net = Decoder()
        for use_reentrant in (False, True):
            h = paddle.randn([ROWS, D])
            h.stop_gradient = False
            paddles_recompute(
                custom_forward(net), h * 1.0, use_reentrant=use_reentrant
            ).sum().backward()
    finally:
        paddle_mgrad.disable()
    counters = stats.snapshot()["policy"]["save:*MLP,self_attn"]
    assert (counters["calls"], counters["sublayers_not_recomputed"]) == (2, 4)


def test_bad_save_policies_are_named(monkeypatch):
    for bad in ("save:", "save: ,mlp", "save:mlp,"):
        with pytest.raises(
            ValueError,
            match=r"save: takes one or more comma-separated "
            r"patterns",
        ):
            policy_mod.resolve(bad)
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", "save:")
    with pytest.raises(EnvError, match=r"PADDLE_MGRAD_RECOMPUTE_POLICY='save:'.*save:<pattern>"):
        policy_mod.resolve()
    # case is kept in the patterns (class names), ignored in the prefix
    assert policy_mod.resolve("SAVE:*MLP").patterns == ("*MLP",)


def test_determinism_check_covers_what_is_recomputed():
    """A block whose recomputed part draws other values (an unseeded global change) is still
    caught with determinism_check="values" while a kept sublayer is skipped."""
    state = {"bias": 0.0}

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()
            self.lin = nonzero_biases(paddle.nn.Linear(D, D))

        def forward(self, h):
            m = self.mlp(h)
            return paddle.tanh(self.lin(m) + state["bias"])

    paddle.seed(11)
    net = Block()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        h = paddle.randn([ROWS, D])
        h.stop_gradient = False
        out = paddle_mgrad.recompute(
            net, h, use_reentrant=False, policy="save:mlp", determinism_check="values"
        )
        state["bias"] = 1.0
        with pytest.raises(RecomputeError, match="different values"):
            out.sum().backward()
    finally:
        paddle_mgrad.disable()


def test_threads_share_a_model_under_a_save_policy():
    """Two threads train the same layer concurrently; the wrapper answers each thread's own
    block, and the last one out leaves the instance as it was."""
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(11)
        net = Decoder()
        net.eval()  # (no dropout: the threads' random draws would interleave)
        inputs = [paddle.randn([ROWS, D]) for _ in range(4)]
        expected = []
        for x in inputs:
            h = paddle.to_tensor(x.numpy())
            h.stop_gradient = False
            (net(h) * 3).sum().backward()
            expected.append(h.grad.numpy())
        got, errors = {}, []
        barrier = threading.Barrier(2)

        def work(k):
            try:
                barrier.wait()
                for i in range(k, len(inputs), 2):
                    for _ in range(3):
                        h = paddle.to_tensor(inputs[i].numpy())
                        h.stop_gradient = False
                        out = paddle_mgrad.recompute(
                            custom_forward(net), h, use_reentrant=False, policy="save:mlp"
                        )
                        (out * 3).sum().backward()
                        got.setdefault(i, []).append(h.grad.numpy())
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        paddle_mgrad.disable()
    # (Paddle 2.6's saved-tensor hooks are process-wide: a second thread's non-reentrant
    # recompute is refused there, test_recompute_threads.py; what ran must be right)
    assert all(
        PADDLE2 and isinstance(e, RecomputeError) and PADDLE2_REFUSAL in str(e) for e in errors
    ), errors
    assert got
    for i, grads in got.items():
        for g in grads:
            np.testing.assert_array_equal(g, expected[i])
    assert no_wrapper_left(net) == []


def test_nested_blocks_keep_the_same_sublayer():
    """The inner block and the outer one both keep the MLP (``save:*MLP``): its wrapper is
    installed twice, and the inner block's end must leave the outer one's in place (the outer
    block calls the MLP again after it)."""

    class Outer(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.inner = Decoder()

        def forward(self, h):
            h = paddle_mgrad.recompute(
                custom_forward(self.inner), h, use_reentrant=False, policy="save:*MLP"
            )
            return self.inner.mlp(h)

    x = paddle.randn([ROWS, D])
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(11)
        net = Outer()
        h = paddle.to_tensor(x.numpy())
        h.stop_gradient = False
        out = paddle_mgrad.recompute(
            custom_forward(net), h * 1.0, use_reentrant=False, policy="save:*MLP"
        )
        out.sum().backward()
        counters = stats.snapshot()["policy"]["save:*MLP"]
        paddle.seed(11)  # the same model without recompute (the same fused linear)
        plain = Outer()
        hp = paddle.to_tensor(x.numpy())
        hp.stop_gradient = False
        o = plain.inner.mlp(plain.inner(hp * 1.0))
        o.sum().backward()
    finally:
        paddle_mgrad.disable()
    np.testing.assert_array_equal(o.numpy(), out.numpy())
    np.testing.assert_array_equal(h.grad.numpy(), hp.grad.numpy())
    for p, q in zip(net.parameters(), plain.parameters()):
        np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
    # the outer block (its MLP call kept) and the inner one (its MLP kept); the outer block
    # saved nothing outside its MLP (the inner block saves to its own hooks): never replayed;
    # the inner block's replay skips its MLP
    assert (counters["calls"], counters["sublayers_kept"]) == (2, 2), counters
    assert (counters["replays"], counters["sublayers_not_recomputed"]) == (1, 1), counters
    assert no_wrapper_left(net) == []


def test_a_kept_sublayer_calls_another_kept_one():
    """``rope`` is no sublayer of ``attn`` but runs inside it (handed as an argument, as models
    share a rotary embedding) and after it: inside ``attn`` it is part of ``attn``'s call, so
    the replay skips both calls."""

    class Rope(paddle.nn.Layer):
        def forward(self, h):
            return paddle.tanh(h) * 0.5

    class Attn(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.proj = nonzero_biases(paddle.nn.Linear(D, D))

        def forward(self, h, rope):
            return self.proj(rope(h))

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.attn = Attn()
            self.rope = Rope()
            self.out = nonzero_biases(paddle.nn.Linear(D, D))

        def forward(self, h):
            return self.out(paddle.tanh(self.rope(self.attn(h, self.rope))))

    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(11)
        net = Block()
        x = paddle.randn([ROWS, D])
        h = paddle.to_tensor(x.numpy())
        h.stop_gradient = False
        paddle_mgrad.recompute(
            net, h, use_reentrant=False, policy="save:attn,rope"
        ).sum().backward()
        hp = paddle.to_tensor(x.numpy())
        hp.stop_gradient = False
        net(hp).sum().backward()
    finally:
        paddle_mgrad.disable()
    np.testing.assert_array_equal(h.grad.numpy(), hp.grad.numpy())
    counters = stats.snapshot()["policy"]["save:attn,rope"]
    assert (counters["sublayers_kept"], counters["sublayers_not_recomputed"]) == (2, 2)


@pytest.mark.parametrize("op", sorted(IN_PLACE))
@pytest.mark.parametrize("mode", MODES)
def test_a_sublayer_that_changes_its_input_is_replayed(mode, op):
    """The MLP changes its input in place, and the block uses that input after it (saved by
    the multiply): skipping the MLP in the replay would hand the multiply the unchanged
    input."""

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.pre = nonzero_biases(paddle.nn.Linear(D, D))
            self.mlp = MLP(IN_PLACE[op])

        def forward(self, h):
            h = self.pre(h)
            return paddle.tanh(h * self.mlp(h))

    def run(policy):
        stats.reset()
        paddle_mgrad.enable(recompute=True, fused_linear=True)
        try:
            paddle.seed(11)
            net = Block()
            h = paddle.to_tensor(
                np.random.RandomState(3).standard_normal([ROWS, D]).astype("float32")
            )
            h.stop_gradient = False
            if policy is None:
                out = net(h)
            else:
                out = paddle_mgrad.recompute(
                    net, h, use_reentrant=mode == "reentrant", policy=policy
                )
            out.sum().backward()
            return [out.numpy(), h.grad.numpy()] + [p.grad.numpy() for p in net.parameters()]
        finally:
            paddle_mgrad.disable()

    for got, want in zip(run("save:mlp"), run(None)):
        np.testing.assert_array_equal(got, want)
    counters = stats.snapshot()["policy"]
    assert counters == {}  # (the reference run)


# -- what a kept sublayer takes and returns, how the block's Layer is found, nesting ---------


class Inner(paddle.nn.Layer):
    def forward(self, h, *, factor):
        return h * factor


class Part(paddle.nn.Layer):
    """A sublayer called with positional and keyword arguments, returning a structure: a
    tuple holding a tensor, None, a list and a dict of tensors, a named tuple, and a tensor
    that needs no gradient (a mask); it calls ``inner``, a sublayer of the block handed to it
    (as models share a rotary embedding), with a keyword."""

    Pair = collections.namedtuple("Pair", ["left", "right"])

    def __init__(self):
        super().__init__()
        self.proj = nonzero_biases(paddle.nn.Linear(D, D))

    def forward(self, h, gate, scale=1.0, *, shift=None, inner=None):
        y = inner(paddle.tanh(self.proj(h)), factor=0.5) * gate * scale + shift
        mask = (h > 0).astype("float32")
        pair = self.Pair(y * 3.0, h)
        return (y, None, [y * 2.0], {"z": paddle.nn.functional.silu(y)}), pair, mask


class Structured(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.part = Part()
        self.inner = Inner()
        self.out = nonzero_biases(paddle.nn.Linear(D, D))

    def forward(self, h):
        gate = paddle.nn.functional.sigmoid(h)
        (y, none, (y2,), d), pair, mask = self.part(h, gate, 0.5, shift=h * 0.25, inner=self.inner)
        assert none is None and mask.stop_gradient
        # (tanh of the mask: no node, nothing saved -- in the replay as in the forward)
        y = y + y2 + d["z"] + pair.left + pair.right * paddle.tanh(mask)
        return self.out(paddle.tanh(y))


@pytest.mark.parametrize("policy", ["save:part", "save:part,inner", "budget:1"])
@pytest.mark.parametrize("mode", MODES)
def test_a_kept_sublayer_with_keyword_arguments_and_structured_outputs(mode, policy, monkeypatch):
    """The kept call gets its keyword arguments; the replay hands back the same structure
    (tuple, list, dict, named tuple, None in it) with the forward's values."""
    if policy.startswith("budget:"):
        monkeypatch.setattr(policy_mod, "_NAMED", {})
        monkeypatch.setattr(stats, "plans", {})
        policy_runs.never_the_last_block(monkeypatch)  # (each step's one block)
    stats.reset()
    ref = policy_runs.train(Structured, "none", None, 4, rows=ROWS, d=D)
    got = policy_runs.train(Structured, mode, policy, 4, rows=ROWS, d=D)
    assert_identical(got, ref)
    counters = stats.snapshot()["policy"][policy]
    assert counters["sublayers_not_recomputed"] > 0, counters


def _decoder_run(block, policy="save:mlp", mode="non_reentrant"):
    """One step of a seeded :class:`Decoder` through ``block(net, rc)`` under recompute
    ``mode`` and ``policy`` and without recompute, bit for bit the same; ``rc(function, h,
    policy)`` is the recompute of a block nested in it (without recompute: a plain call).
    Returns the counters of every policy and the wrappers left on the recomputed model."""
    x = paddle.randn([ROWS, D])
    results = []
    stats.reset()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        for how in (mode, "none"):
            paddle.seed(11)
            net = Decoder()
            h = paddle.to_tensor(x.numpy())
            h.stop_gradient = False
            run = block(net, _inner_recompute if how != "none" else _no_recompute)
            if how == "none":
                out = run(h * 1.0)
            else:
                out = paddle_mgrad.recompute(
                    run, h * 1.0, use_reentrant=how == "reentrant", policy=policy
                )
            out.sum().backward()
            grads = [p.grad.numpy() for p in net.parameters() if p.grad is not None]
            results.append((out.numpy(), h.grad.numpy(), grads))
            if how != "none":
                counters = stats.snapshot()["policy"]
                left = no_wrapper_left(net)
    finally:
        paddle_mgrad.disable()
    (o, dh, g), (o_ref, dh_ref, g_ref) = results
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(dh, dh_ref)
    assert len(g) == len(g_ref)
    for a, b in zip(g, g_ref):
        np.testing.assert_array_equal(a, b)
    return counters, left


def _inner_recompute(function, h, policy):
    return paddle_mgrad.recompute(function, h, use_reentrant=False, policy=policy)


def _no_recompute(function, h, policy):
    return function(h)


def _nest(levels, net):
    """``net`` reached from the block through ``levels`` containers, innermost first: closures,
    partials or lists."""
    reach = net
    for kind in levels:
        if kind == "closure":
            reach = _closure_over(reach)
        elif kind == "partial":
            reach = functools.partial(_call, reach)
        else:
            reach = [reach]
    return reach


def _closure_over(inner):
    def run(h):
        return _call(inner, h)

    return run


def _call(f, h):
    return f[0](h) if isinstance(f, list) else f(h)


@pytest.mark.parametrize("kind", ["closure", "partial", "list"])
def test_the_blocks_layer_is_searched_two_containers_deep(kind):
    """The Layer is found one or two containers (closure, partial, list) away from the block
    function, not three: a block whose model lies deeper is recomputed whole (with a
    warning), as documented."""
    paddle.seed(11)
    net = Decoder()
    for depth in (1, 2):
        levels = [kind] * depth
        if kind == "list":  # (a list is reached through the closure over it)
            levels = ["list"] * (depth - 1) + ["closure"]
        assert saved_sublayers.block_layers(_nest(levels, net), (), {}) == [net], levels
    levels = [kind] * 3 if kind != "list" else ["list", "list", "closure"]
    assert saved_sublayers.block_layers(_nest(levels, net), (), {}) == [], levels
    # two closures around a partial around the Layer: three away
    deep = _nest(["partial", "closure", "closure"], net)
    assert saved_sublayers.block_layers(deep, (), {}) == []


def test_a_sublayer_found_from_two_roots_or_by_two_patterns_is_kept_once():
    paddle.seed(11)
    net = Decoder()
    block = custom_forward(net)
    assert saved_sublayers.matching(("mlp", "*MLP"), block, (net,), {}) == (net.mlp,)
    counters, left = _decoder_run(lambda n, rc: custom_forward(n), "save:mlp,*MLP")
    counters = counters["save:mlp,*MLP"]
    assert (counters["sublayers_kept"], counters["sublayers_not_recomputed"]) == (1, 1)
    assert left == []


def test_the_warning_for_a_pattern_that_matches_nothing_names_the_users_call(monkeypatch):
    """The warning points at the code that called recompute, through ours or through Paddle's
    own ``recompute`` (not at paddle_mgrad's or Paddle's frames)."""
    message = (
        r"recompute policy save:nothing,nowhere matches no sublayer of the block "
        r"custom_forward.<locals>.run: it is "
        r"recomputed whole \(patterns are compared with the class names and attribute paths "
        r"of the sublayers of the Layer the block runs\)"
    )
    paddle.seed(11)
    net = Decoder()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        h = paddle.randn([ROWS, D])
        h.stop_gradient = False
        with pytest.warns(RuntimeWarning, match=message) as ours:
            paddle_mgrad.recompute(
                custom_forward(net), h, use_reentrant=False, policy="save:nothing,nowhere"
            )
        monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", "save:nothing,nowhere")
        with pytest.warns(RuntimeWarning, match=message) as paddles:
            paddles_recompute(custom_forward(net), h, use_reentrant=False)
    finally:
        paddle_mgrad.disable()
    where = [w.filename for w in [*ours, *paddles]]
    if "MUTANT_UNDER_TEST" in os.environ:  # (under mutmut its trampolines' frames lie between)
        outside = (os.path.dirname(paddle_mgrad.__file__), os.path.dirname(paddle.__file__))
        assert not any(f.startswith(outside) for f in where), where
    else:
        assert where == [__file__, __file__]


def test_an_inner_block_keeping_more_sublayers_than_the_outer_one():
    """The outer block keeps the attention, the inner one (the decoder layer) the attention and
    the MLP: the attention's wrapper is already installed when the inner block installs its
    own, and still needed when the inner block ends; the MLP's is installed and removed by the
    inner block alone."""

    def outer(net, rc):
        def run(h):
            h = net.self_attn(h)
            return rc(custom_forward(net), h, "save:self_attn,mlp")

        return run

    counters, left = _decoder_run(outer, "save:self_attn")
    inner = counters["save:self_attn,mlp"]
    assert (inner["sublayers_kept"], inner["sublayers_not_recomputed"]) == (2, 2), inner
    assert counters["save:self_attn"]["sublayers_kept"] == 1, counters
    assert left == []


def test_a_full_block_inside_a_keeping_one_is_not_the_outer_blocks():
    """A full-recompute block inside a ``save:mlp`` block calls the MLP (with positional and
    keyword arguments): that call is the inner block's, recomputed with it, not a kept call
    of the outer block."""

    def outer(net, rc):
        def run(h):
            h = rc(lambda t: net.mlp(net.mlp(h=t)), h, "full")
            return net.mlp(paddle.tanh(h))

        return run

    counters, left = _decoder_run(outer, "save:mlp")
    kept = counters["save:mlp"]["sublayers_kept"]
    assert kept == 1, counters  # the outer block's own call only
    assert left == []


def test_a_sublayer_called_twice_is_timed_and_counted_for_both_calls(monkeypatch):
    """A measured candidate called twice in the block: its time is the sum of its calls (here
    each sleeps 10 ms), its bytes those of both calls."""

    class Slow(paddle.nn.Layer):
        def forward(self, h):
            time.sleep(0.01)
            return paddle.tanh(h)

    class Twice(paddle.nn.Layer):
        def __init__(self, calls):
            super().__init__()
            self.slow = Slow()
            self.out = nonzero_biases(paddle.nn.Linear(D, D))
            self.calls = calls

        def forward(self, h):
            for _ in range(self.calls):
                h = self.slow(h) * 1.5
            return self.out(h)

    monkeypatch.setattr(policy_mod, "_NAMED", {})
    monkeypatch.setattr(stats, "plans", {})
    measured = {}
    for calls in (1, 2):
        stats.plans.clear()
        policy_mod._NAMED.clear()
        make = functools.partial(Twice, calls)
        policy_runs.train(make, "non_reentrant", "budget:1", 4, rows=ROWS, d=D)  # (3 measured)
        (plan,) = stats.snapshot()["plans"]["budget:1"].values()
        measured[calls] = plan["measured"]["slow"]
    assert 0.01 <= measured[1]["seconds"] < 0.5, measured
    assert 0.02 <= measured[2]["seconds"] < 0.5, measured
    assert measured[2]["bytes"] == 2 * measured[1]["bytes"] > 0, measured


def test_a_kept_sublayer_run_again_in_the_replay_leaves_the_next_one_skipped():
    """``a`` (kept, with a kept sublayer ``b`` inside) has its output changed in place after it,
    so the replay runs it again, ``b`` with it as part of ``a``; ``c`` after it is still
    skipped."""

    class A(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.b = nonzero_biases(paddle.nn.Linear(D, D))

        def forward(self, h):
            return paddle.tanh(self.b(h)) * 1.5

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.a = A()
            self.c = nonzero_biases(paddle.nn.Linear(D, D))

        def forward(self, h):
            y = self.a(h)
            y.add_(paddle.ones_like(y))
            return self.c(paddle.tanh(y))

    stats.reset()
    ref = policy_runs.train(Block, "none", None, 2, rows=ROWS, d=D)
    got = policy_runs.train(Block, "non_reentrant", "save:a,b,c", 2, rows=ROWS, d=D)
    assert_identical(got, ref)
    counters = stats.snapshot()["policy"]["save:a,b,c"]
    # per micro-step: a and c kept in the forward (b runs inside a); c skipped in the replay
    assert (counters["sublayers_kept"], counters["sublayers_not_recomputed"]) == (4, 2), counters
