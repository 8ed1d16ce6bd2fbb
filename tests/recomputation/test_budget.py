"""The ``budget:<fraction>`` recompute policy (:mod:`paddle_mgrad.recomputation.budget`): the
first calls of a kind of block are measured under full recompute, then the sublayers with the
most replay time within the fraction are kept.  Bit-identical to no recompute over the
measured and the planned calls, in both modes; the choice follows the measured figures (a
planner fed fixed figures); the measured bytes are what ``save:`` of the same sublayer keeps."""

from itertools import product

import paddle
import policy_runs
import pytest
from decoder import ROWS, D, Decoder, custom_forward
from hypothesis import given, settings, strategies as st
from in_place_ops import IN_PLACE
from paddle.distributed.fleet.utils import recompute as paddles_recompute
from policy_runs import assert_identical

import paddle_mgrad
from helpers import nonzero_biases
from paddle_mgrad import EnvError, stats
from paddle_mgrad.recomputation import budget, memory, policy as policy_mod

MODES = ("reentrant", "non_reentrant")
#: the fused linears of a Decoder, by path
GEMMS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.o_proj",
    "mlp.gate",
    "mlp.up",
    "mlp.down",
)
STEPS = budget.MEASURED_CALLS + 2  # measured calls, then planned ones


def train(how, policy=None, steps=STEPS):
    """``steps`` micro-steps of a :class:`decoder.Decoder` with recompute ``how`` ("none" or a
    mode) under ``policy`` (:func:`policy_runs.train`)."""
    return policy_runs.train(Decoder, how, policy, steps, block=custom_forward, rows=ROWS, d=D)


@pytest.fixture
def fresh_plans(monkeypatch):
    """Each test plans anew: the resolved budget policies (and their plans) are forgotten."""
    monkeypatch.setattr(policy_mod, "_NAMED", {})
    monkeypatch.setattr(stats, "plans", {})
    stats.reset()


@pytest.mark.parametrize("fraction", ["0", "0.3", "0.6", "1"])
@pytest.mark.parametrize("mode", MODES)
def test_budget_equals_no_recompute(fresh_plans, mode, fraction):
    ref = train("none")
    got = train(mode, f"budget:{fraction}")
    assert_identical(got, ref)
    name = f"budget:{float(fraction):g}"
    plan = stats.snapshot()["plans"][name]["Decoder"]
    counters = stats.snapshot()["policy"][name]
    chosen = plan["chosen"]
    # planned after the measured calls; the planned calls skip what was chosen -- unless the
    # plan keeps the step's last block (here: each step's one block) whole: not recomputed, as
    # in the measured steps (which keep it to measure what that costs)
    planned = STEPS - budget.MEASURED_CALLS
    whole = plan["last_block"]
    assert counters["blocks_kept_whole"] == (STEPS if whole else budget.MEASURED_CALLS)
    replayed = 0 if whole else planned
    assert counters["calls"] == STEPS
    gemms_chosen = [n for n in chosen if n.startswith("gemm:")]
    assert counters["sublayers_not_recomputed"] == replayed * (len(chosen) - len(gemms_chosen))
    taken = sum(plan["measured"][n]["bytes"] for n in chosen)
    taken += plan["last_block_bytes"] if whole else 0
    assert taken <= plan["budget_bytes"] == int(float(fraction) * plan["block_bytes"])
    assert plan["block_bytes"] > 0
    gemms = [f"gemm:{p}.weight" for p in GEMMS]
    assert sorted(plan["measured"]) == sorted(
        ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp", "dropout", *gemms]
    )
    # each chosen linear's outputs are kept in the planned calls (none inside a kept sublayer)
    assert not any(n.split(":")[1].split(".")[0] in chosen for n in gemms_chosen)
    assert counters["gemms_not_recomputed"] == replayed * len(gemms_chosen)


def test_budget_one_keeps_something_and_zero_only_what_is_free(fresh_plans, monkeypatch):
    policy_runs.never_the_last_block(monkeypatch)  # (each step's one block: kept whole else)
    train("non_reentrant", "budget:1")
    train("non_reentrant", "budget:0")
    plans = stats.snapshot()["plans"]
    assert plans["budget:1"]["Decoder"]["chosen"]
    free = [n for n, m in plans["budget:0"]["Decoder"]["measured"].items() if m["bytes"] == 0]
    assert plans["budget:0"]["Decoder"]["chosen"] == free


@pytest.mark.parametrize(
    "fraction, chosen",
    [
        (0.3, ("b", "c", "free")),  # b (1 s, 10 B) and c (1 s, 50 B) fill 60 of 60 bytes
        (0.2, ("b", "free")),  # c (50) no longer fits beside b (10), a (100) alone neither
        (1.0, ("a", "b", "c", "free")),
        (0.0, ("free",)),  # a candidate that costs no byte is always kept
    ],
)
def test_the_plan_spares_the_most_time_within_the_budget(fresh_plans, fraction, chosen):
    names = ("a", "b", "c", "free", "never")
    planner = budget.Planner("budget:test", fraction)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    for call in range(budget.MEASURED_CALLS):
        # times vary between calls: the minimum counts (warm-ups); bytes are averaged
        slow = 5.0 if call == 0 else 1.0
        planner.measured(
            key,
            {"a": slow, "b": 1.0, "c": 1.0, "free": 0.5},
            {"a": 100, "b": 10, "c": 50, "free": 0},
            200,
            0,
        )
    assert _plan(planner, key) == planner.kinds[key].chosen == chosen
    report = stats.snapshot()["plans"]["budget:test"]["Block"]
    assert report["chosen"] == list(chosen)
    assert report["measured"]["a"] == {"seconds": 1.0, "bytes": 100}
    assert report["measured"]["never"] == {"seconds": 0.0, "bytes": 0}
    assert report["block_bytes"] == 200 and report["budget_bytes"] == int(fraction * 200)


def test_the_plan_spares_the_most_time_that_fits_not_the_best_time_per_byte_first(fresh_plans):
    """Per candidate 2 s / 10.3 B, 3 s / 20 B, 8 s / 25 B, 9 s / 45 B: within 50 bytes b and c
    spare 11 s.  Taken by time per byte (c, a: 10 s), by time (d: 9 s), by name or by
    ascending bytes (a, b: 5 s) another set would be kept.  A candidate's time is its minimum
    over the calls (here the last call is the slow one) and its bytes their mean; the report
    gives whole bytes."""
    names = ("a", "b", "c", "d")
    planner = budget.Planner("budget:test", 0.5)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    for call in range(budget.MEASURED_CALLS):
        slow = 5.0 if call == budget.MEASURED_CALLS - 1 else 1.0
        last = call == budget.MEASURED_CALLS - 1
        planner.measured(
            key,
            {"a": 2.0 * slow, "b": 3.0 * slow, "c": 8.0 * slow, "d": 9.0 * slow},
            {"a": 10 + last, "b": 20, "c": 25, "d": 45},
            100 + last,
            0,
        )
    assert _plan(planner, key) == ("b", "c")
    report = stats.snapshot()["plans"]["budget:test"]["Block"]
    assert report["measured"]["a"] == {"seconds": 2.0, "bytes": 10}
    assert type(report["measured"]["a"]["bytes"]) is int
    assert report["block_bytes"] == 100 and type(report["block_bytes"]) is int
    assert report["budget_bytes"] == 50


def _plans(sublayers, linears):
    """Every plan of candidates ``sublayers`` (name -> its linears) and ``linears`` (those of
    no sublayer): each sublayer whole or any subset of its linears, any subset of the rest."""
    options = [[()]]
    for sub, inner in sublayers.items():
        subsets = [
            tuple(n for n, bit in zip(inner, bits) if bit)
            for bits in product((0, 1), repeat=len(inner))
        ]
        options.append(subsets + [(sub,)])
    options += [[(), (n,)] for n in linears]
    for parts in product(*options):
        yield frozenset(n for part in parts for n in part)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_the_plan_is_the_best_of_every_plan_that_fits(data):
    """Drawn candidates -- sublayers with 0 to 3 linears, linears of no sublayer -- with whole
    seconds and bytes, and a budget: the plan fits, keeps no linear of a sublayer it keeps
    whole, spares the most time of all plans that fit (enumerated), and of those costs the
    fewest bytes.  So it never loses to a fixed policy that fits (every linear, one sublayer)."""
    seconds, nbytes, owner, sublayers = {}, {}, {}, {}
    for i in range(data.draw(st.integers(0, 3), label="sublayers")):
        sub = f"s{i}"
        sublayers[sub] = tuple(f"gemm:{sub}.w{j}" for j in range(data.draw(st.integers(0, 3))))
        for name in (sub,) + sublayers[sub]:
            owner[name] = sub if name != sub else None
    linears = tuple(f"gemm:w{j}" for j in range(data.draw(st.integers(0, 3), label="linears")))
    owner.update({n: None for n in linears})
    for name in owner:
        seconds[name] = data.draw(st.integers(1, 20), label=f"seconds {name}")
        nbytes[name] = data.draw(st.integers(0, 30), label=f"bytes {name}")
    limit = data.draw(st.integers(0, 100), label="budget")
    chosen = budget._spare_most(limit, seconds, nbytes, owner)

    def cost(plan):
        return sum(nbytes[n] for n in plan), sum(seconds[n] for n in plan)

    fitting = [cost(p) for p in _plans(sublayers, linears) if cost(p)[0] <= limit]
    best = max(s for _, s in fitting)
    assert cost(chosen)[0] <= limit
    assert not any(owner[n] in chosen for n in chosen)
    assert cost(chosen) == (min(b for b, s in fitting if s == best), best)


def test_many_candidates_are_planned_within_the_budget(monkeypatch):
    """Past :data:`budget._MAX_PLANS` partial plans (here 16; 2**16 plans of 16 linears) plans
    of near bytes merge into the one that spares the most: no more than ``2·(16 + 1)`` plans
    are ever weighed at once (one per slice of ``budget / 16`` bytes, each extended by the next
    candidate), the plan still fits and, where each linear spares the same time per byte,
    fills 95 % of the budget at least (keeping the plan of each slice that spares the least
    fills 88 %)."""
    monkeypatch.setattr(budget, "_MAX_PLANS", 16)
    weighed = []

    def counted_sorted(plans, key=None):
        plans = list(plans)
        weighed.append(len(plans))
        return sorted(plans, key=key)

    monkeypatch.setattr(budget, "sorted", counted_sorted, raising=False)
    names = [f"gemm:w{j}" for j in range(16)]
    nbytes = {n: 3.0 + j for j, n in enumerate(names)}
    seconds = {n: 100.0 * nbytes[n] for n in names}
    chosen = budget._spare_most(100.0, seconds, nbytes, dict.fromkeys(names))
    taken = sum(nbytes[n] for n in chosen)
    assert 95.0 <= taken <= 100.0, sorted(chosen)
    assert max(weighed) <= 2 * (16 + 1), weighed


def test_up_to_max_plans_nothing_is_merged(monkeypatch):
    """With :data:`budget._MAX_PLANS` 4: after a (1 B, 1 s) and b (1.2 B, 2 s) the four plans
    (none, a, b, both) are carried as they are, though a and b lie in one slice of
    ``4 / 4`` bytes; so a and c (3 B, 2.5 s) are found to spare the most within 4 bytes."""
    monkeypatch.setattr(budget, "_MAX_PLANS", 4)
    seconds = {"a": 1.0, "b": 2.0, "c": 2.5}
    nbytes = {"a": 1.0, "b": 1.2, "c": 3.0}
    assert budget._spare_most(4.0, seconds, nbytes, dict.fromkeys(seconds)) == {"a", "c"}


def test_a_block_that_keeps_nothing_without_recompute_keeps_only_free_candidates(fresh_plans):
    """Budget 1 of a block whose activations take no byte: a candidate costing one byte in one
    call (a third of a byte on average) does not fit; a free one does."""
    names = ("one", "free")
    planner = budget.Planner("budget:test", 1.0)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    for call in range(budget.MEASURED_CALLS):
        planner.measured(key, {"one": 1.0, "free": 1.0}, {"one": int(call == 0)}, 0, 0)
    assert _plan(planner, key) == ("free",)


def test_a_plan_that_keeps_nothing_wraps_nothing(fresh_plans):
    """Once planned, a block whose plan keeps nothing runs as full recompute: no sublayers to
    wrap and no GEMM output to keep (None, None); one that keeps the MLP gets its MLP; one
    that keeps a linear's output keeps the outputs of that weight only."""
    paddle.seed(11)
    net = Decoder()
    planner = budget.Planner("budget:test", 0.5)
    kind = budget._Kind("Decoder", *budget._kind(net)[1:])
    planner.kinds[budget._kind(net)] = kind
    kind.chosen = ()
    assert planner.plan(net, (), {}) == budget.Plan()
    kind.chosen = ("mlp",)
    planner._planned.clear()  # (a Layer's plan is looked up once)
    kept, sublayers, _ = planner.plan(net, (), {})
    assert kept is None and sublayers.layers == (net.mlp,)
    kind.chosen = ("gemm:self_attn.q_proj.weight",)
    planner._planned.clear()
    kept, sublayers, _ = planner.plan(net, (), {})
    assert sublayers is None
    x = paddle.ones([2, D])
    assert kept.wants(x, net.self_attn.q_proj.weight, x)
    assert not kept.wants(x, net.self_attn.k_proj.weight, x)
    assert not kept.wants(x, net.self_attn.q_proj.bias, x)


def _measure(planner, key, seconds, costs, calls=budget.MEASURED_CALLS, block_bytes=200):
    for _ in range(calls):
        planner.measured(key, dict(seconds), dict(costs), block_bytes, 0)
    _plan(planner, key)


def _plan(planner, key, live=1):
    """What a backward tells the planner (``live`` block calls were alive at once), then the
    start of the kind's next call: its plan, or None while it is measured."""
    planner.forwards = live
    planner.replayed()
    return planner.choose(key)


@pytest.mark.parametrize(
    "fraction, live, budget_bytes, chosen",
    [
        # 0.5·4·110 - 4·10 - 100; a adds 4·20
        (0.5, 4, 80, ("a",)),
        (0.5, 1, 50, ("a", "b")),  # one block alive: the fraction of its bytes
        (0.3, 4, 0, ()),  # under what full recompute holds (140 of 440): nothing
        (1.0, 4, 300, ("a", "b")),  # c would add 150 more
        (0.8, 2, 56, ("a",)),  # 0.8·2·110 - 2·10 - 100: a adds 2·20, b 2·30
    ],
)
def test_the_budget_bounds_the_memory_of_all_blocks_alive_at_once(
    fresh_plans, fraction, live, budget_bytes, chosen
):
    """Blocks of 100 activation bytes and 10 input bytes, ``live`` of them alive at once: the
    plan adds to the blocks' memory under full recompute (every input, one block's activations)
    at most what keeps it within the fraction of theirs without recompute (110 each).  A
    candidate adds its bytes in every block alive, the one being recomputed included."""
    names = ("a", "b", "c")
    planner = budget.Planner("budget:test", fraction)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    for _ in range(budget.MEASURED_CALLS):
        planner.measured(key, {"a": 3.0, "b": 2.0, "c": 1.0}, {"a": 20, "b": 30, "c": 50}, 100, 10)
    assert _plan(planner, key, live) == chosen
    report = stats.snapshot()["plans"]["budget:test"]["Block"]
    assert (report["budget_bytes"], report["live_blocks"]) == (budget_bytes, live)
    assert (report["block_bytes"], report["input_bytes"]) == (100, 10)
    assert report["measured_calls"] == budget.MEASURED_CALLS
    # (whole bytes, as every counter of paddle_mgrad.stats: 10 and 10.0 compare equal)
    figures = [report[k] for k in ("budget_bytes", "block_bytes", "input_bytes", "outside_bytes")]
    figures += [m["bytes"] for m in report["measured"].values()]
    assert all(type(f) is int for f in figures), report


def test_blocks_alive_at_once_are_the_most_calls_between_two_replays(fresh_plans):
    """Four forwards then their four replays, then two forwards and a replay (a pipeline's
    steady state): four alive at once, not the last two; a replay with no forward since it
    changes nothing; before any replay nothing is planned."""
    names = ("a",)
    planner = budget.Planner("budget:test", 1.0)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    for _ in range(budget.MEASURED_CALLS):
        planner.measured(key, {"a": 1.0}, {"a": 10}, 100, 0)
    assert planner.choose(key) is None  # (no backward seen: how many alive is unknown)
    planner.forwards = 4
    for _ in range(4):
        planner.replayed()
    planner.forwards = 2
    planner.replayed()
    assert (planner.live, planner.forwards) == (4, 0)
    assert planner.choose(key) == ("a",)
    assert stats.snapshot()["plans"]["budget:test"]["Block"]["live_blocks"] == 4
    planner = budget.Planner("budget:fixed", 1.0, live_blocks=1)  # (told, not counted)
    assert planner.live == 0
    planner.forwards = 4
    planner.replayed()
    assert (planner.live, planner.forwards) == (1, 0)


class _Allocator:
    """A stand-in for the allocator statistics (:class:`.memory.Allocated`): the bytes set
    in ``now`` and ``peak``, and how often each was read."""

    def __init__(self, now, peak):
        self.values = {"now": now, "peak": peak}
        self.reads = 0
        self.allocated = memory.Allocated(lambda: self._read("now"), lambda: self._read("peak"))

    def _read(self, which):
        self.reads += 1
        return self.values[which]


def _measured_step(planner, key, allocator, held, block_bytes=100, input_bytes=10, live=4):
    """One measured step of ``live`` blocks: its first call starts it (the allocator holds
    1000 bytes then), each call is measured, then backward replays them; at the first
    replay the allocator reads ``held`` (a dict: ``now`` and ``peak``)."""
    planner._step_starts(True, (), {})
    for _ in range(live):
        planner.measured(key, {"a": 1.0, "b": 1.0}, {"a": 20, "b": 30}, block_bytes, input_bytes)
    planner.forwards = live
    allocator.values.update(held)
    for _ in range(live):
        planner.replayed()


@pytest.mark.parametrize(
    "before, held, outside, budget_bytes, chosen",
    [
        # the step raised the peak to 1800: 800 above its start, of which 3·10 + 100 are the
        # blocks' (the other blocks' inputs, the one recomputed): 670 outside them;
        # 0.5·(670 + 4·110) - 670 - 4·10 - 100 = -255: nothing
        (1000, {"now": 1500, "peak": 1800}, 670, 0, ()),
        # an earlier peak (5000) hides the step's: what it holds now, 1230 (230 above its
        # start): 100 outside; 0.5·(100 + 440) - 100 - 140 = 30: a adds 4·20, b 4·30: over
        (5000, {"now": 1230, "peak": 5000}, 100, 30, ()),
        # 2 outside: 0.5·442 - 2 - 140 = 79: a does not fit
        (5000, {"now": 1132, "peak": 5000}, 2, 79, ()),
        # nothing outside: 0.5·440 - 140 = 80: a fits, then b does not
        (5000, {"now": 1130, "peak": 5000}, 0, 80, ("a",)),
    ],
)
def test_memory_outside_the_blocks_shrinks_the_budget(
    fresh_plans, before, held, outside, budget_bytes, chosen
):
    """What a measured step holds outside its blocks (logits, the loss, gradients) is part of
    both no recompute's peak and the plan's: the fraction bounds the step, so the budget is
    ``f·(O + L·(A + I)) - O - L·I - A``.  ``O`` is read from the allocator at the replays:
    the peak where the step raised it, else what is allocated then (an earlier peak not
    reset hides the step's: a lower bound)."""
    names = ("a", "b")
    planner = budget.Planner("budget:test", 0.5)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    allocator = _Allocator(now=1000, peak=before)
    planner.memory = allocator.allocated
    _measured_step(planner, key, allocator, held)
    assert planner.choose(key) == chosen
    report = stats.snapshot()["plans"]["budget:test"]["Block"]
    assert (report["outside_bytes"], report["budget_bytes"]) == (outside, budget_bytes)


def test_blocks_without_a_layer_are_alive_too_and_keywords_find_the_place(fresh_plans):
    """A block whose function reaches no Layer is recomputed whole, and alive until its
    backward all the same: two such calls, then a replay, are two alive.  A step whose first
    call hands its tensors by keyword reads the allocator of their place."""
    planner = budget.Planner("budget:test", 0.5)
    x = paddle.ones([ROWS, D])
    for _ in range(2):
        assert planner.plan(lambda h: h * 2, (x,), {}) == budget.Plan()
    planner.replayed()
    assert planner.live == 2
    planner = budget.Planner("budget:keywords", 0.5)
    planner.plan(Decoder(), (), {"h": x})
    assert planner.memory is not None and planner.memory.now() > 0


def test_a_step_is_read_from_its_first_call_to_its_largest_replay(fresh_plans):
    """What a step holds is counted from its first block call (later calls start with more
    allocated: the earlier blocks' inputs), up to the most any of its replays saw (backward
    frees as it goes: the last replay holds the least)."""
    planner = budget.Planner("budget:test", 0.5)
    net = Decoder()
    allocator = _Allocator(now=1000, peak=5000)  # (an earlier peak: what is held counts)
    planner.memory = allocator.allocated
    x = paddle.ones([ROWS, D])
    for now in (1000, 1100, 1200):
        allocator.values["now"] = now
        planner.plan(custom_forward(net), (x,), {})
    for now in (1700, 1500, 1300):
        allocator.values["now"] = now
        planner.replayed()
    assert planner.step_bytes == 700


def test_the_allocator_is_read_only_while_a_step_is_measured(fresh_plans):
    """Once planned, a step's first call and its replays read no statistic (no host cost
    per call); without statistics (None) the plan counts nothing outside the blocks."""
    names = ("a", "b")
    planner = budget.Planner("budget:test", 0.5)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    allocator = _Allocator(now=1000, peak=1000)
    planner.memory = allocator.allocated
    _measured_step(planner, key, allocator, {"now": 1100, "peak": 1150})
    assert planner.choose(key) is not None
    reads = allocator.reads
    assert reads == 2 + 4  # (the start: both; each replay: the peak, which the step raised)
    planner._step_starts(False, (), {})
    for _ in range(4):
        planner.replayed()
    assert allocator.reads == reads
    planner = budget.Planner("budget:none", 0.5)
    planner.kinds[key] = budget._Kind("Block", names)
    planner.memory = None
    _measured_step(planner, key, allocator, {"now": 9000, "peak": 9000})
    planner.choose(key)
    assert stats.snapshot()["plans"]["budget:none"]["Block"]["outside_bytes"] == 0


def test_calls_that_ran_none_of_the_sublayers_measure_nothing(fresh_plans):
    """A call whose branch ran none of the candidates is not a measured call (it would plan on
    too few measures), and a candidate's minimum is over the calls that ran it: a call that
    skipped it does not make it look free of time."""
    names = ("a", "b")
    planner = budget.Planner("budget:test", 1.0)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    _measure(planner, key, {}, {}, calls=5)
    assert planner.kinds[key].calls == 0 and planner.kinds[key].chosen is None
    _measure(planner, key, {"b": 1.0}, {"b": 10}, calls=1)
    _measure(planner, key, {"a": 2.0, "b": 1.0}, {"a": 10, "b": 10}, calls=2)
    assert planner.kinds[key].chosen == ("a", "b")
    measured = stats.snapshot()["plans"]["budget:test"]["Block"]["measured"]
    assert measured["a"]["seconds"] == 2.0 and measured["b"]["seconds"] == 1.0


class _Group:
    """A tensor-parallel group of two ranks, as fleet's hybrid group answers it."""

    nranks, ranks = 2, [4, 5]

    def get_model_parallel_group(self):
        return self


def test_a_tensor_parallel_group_runs_its_first_ranks_plan(fresh_plans, monkeypatch):
    """Ranks of a tensor-parallel group measure different times; a sublayer kept on one and
    replayed on the other would leave the other's all-reduce waiting.  Each rank's plan is
    replaced by the one broadcast from the group's first rank."""
    from paddle.distributed import fleet

    sent = []

    def broadcast(mask, src, group=None, sync_op=True):
        sent.append((mask.numpy().tolist(), src, group))
        # the first rank's plan: a, and the step's last block whole
        mask.set_value(paddle.to_tensor([1, 0, 0, 1], dtype="int32"))

    monkeypatch.setattr(fleet, "get_hybrid_communicate_group", lambda: _Group())
    monkeypatch.setattr(paddle.distributed, "broadcast", broadcast)
    names = ("a", "b", "c")
    planner = budget.Planner("budget:test", 0.1)
    key = ("Block", names)
    planner.kinds[key] = budget._Kind("Block", names)
    _measure(planner, key, {"a": 1.0, "b": 9.0, "c": 1.0}, {"a": 50, "b": 10, "c": 0})
    assert len(sent) == 1 and sent[0][1:] == (4, sent[0][2])
    assert sent[0][0] == [0, 1, 1, 0]  # this rank's own plan: b and c (then: the last block)
    assert isinstance(sent[0][2], _Group)
    assert (planner.kinds[key].chosen, planner.kinds[key].last) == (("a",), True)
    report = stats.snapshot()["plans"]["budget:test"]["Block"]
    assert (report["chosen"], report["last_block"]) == (["a"], True)


def test_outside_fleet_there_is_no_group_to_agree_with(fresh_plans, monkeypatch):
    def not_initialised():
        raise AttributeError("'Fleet' object has no attribute '_hcg'")

    from paddle.distributed import fleet

    monkeypatch.setattr(fleet, "get_hybrid_communicate_group", not_initialised)
    assert budget._lockstep_group() is None
    group = _Group()
    group.nranks = 1
    monkeypatch.setattr(fleet, "get_hybrid_communicate_group", lambda: group)
    assert budget._lockstep_group() is None
    group.nranks = 2
    assert budget._lockstep_group() is group


def test_measured_bytes_are_what_save_keeps(fresh_plans):
    """A candidate's measured bytes (its ops' saved activations and its outputs) equal what
    ``save:`` of that sublayer keeps (``kept_bytes``)."""
    train("non_reentrant", "budget:0.5")
    measured = stats.snapshot()["plans"]["budget:0.5"]["Decoder"]["measured"]
    for name in ("mlp", "self_attn", "post_attention_layernorm"):
        stats.reset()
        train("non_reentrant", f"save:{name}", steps=1)
        assert (
            stats.snapshot()["policy"][f"save:{name}"]["kept_bytes"] == measured[name]["bytes"]
        ), name


def test_budget_from_the_environment_reaches_paddles_own_recompute(fresh_plans, monkeypatch):
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", " Budget:0.50 ")
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        paddle.seed(11)
        net = Decoder()
        for _ in range(STEPS):
            h = paddle.randn([ROWS, D])
            h.stop_gradient = False
            paddles_recompute(custom_forward(net), h * 1.0).sum().backward()
    finally:
        paddle_mgrad.disable()
    snap = stats.snapshot()
    assert snap["policy"]["budget:0.5"]["calls"] == STEPS
    assert "Decoder" in snap["plans"]["budget:0.5"]


@pytest.mark.parametrize("bad", ["budget:", "budget:x", "budget:1.5", "budget:-0.1", "budget:nan"])
def test_bad_budgets_are_named(monkeypatch, bad):
    with pytest.raises(ValueError, match=r"budget: takes a fraction from 0 to 1"):
        policy_mod.resolve(bad)
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", bad)
    with pytest.raises(EnvError, match=r"PADDLE_MGRAD_RECOMPUTE_POLICY=.*budget:<fraction>"):
        policy_mod.resolve()


def _gemm_kind(planner, key, sublayers, params):
    planner.kinds[key] = budget._Kind(key[0], sublayers, params)
    return planner.kinds[key]


@pytest.mark.parametrize(
    "fraction, chosen",
    [
        # top (5 s, 5 B; the Layer's own parameter, inside no sublayer), a.w (5 s, 10 B), b.w
        # (5 s, 20 B), a (10 s, 50 B), b (1 s, 100 B).  Within 100 bytes: a whole in place of
        # a.w, b.w and top spare 20 s in 75 B; b does not fit beside a
        (0.5, ("a", "gemm:b.w", "gemm:top")),
        # within 80: the same, a whole and a.w are never both kept (85)
        (0.4, ("a", "gemm:b.w", "gemm:top")),
        # within 40: a does not fit beside b.w and top (75): a.w, b.w and top (15 s in 35 B)
        (0.2, ("gemm:a.w", "gemm:b.w", "gemm:top")),
        # within 30: any two linears spare 10 s; top and a.w in the fewest bytes (15)
        (0.15, ("gemm:a.w", "gemm:top")),
    ],
)
def test_a_sublayer_taken_whole_replaces_its_linears_and_a_kept_one_hides_them(
    fresh_plans, fraction, chosen
):
    planner = budget.Planner("budget:test", fraction)
    key = ("Block", ("a", "b"))
    kind = _gemm_kind(planner, key, ("a", "b"), ("a.w", "b.w", "top", "norm"))
    assert kind.owner == {"gemm:a.w": "a", "gemm:b.w": "b", "gemm:top": None, "gemm:norm": None}
    seconds = {"a": 10.0, "b": 1.0, "gemm:a.w": 5.0, "gemm:b.w": 5.0, "gemm:top": 5.0}
    costs = {"a": 50, "b": 100, "gemm:a.w": 10, "gemm:b.w": 20, "gemm:top": 5}
    _measure(planner, key, seconds, costs)  # block bytes 200
    assert kind.chosen == tuple(n for n in kind.names if n in chosen)
    report = stats.snapshot()["plans"]["budget:test"]["Block"]
    assert "gemm:norm" not in report["measured"]  # never a linear's weight: no candidate
    assert report["measured"]["gemm:a.w"] == {"seconds": 5.0, "bytes": 10}


def test_a_linear_of_a_kept_sublayer_is_passed_over(fresh_plans):
    """a whole (10 s) spares more than its linear a.w (0.5 s) in the same bytes: a.w is not
    kept beside it, and b (0.1 s) still is."""
    planner = budget.Planner("budget:test", 1.0)
    key = ("Block", ("a", "b"))
    kind = _gemm_kind(planner, key, ("a", "b"), ("a.w",))
    _measure(
        planner,
        key,
        {"a": 10.0, "gemm:a.w": 0.5, "b": 0.1},
        {"a": 10, "gemm:a.w": 10, "b": 10},
    )
    assert kind.chosen == ("a", "b")


@pytest.mark.parametrize(
    "mlp_seconds, chosen",
    [
        # within 25: the norm and the mlp's linear spare 225 s in 20.75 B, the mlp whole
        # 220 s in 22 B, and beside the norm it no longer fits
        (220.0, ("norm", "gemm:mlp.g")),
        # whole, it would spare less than its linear already does, or no more in more
        # bytes: never taken
        (210.0, ("norm", "gemm:mlp.g")),
        (215.0, ("norm", "gemm:mlp.g")),
    ],
)
def test_a_sublayer_whole_is_weighed_against_its_linears(fresh_plans, mlp_seconds, chosen):
    def choice(fraction):
        planner = budget.Planner("budget:test", fraction)
        key = ("Block", ("mlp", "norm"))
        kind = _gemm_kind(planner, key, ("mlp", "norm"), ("mlp.g",))
        _measure(
            planner,
            key,
            {"mlp": mlp_seconds, "gemm:mlp.g": 215.0, "norm": 10.0},
            {"mlp": 22, "gemm:mlp.g": 12.75, "norm": 8},
            block_bytes=100,
        )
        return kind.names, kind.chosen

    names, got = choice(0.25)
    assert got == tuple(n for n in names if n in chosen)
    _, got = choice(0.3)  # within 30 the mlp whole fits beside the norm (230 s for 220 s)
    whole = mlp_seconds > 215.0
    assert got == (("mlp", "norm") if whole else ("norm", "gemm:mlp.g"))


def test_of_equal_candidates_the_first_is_taken(fresh_plans):
    """Two candidates that spare the same time in the same bytes, room for one: the first in
    the Layer's own order (not by name), on every rank alike."""
    planner = budget.Planner("budget:test", 0.1)
    key = ("Block", ("norm", "attn"))
    kind = _gemm_kind(planner, key, ("norm", "attn"), ())
    _measure(planner, key, {"norm": 1.0, "attn": 1.0}, {"norm": 10, "attn": 10}, block_bytes=100)
    assert kind.chosen == ("norm",)


def test_the_bytes_a_sublayer_gives_back_count_for_later_candidates(fresh_plans):
    """Within 100 bytes: a whole (50 B) is kept in place of its linear a.w, not beside it --
    50 bytes taken, not 60 -- so c (45) still fits."""
    planner = budget.Planner("budget:test", 0.5)
    key = ("Block", ("a", "c"))
    kind = _gemm_kind(planner, key, ("a", "c"), ("a.w",))
    _measure(
        planner, key, {"gemm:a.w": 1.0, "a": 3.0, "c": 0.5}, {"gemm:a.w": 10, "a": 50, "c": 45}
    )
    assert kind.chosen == ("a", "c")


class _Chain(paddle.nn.Layer):
    """``d(tanh(c(tanh(s(h)))))``: three linears of one shape, each a sublayer of its own;
    ``after_s`` (an :data:`IN_PLACE` op) changes ``s``'s output in place."""

    def __init__(self, after_s=None):
        super().__init__()
        self.s = nonzero_biases(paddle.nn.Linear(D, D))
        self.c = nonzero_biases(paddle.nn.Linear(D, D))
        self.d = nonzero_biases(paddle.nn.Linear(D, D))
        self.after_s = after_s

    def forward(self, h):
        a = self.s(h)
        if self.after_s is not None:
            a = self.after_s(a)
        return self.d(paddle.tanh(self.c(paddle.tanh(a))))


@pytest.mark.parametrize("after_s", [None, "scale_"])
@pytest.mark.parametrize("mode", MODES)
def test_linears_after_a_kept_sublayer_get_their_own_outputs(fresh_plans, mode, after_s):
    """A plan that keeps sublayer ``s`` whole and the outputs of ``c`` and ``d``: the replay
    skips ``s`` and its linear, so had the forward counted that linear, ``c`` would take its
    (empty) entry and ``d`` would take ``c``'s output -- the same shapes: a wrong gradient.
    With ``s``'s output changed in place, the replay runs ``s`` after all: its linear must
    not take ``c``'s entry either."""

    def make():
        return _Chain(after_s and IN_PLACE[after_s])

    ref = policy_runs.train(make, "none", None, STEPS, rows=ROWS, d=D)
    planned = policy_mod.resolve("budget:0.5")
    kind = _gemm_kind(planned.planner, budget._kind(make()), ("s", "c", "d"), ())
    kind.chosen = ("s", "gemm:c.weight", "gemm:d.weight")
    got = policy_runs.train(make, mode, "budget:0.5", STEPS, rows=ROWS, d=D)
    assert_identical(got, ref)
    counters = stats.snapshot()["policy"]["budget:0.5"]
    assert counters["sublayers_not_recomputed"] == (0 if after_s else STEPS)
    assert counters["gemms_not_recomputed"] == 2 * STEPS
    if after_s is None:  # kept bytes: s's (as save:s keeps them) and c's and d's outputs
        nets = []

        def make_kept(nets=nets):
            nets.append(make())
            return nets[-1]

        def c_and_d(call, nets=nets):
            return call.weight is nets[-1].c.weight or call.weight is nets[-1].d.weight

        policy_runs.train(make_kept, mode, "save:s", STEPS, rows=ROWS, d=D)
        policy_runs.train(make_kept, mode, c_and_d, STEPS, rows=ROWS, d=D)
        snap = stats.snapshot()["policy"]
        both = snap["save:s"]["kept_bytes"] + snap["c_and_d"]["kept_bytes"]
        assert counters["kept_bytes"] == both > snap["save:s"]["kept_bytes"] > 0


@pytest.mark.parametrize("op", ["add_", "relu_"])
def test_a_linear_whose_output_is_changed_in_place_is_no_candidate(fresh_plans, op):
    """The MLP's output (its ``down`` linear's) is changed in place after it: it cannot be kept
    (``gemm`` would drop it), so the plan never counts it."""
    ref = policy_runs.train(lambda: Decoder(after=IN_PLACE[op]), "none", None, STEPS, rows=ROWS)
    got = policy_runs.train(
        lambda: Decoder(after=IN_PLACE[op]), "non_reentrant", "budget:1", STEPS, rows=ROWS
    )
    assert_identical(got, ref)
    measured = stats.snapshot()["plans"]["budget:1"]["Decoder"]["measured"]
    assert "gemm:mlp.down.weight" not in measured and "gemm:mlp.up.weight" in measured


def test_measured_gemm_bytes_are_what_gemm_keeps(fresh_plans):
    """A linear's measured bytes equal what ``gemm`` keeps of it (``kept_bytes`` of a policy
    that keeps that weight's outputs only), and its seconds are a time (> 0)."""
    train("non_reentrant", "budget:0.5")
    measured = stats.snapshot()["plans"]["budget:0.5"]["Decoder"]["measured"]
    for path in ("self_attn.q_proj", "mlp.gate", "mlp.down"):
        stats.reset()
        nets = []

        def make(nets=nets):
            nets.append(Decoder())
            return nets[-1]

        def only(call, path=path, nets=nets):
            return call.weight is dict(nets[-1].named_sublayers())[path].weight

        policy_runs.train(make, "non_reentrant", only, 1, rows=ROWS, d=D)
        kept = stats.snapshot()["policy"]["only"]["kept_bytes"]
        assert kept == measured[f"gemm:{path}.weight"]["bytes"] > 0, path
        assert measured[f"gemm:{path}.weight"]["seconds"] > 0


class _Mixed(paddle.nn.Layer):
    """One class, two structures under the same sublayer name (DeepSeek's dense first layers and
    its mixture-of-experts ones): ``mlp`` is one linear or an :class:`decoder.MLP`."""

    def __init__(self, wide):
        super().__init__()
        self.norm = paddle.nn.LayerNorm(D)
        self.mlp = Decoder().mlp if wide else nonzero_biases(paddle.nn.Linear(D, D))

    def forward(self, h):
        return paddle.tanh(self.mlp(self.norm(h)))


def test_layers_of_one_class_with_other_parameters_are_planned_apart(fresh_plans):
    """Each structure is its own kind, measured and planned on its own calls; both plans are
    reported (the second under ``_Mixed#2``), and the runs stay bit-identical to no recompute."""

    def run(policy):
        paddle_mgrad.enable(recompute=True, fused_linear=True)
        try:
            paddle.seed(11)
            layers = [_Mixed(False), _Mixed(True)]
            grads = []
            for step in range(2 * STEPS):
                paddle.seed(100 + step)
                h = paddle.randn([ROWS, D])
                h.stop_gradient = False
                for layer in layers:
                    h = (
                        layer(h)
                        if policy is None
                        else paddle_mgrad.recompute(layer, h, use_reentrant=False, policy=policy)
                    )
                h.sum().backward()
            for layer in layers:
                grads += [p.grad.numpy() for p in layer.parameters()]
            return grads
        finally:
            paddle_mgrad.disable()

    ref, got = run(None), run("budget:1")
    assert all((a == b).all() for a, b in zip(ref, got)) and len(ref) == len(got) > 0
    plans = stats.snapshot()["plans"]["budget:1"]
    assert sorted(plans) == ["_Mixed", "_Mixed#2"], plans
    assert "gemm:mlp.weight" in plans["_Mixed"]["measured"]
    assert "gemm:mlp.up.weight" in plans["_Mixed#2"]["measured"]
    assert "gemm:mlp.weight" not in plans["_Mixed#2"]["measured"]


class _Clock:
    """``time.perf_counter`` advancing one second per reading: each timed call lasts 1 s."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


class _Twice(paddle.nn.Layer):
    """One linear applied twice (a tied weight), then another: no sublayer but the linears."""

    def __init__(self):
        super().__init__()
        self.lin = nonzero_biases(paddle.nn.Linear(D, D))
        self.out = nonzero_biases(paddle.nn.Linear(D, D))

    def forward(self, h):
        return self.out(paddle.tanh(self.lin(paddle.tanh(self.lin(h)))))


def test_a_weight_used_twice_is_measured_as_both_calls(fresh_plans, monkeypatch):
    """Seconds and bytes of a linear's candidate are summed over the calls with its weight:
    with a clock that makes each timed call last 1 s, ``lin`` (two calls) measures 2 s and
    twice its output, ``out`` 1 s and its output."""
    from paddle_mgrad.autograd import recomputing

    monkeypatch.setattr(recomputing.time, "perf_counter", _Clock())
    monkeypatch.setattr(budget, "MEASURED_CALLS", 1)
    policy_runs.train(_Twice, "non_reentrant", "budget:1", 2, rows=ROWS, d=D)  # (planned in 2)
    measured = stats.snapshot()["plans"]["budget:1"]["_Twice"]["measured"]
    row = ROWS * D * 4  # one [ROWS, D] fp32 output
    assert measured["gemm:lin.weight"] == {"seconds": 2.0, "bytes": 2 * row}
    assert measured["gemm:out.weight"] == {"seconds": 1.0, "bytes": row}


class _OwnWeight(paddle.nn.Layer):
    """A Layer with a parameter of its own and no sublayer."""

    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([D, D])

    def forward(self, h):
        return paddle.tanh(paddle.nn.functional.linear(h, self.w))


class _NoParameters(paddle.nn.Layer):
    """Sublayers without parameters; one of them called with no tensor at all."""

    def __init__(self):
        super().__init__()
        self.act = paddle.nn.Tanh()
        self.const = _Const()

    def forward(self, h):
        return self.act(h) * self.const()


class _Const(paddle.nn.Layer):
    def forward(self):
        return paddle.full([1], 0.5)


@pytest.mark.parametrize("make, candidate", [(_OwnWeight, "gemm:w"), (_NoParameters, "act")])
def test_a_layer_without_sublayers_or_parameters_is_still_planned(
    fresh_plans, monkeypatch, make, candidate
):
    """A block Layer with a parameter but no sublayer (its linear is the candidate), or with
    sublayers but no parameter (a sublayer called without any tensor is timed too): measured
    and planned, bit-identical."""
    policy_runs.never_the_last_block(monkeypatch)  # (each step's one block: kept whole else)
    ref = policy_runs.train(make, "none", None, STEPS, rows=ROWS, d=D)
    got = policy_runs.train(make, "non_reentrant", "budget:1", STEPS, rows=ROWS, d=D)
    assert_identical(got, ref)
    plan = stats.snapshot()["plans"]["budget:1"][make.__name__]
    assert candidate in plan["chosen"], plan


class _Stack(paddle.nn.Layer):
    """Three decoder layers, each a recompute block of its own while ``recompute`` is set (as
    a model's layers are): three blocks alive at once until backward, under the policy of
    ``PADDLE_MGRAD_RECOMPUTE_POLICY``."""

    def __init__(self, recompute):
        super().__init__()
        self.layers = paddle.nn.LayerList([Decoder() for _ in range(3)])
        self.recompute = recompute

    def forward(self, h):
        for layer in self.layers:
            if self.recompute:
                h = paddle_mgrad.recompute(custom_forward(layer), h, use_reentrant=False)
            else:
                h = layer(h)
        return h


def test_a_step_of_several_blocks_is_planned_for_all_of_them_alive(fresh_plans, monkeypatch):
    """Three blocks per step: the first step measures all three (no backward seen before its
    end), the plan is made at the second step's first call for three blocks alive at once
    and what the step holds outside them, and every call after runs it -- bit-identical to no
    recompute.  (The step's last block kept whole: test_last_block.py.)"""
    policy_runs.never_the_last_block(monkeypatch)
    steps = 3
    ref = policy_runs.train(lambda: _Stack(False), "none", None, steps, rows=ROWS, d=D)
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", "budget:0.9")
    got = policy_runs.train(lambda: _Stack(True), "none", None, steps, rows=ROWS, d=D)
    assert_identical(got, ref)
    plan = stats.snapshot()["plans"]["budget:0.9"]["Decoder"]
    assert (plan["live_blocks"], plan["measured_calls"]) == (3, 3), plan
    assert plan["input_bytes"] == ROWS * D * 4  # (the hidden state each block is handed)
    a, i, o = plan["block_bytes"], plan["input_bytes"], plan["outside_bytes"]
    assert o > 0  # (the host's allocator read: the loss and the gradients are outside)
    assert plan["chosen"]
    assert abs(plan["budget_bytes"] - (0.9 * (o + 3 * (a + i)) - o - 3 * i - a)) < 2
    planned = 3 * (steps - 1)
    gemms = sum(n.startswith("gemm:") for n in plan["chosen"])  # (one linear per weight)
    counters = stats.snapshot()["policy"]["budget:0.9"]
    # (the measured step keeps its last block whole: what that costs is measured so)
    assert counters["calls"] == counters["replays"] + 1 == 3 * steps
    assert counters["blocks_kept_whole"] == 1
    assert counters["gemms_not_recomputed"] == planned * gemms
    assert counters["sublayers_not_recomputed"] == planned * (len(plan["chosen"]) - gemms)


class _Shared(paddle.nn.Layer):
    """A block whose one activation is saved three times: by tanh (its output) and by the
    multiply (both operands)."""

    def __init__(self):
        super().__init__()
        self.lin = nonzero_biases(paddle.nn.Linear(D, D))

    def forward(self, h):
        y = paddle.tanh(self.lin(h))
        return y * y


def test_a_buffer_saved_by_several_ops_is_counted_once(fresh_plans, monkeypatch):
    """The block's activation bytes are those of the buffers its ops save, each once: here
    tanh's output, saved three times (the linear saves the block's argument and its weight,
    kept anyway)."""
    monkeypatch.setattr(budget, "MEASURED_CALLS", 1)
    policy_runs.train(_Shared, "non_reentrant", "budget:1", 2, rows=ROWS, d=D)
    plan = stats.snapshot()["plans"]["budget:1"]["_Shared"]
    assert plan["block_bytes"] == ROWS * D * 4, plan
