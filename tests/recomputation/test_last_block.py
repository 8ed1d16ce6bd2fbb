"""A step's last recompute block kept whole (:meth:`.non_reentrant._Frame.keep_whole`, chosen by
a ``budget:`` plan, :mod:`paddle_mgrad.recomputation.budget`).

Its backward comes right after the loss head: recomputed, it would be replayed only to be read.
Under a plan that keeps it, a block keeps what it saved until the thread starts another block
call; the step's last one reaches its backward with its values and is not recomputed.  Every
gradient stays bit-identical to no recompute; a block that turns out not to be the last one, or
whose saved output an op after it changed in place, is recomputed as under full recompute."""

import gc
import json

import numpy as np
import paddle
import pytest
from decoder import ROWS, D, Decoder, custom_forward
from policy_runs import always_the_last_block, assert_identical, train

import paddle_mgrad
from helpers import run_probe_script
from paddle_mgrad import stats
from paddle_mgrad.recomputation import budget, memory, non_reentrant, policy as policy_mod

MODES = ("reentrant", "non_reentrant")
LAYERS = 3
STEPS = 3  # the first step measures (its three calls, then a backward); the others are planned


@pytest.fixture
def fresh_plans(monkeypatch):
    monkeypatch.setattr(policy_mod, "_NAMED", {})
    monkeypatch.setattr(stats, "plans", {})
    stats.reset()


class _Squashed(Decoder):
    """A decoder layer whose output is saved by its last op (sigmoid saves its output)."""

    def forward(self, h):
        return paddle.nn.functional.sigmoid(super().forward(h))


class _Stack(paddle.nn.Layer):
    """``LAYERS`` decoder layers, each a recompute block of its own in ``mode`` (None: none) under
    ``policy``, as a model's layers are."""

    def __init__(self, mode, policy, layer=Decoder):
        super().__init__()
        self.layers = paddle.nn.LayerList([layer() for _ in range(LAYERS)])
        self.mode, self.policy = mode, policy

    def forward(self, h):
        for layer in self.layers:
            if self.mode is None:
                h = layer(h)
            else:
                h = paddle_mgrad.recompute(
                    custom_forward(layer),
                    h,
                    use_reentrant=self.mode == "reentrant",
                    policy=self.policy,
                )
        return h


def _run(mode, policy=None, steps=STEPS, layer=Decoder, after=None):
    return train(
        lambda: _Stack(mode, policy, layer), "none", None, steps, rows=ROWS, d=D, after=after
    )


@pytest.mark.parametrize("fraction", ["0", "0.5", "1"])
@pytest.mark.parametrize("mode", MODES)
def test_a_steps_last_block_is_not_recomputed(fresh_plans, monkeypatch, mode, fraction):
    """Bit-identical to no recompute; each step replays all blocks but its last (the measured
    step too: it keeps its last block whole to measure what that costs)."""
    always_the_last_block(monkeypatch)
    ref = _run(None)
    got = _run(mode, f"budget:{fraction}")
    assert_identical(got, ref)
    name = f"budget:{float(fraction):g}"
    counters = stats.snapshot()["policy"][name]
    assert stats.snapshot()["plans"][name]["Decoder"]["last_block"] is True
    assert counters["calls"] == LAYERS * STEPS
    assert counters["blocks_kept_whole"] == STEPS
    assert counters["replays"] == LAYERS * STEPS - STEPS


def _two_micro_batches(mode, policy, pipelined):
    """``STEPS`` steps of two forwards (micro-batches) each, then either one backward of both
    losses summed or, as a pipeline runs them, the first one's backward and then the second's;
    the losses and the parameters' gradients."""
    paddle.seed(5)
    net = _Stack(mode if policy else None, policy)
    xs = [paddle.randn([ROWS, D]) for _ in range(2)]
    out = []
    for _ in range(STEPS):
        losses = [(net(x) * (i + 1)).sum() for i, x in enumerate(xs)]
        for loss in losses if pipelined else [sum(losses)]:
            loss.backward()
            out.append(loss.numpy())
    return out + [p.grad.numpy() for p in net.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_a_block_followed_by_another_forward_is_recomputed(fresh_plans, monkeypatch, mode):
    """Two forwards, then one backward of both losses (two micro-batches summed): the first
    forward's last block stopped being the last when the second forward started -- it is
    recomputed; the second forward's last block is not."""
    always_the_last_block(monkeypatch)
    ref = _two_micro_batches(mode, None, pipelined=False)
    got = _two_micro_batches(mode, "budget:1", pipelined=False)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    counters = stats.snapshot()["policy"]["budget:1"]
    assert counters["blocks_kept_whole"] == STEPS  # (one per step, not two)
    assert counters["replays"] == 2 * LAYERS * STEPS - STEPS


@pytest.mark.parametrize("mode", MODES)
def test_a_recomputation_before_the_last_blocks_backward_lets_it_go(fresh_plans, monkeypatch, mode):
    """As a pipeline runs micro-batches: two forwards, then the first one's backward, then the
    second's.  The second forward's last block is not back-propagated first: it is let go of
    when the first backward's recomputations start (held through them, it would add its bytes
    to their peak, which the plan did not count), and recomputed in its own backward."""
    always_the_last_block(monkeypatch)
    ref = _two_micro_batches(mode, None, pipelined=True)
    got = _two_micro_batches(mode, "budget:1", pipelined=True)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    counters = stats.snapshot()["policy"]["budget:1"]
    assert counters["blocks_kept_whole"] == 0
    assert counters["replays"] == 2 * LAYERS * STEPS


@pytest.mark.parametrize("pipelined", [False, True])
def test_only_a_kind_read_whole_in_a_measured_step_may_be_kept_whole(fresh_plans, pipelined):
    """Two micro-batches' forwards, then their backwards: summed, the second forward's last
    block is read whole before any recomputation, and the kind may be kept whole; as a
    pipeline's first stage runs them (the first micro-batch's backward first), the block is
    let go of by that backward's recomputations -- kept whole it would spare nothing, and the
    plan never keeps it, whatever it measured."""
    got = _two_micro_batches("non_reentrant", "budget:1", pipelined)
    ref = _two_micro_batches("non_reentrant", None, pipelined)
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    (kind,) = policy_mod.resolve("budget:1").planner.kinds.values()
    assert kind.ends_step is not pipelined
    if pipelined:
        assert not kind.last
        assert stats.snapshot()["policy"]["budget:1"]["blocks_kept_whole"] == 0


def test_a_recomputation_on_paddles_reentrant_engine_lets_it_go_too(fresh_plans, monkeypatch):
    """A full-recompute block on the reentrant engine, run before the stack and back-propagated
    before it: its recomputation lets go of the stack's last block kept whole."""
    always_the_last_block(monkeypatch)
    paddle.seed(4)
    net, other = _Stack("non_reentrant", "budget:1"), Decoder()
    x = paddle.randn([ROWS, D])
    for _ in range(STEPS):
        y = x * 1.0
        y.stop_gradient = False
        g = paddle_mgrad.recompute(custom_forward(other), y, use_reentrant=True)
        loss = net(x).sum()
        g.sum().backward()
        loss.backward()
    assert (
        stats.recompute["reentrant"] == STEPS and not stats.recompute["reentrant_as_non_reentrant"]
    )
    assert stats.snapshot()["policy"]["budget:1"]["blocks_kept_whole"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_an_output_changed_in_place_after_the_block_recomputes_it(fresh_plans, monkeypatch, mode):
    """The last block's output, saved by its own last op, scaled in place after the block:
    without recompute Paddle refuses the backward; full recompute recomputes the block and
    works -- so does a plan that kept the block whole: it recomputes it."""

    def scale(out):
        out.scale_(2.0)

    with pytest.raises(Exception, match="inplace"):
        _run(None, layer=_Squashed, after=scale)
    stats.reset()
    ref = _run(mode, None, layer=_Squashed, after=scale)  # (full recompute)
    always_the_last_block(monkeypatch)
    got = _run(mode, "budget:1", layer=_Squashed, after=scale)
    assert_identical(got, ref)
    counters = stats.snapshot()["policy"]["budget:1"]
    assert counters["replays"] == LAYERS * STEPS  # (every block recomputed)


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_that_retains_the_graph_reads_the_kept_values_twice(
    fresh_plans, monkeypatch, mode
):
    always_the_last_block(monkeypatch)

    def twice(policy):
        paddle.seed(6)
        net = _Stack(mode if policy else None, policy)
        x = paddle.randn([ROWS, D])
        for _ in range(STEPS):
            loss = net(x).sum()
            loss.backward(retain_graph=True)
            loss.backward()
        return [p.grad.numpy() for p in net.parameters()]

    ref = twice(None)
    got = twice("budget:1")
    assert all(np.array_equal(a, b) for a, b in zip(got, ref))
    assert stats.snapshot()["policy"]["budget:1"]["blocks_kept_whole"] == STEPS


@pytest.mark.parametrize("mode", MODES)
def test_a_graph_alive_after_its_backward_holds_nothing_of_the_block_kept_whole(
    fresh_plans, monkeypatch, mode
):
    """A loop holding its last ``loss`` keeps the graph alive; the backward let go of every
    value the block kept whole as it read it, and of what its plan kept for a recomputation
    (here: the MLP whole and two linears' outputs)."""
    chosen = ("mlp", "gemm:self_attn.q_proj.weight", "gemm:self_attn.o_proj.weight")
    monkeypatch.setattr(budget.Planner, "_choose", lambda self, kind: (chosen, True))
    paddle.seed(7)
    net = _Stack(mode, "budget:1")
    x = paddle.randn([ROWS, D])
    paddle_mgrad.enable(recompute=True, fused_linear=True)  # (GEMM outputs: the fused linear's)
    try:
        for _ in range(STEPS):
            loss = net(x).sum()
            last = non_reentrant._last.frame
            assert last is not None  # (a measuring call's too)
            loss.backward()
        loss = net(x).sum()
        last = non_reentrant._last.frame
        assert last().sublayers.measure is None and any(last().kept.entries)  # (planned)
        loss.backward()
    finally:
        paddle_mgrad.disable()
    frame = last()
    assert frame.whole and frame.whole_read
    holders = [ref() for ref in frame.holders]
    assert [h.index for h in holders if h is not None and h.value is not None] == [
        h.index for h in holders if h is not None and h.kept and h.version is None
    ]  # (only the parameters and arguments, kept anyway)
    assert frame.kept is not None and not any(frame.kept.entries)
    assert frame.sublayers is not None and not frame.sublayers.regions
    del loss
    gc.collect()


@pytest.mark.parametrize("mode", MODES)
def test_another_block_call_releases_the_block_kept_whole(fresh_plans, monkeypatch, mode):
    """Any block call, a full-recompute one on Paddle's reentrant engine included."""
    always_the_last_block(monkeypatch)
    paddle.seed(8)
    net = _Stack("non_reentrant", "budget:1")
    x = paddle.randn([ROWS, D])
    for _ in range(STEPS):
        net(x).sum().backward()
    loss = net(x).sum()
    frame = non_reentrant._last.frame()
    kept = [ref() for ref in frame.holders]
    assert frame.whole and all(kept[i].value is not None for i in frame.whole)
    y = x * 1.0
    y.stop_gradient = False  # (an input that needs a gradient: the reentrant engine runs it)
    stats.reset()
    paddle_mgrad.recompute(custom_forward(net.layers[0]), y, use_reentrant=mode == "reentrant")
    assert stats.recompute["reentrant_as_non_reentrant"] == 0
    assert frame.whole is None and all(
        kept[i].value is None for i in range(len(kept)) if not kept[i].kept
    )
    assert non_reentrant._last.frame is None  # (a full-recompute block is kept by no plan)
    loss.backward()  # (recomputed: the last block was not the step's last)
    assert stats.snapshot()["policy"]["budget:1"]["blocks_kept_whole"] == 0


# -- the plan ----------------------------------------------------------------------------
def _planner(fraction, live, block_seconds, seconds, nbytes, head_raise=0, step=100):
    """A planner fed fixed figures for a kind of block with candidates ``seconds``/``nbytes``
    (per call), activations ``A`` = 100 bytes, ``live`` blocks alive, ``block_seconds`` its
    forward; measured steps that held ``step`` bytes at their most, their loss heads raising
    that ``head_raise`` bytes above their forwards' peak (None: no step read it)."""
    names = tuple(seconds)
    planner = budget.Planner("budget:test", fraction)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    for _ in range(budget.MEASURED_CALLS):
        planner.measured(key, seconds, nbytes, 100, 0, block_seconds)
    planner.forwards, planner.last_key = live, key  # (its call ended the step, read whole)
    planner.replay_starts(whole=True)
    planner.replayed()
    planner.head_raise, planner.step_bytes = head_raise, step
    return planner, key


@pytest.mark.parametrize(
    "fraction, block_seconds, head_raise, chosen, last",
    [
        # 4 blocks alive, A = 100 bytes, a step's peak P = 100 (nothing outside the blocks):
        # at 0.5, a budget of 0.5·4·100 - 100 = 100 bytes; a costs 4·20 and spares 3 s, b 4·10
        # and 2 s; without the last block: a, 4·3 = 12 s per step
        (0.5, 10.0, 40, ("b",), True),  # whole 40; then b fits: 10 + 3·2 = 16 s
        (0.5, 20.0, 70, (), True),  # whole 70: nothing else fits; 20 s
        (0.5, 10.0, 70, ("a",), False),  # 10 s alone < 12
        (0.5, 2.0, 0, ("a",), False),  # whole costs nothing, but 2 + 3·3 < 12
        (0.5, 10.0, 0, ("a",), True),  # 10 + 3·3 = 19
        (0.5, 20.0, 250, (), True),  # it adds no more than A = 100 bytes: fits, 20 s
        # at 0.4, a budget of 60 bytes: a (80) does not fit, b does (4·2 = 8 s)
        (0.4, 50.0, None, ("b",), False),  # no step read the head: A, over the budget
        (0.4, 50.0, 60, (), True),  # 50 s
    ],
)
def test_the_last_block_is_kept_when_it_spares_the_most_within_the_budget(
    fresh_plans, fraction, block_seconds, head_raise, chosen, last
):
    """Kept whole, the last block spares its replay once per step and adds to the step's peak
    its activations ``A``, but no more than the loss head, run with them in a measured step,
    raised the peak over the forward's; what else is kept is spared in the other blocks."""
    planner, key = _planner(
        fraction, 4, block_seconds, {"a": 3.0, "b": 2.0}, {"a": 20, "b": 10}, head_raise
    )
    assert planner.choose(key) == chosen
    assert planner.kinds[key].last is last
    report = stats.snapshot()["plans"]["budget:test"]["Block"]
    assert report["budget_bytes"] == round(fraction * 400 - 100)
    whole = 100 if head_raise is None else min(100, head_raise)
    assert (report["last_block"], report["last_block_bytes"]) == (last, whole)
    assert report["block_seconds"] == block_seconds


def test_a_kind_whose_call_never_ended_a_step_is_not_kept_whole(fresh_plans):
    """A decoder layer followed by a recomputed loss block: its calls are let go of by the loss
    block's; keeping them whole would spare nothing."""
    planner, key = _planner(0.5, 4, 50.0, {"a": 3.0, "b": 2.0}, {"a": 20, "b": 10})
    assert planner.kinds[key].ends_step
    planner.kinds[key].ends_step = False
    assert (planner.choose(key), planner.kinds[key].last) == (("a",), False)


def test_a_measured_call_times_the_block():
    """A measuring call reports its forward's time with what it saved."""
    planner = budget.Planner("budget:timed", 1.0)
    paddle.seed(9)
    net = Decoder()
    x = paddle.randn([ROWS, D])
    x.stop_gradient = False
    pol = policy_mod.Policy("budget:timed", gemm=False, planner=planner)
    non_reentrant.run(custom_forward(net), True, (x,), {}, policy=pol)
    (kind,) = planner.kinds.values()
    assert kind.calls == 1 and 0 < kind.block_seconds < 10
    assert kind.block_seconds >= sum(s for s in kind.seconds.values() if s)


def test_the_loss_heads_raise_over_the_forwards_peak_is_read_once_per_step():
    """A measured step: the most it held at each block call's return (its forward's peak),
    then at its first recomputation how far the loss head raised the allocator's peak above
    that -- only where the step raised the peak at all (below an earlier one, the head's is
    hidden); the most over the measured steps."""
    planner = budget.Planner("budget:head", 1.0)
    now, peak = [100], [500]
    planner.memory = memory.Allocated(lambda: now[0], lambda: peak[0])
    planner._step_starts(True, (), {})  # (allocated 100, peak 500 at the step's first call)
    now[0], peak[0] = 600, 700  # a block's forward raised the peak, 600 bytes held at its end
    planner.forwards = 1
    planner.forward_returned()
    now[0] = 400
    planner.forward_returned()  # (the step's most so far counts: 700 - 100)
    assert planner.forward_bytes == 600
    assert planner.head_raise is None
    peak[0] = 750  # the loss head raised it by 50
    planner.replay_starts()
    assert planner.head_raise == 50
    planner.replayed()
    peak[0] = 2000  # the first recomputation raised it more: not the head's
    planner.replay_starts()
    assert planner.head_raise == 50
    # the next measured step: its forward below the earlier peak (what it holds counts: 500)
    now[0] = 100
    planner._step_starts(True, (), {})
    assert planner.forward_bytes == 0
    now[0], planner.forwards = 600, 3
    planner.forward_returned()
    assert planner.forward_bytes == 500
    planner.replay_starts()  # the head did not raise the peak either: hidden, nothing read
    assert planner.head_raise == 50
    planner.replayed()
    # and one whose head did: counted above what its forward held (high, never low)
    planner._step_starts(True, (), {})
    planner.forwards = 3
    planner.forward_returned()
    peak[0] = 2100
    planner.replay_starts()
    assert planner.head_raise == 2100 - 600
    # a step not measured reads nothing
    planner.replayed()
    planner._step_starts(False, (), {})
    planner.forwards, peak[0] = 3, 9000
    planner.forward_returned()
    planner.replay_starts()
    assert planner.head_raise == 1500


@pytest.mark.probe
@pytest.mark.parametrize("head", ["light", "heavy"])
def test_what_keeping_the_last_block_costs_is_read_from_the_allocator(head):
    """In a fresh process (its allocator's peak its own): the measured step keeps its last
    block whole through the loss head and reads how far the head raised the peak above the
    forward's.  A light head (a sum: its gradient, one hidden state) raises it by a fraction
    of a block's activations, and ``budget:0.5`` keeps the last block whole; a heavy one (a
    projection 64 times wider than the blocks) by more than a block holds: keeping it would
    add all of it, and the plan does not."""
    r = run_probe_script("last_block_probe.py", head, "0.5")
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])
    assert res["identical"]
    plan, raised = res["plan"], res["head_raise"]
    a = plan["block_bytes"]
    counters = res["counters"]
    if head == "light":
        assert 0 <= raised < a / 8 and plan["last_block_bytes"] == raised
        assert plan["last_block"]
        assert counters["blocks_kept_whole"] == 3  # (every step's: the measured one's too)
    else:
        assert raised > a and plan["last_block_bytes"] == a
        assert not plan["last_block"]
        assert counters["blocks_kept_whole"] == 1  # (the measured step's)
    assert counters["replays"] + counters["blocks_kept_whole"] == counters["calls"]


def test_a_head_below_the_forwards_peak_costs_nothing():
    """The forward raised the allocator's peak and the loss head, the last block held, stayed
    below it: keeping the block whole costs nothing (read as 0, not as unknown)."""
    planner = budget.Planner("budget:free", 0.0)
    now, peak = [100], [500]
    planner.memory = memory.Allocated(lambda: now[0], lambda: peak[0])
    planner._step_starts(True, (), {})
    now[0], peak[0], planner.forwards = 300, 900, 2
    planner.forward_returned()
    now[0] = 400  # (the head holds more than at the block's return, below the forward's peak)
    planner.replay_starts()
    assert planner.head_raise == 0
    kind = budget._Kind("Block", ())
    kind.block_bytes, kind.calls = 300, 3
    assert planner.last_block_bytes(kind) == 0
