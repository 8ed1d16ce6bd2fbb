"""Differential fuzzer: recompute (ours, both modes) against the same model without recompute.

hypothesis draws small models and training-loop call patterns (:mod:`recompute_fuzz`):
inputs needing a gradient none / some / all, parameters frozen and trainable (toggled
between micro-steps), tied weights, a layer used twice, ``paddle.no_grad()`` regions,
non-tensor positional and keyword arguments, tensor / tuple-with-None / dict outputs,
outputs that are the block's inputs or views of them, nested recompute of the other mode,
dropout with and without ``preserve_rng_state``, in-place ops on a linear's output (fleet's
in-place all-reduce among them), on intermediate values and on the block's own input,
micro-batch accumulation into ``main_grad``, ``MixPrecisionLayer`` on none / part / all of
the model, fused linear on/off, recompute policy ``full``, ``gemm`` (the fused linears'
outputs kept from the forward), ``save:`` (sublayers kept whole) or ``budget:`` (sublayers
kept by a measured plan).  Every output of every
step, every input gradient and every parameter's ``.grad`` and ``main_grad`` must equal the
run without recompute.

Allowed exceptions: where ours raises, Paddle's own recompute (unpatched, same pattern,
``preserve_rng_state=False``) must raise the same exception type (a reentrant block
returning a dict: Paddle's PyLayer refuses it).  Dropout without ``preserve_rng_state``
runs with ``determinism_check="values"``: a :class:`~paddle_mgrad.RecomputeError` or equal
results.  A reentrant block that changes its own input in place: our
:class:`~paddle_mgrad.RecomputeError` saying so, or equal results (plain Paddle raises an
in-place error there, or computes wrong gradients).  After every case that raised, grad mode
must be on and a clean training in the same process must equal its run without recompute.

Each example's outcome (``equal``, ``value_check``, ``raises_as_paddle``,
``refused_input_change``) is counted per mode and per policy (and shown by hypothesis' statistics as an
event); at least :data:`EQUAL_FLOOR` of each mode's and each policy's examples must compare values, so a
generator drifting towards raising cases cannot stay green while comparing little.

CI: a fixed derandomized sequence of ``PADDLE_MGRAD_FUZZ_EXAMPLES`` examples (default 1200,
about a minute per Paddle version on 2 cores).  A long run: ``PADDLE_MGRAD_FUZZ_EXAMPLES=4000
PADDLE_MGRAD_FUZZ_SEED=24`` (another sequence; command and result in docs/development.md).  A
failure prints the drawn :class:`recompute_fuzz.Case`: paste it into a named regression test.
"""

import collections
import os
import re

import paddle
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from recompute_fuzz import POLICIES, Case, cases, differences, expects_value_check, run_case

from paddle_mgrad import RecomputeError, stats

EXAMPLES = int(os.environ.get("PADDLE_MGRAD_FUZZ_EXAMPLES", "1200"))
#: a hypothesis seed for a run off CI's fixed sequence (unset: derandomized, as CI)
SEED = os.environ.get("PADDLE_MGRAD_FUZZ_SEED")
#: the least share of each mode's examples that must end in a comparison of values
EQUAL_FLOOR = 0.75

#: a case that trains cleanly in both modes: the step after a case that raised
CLEAN = Case(
    mode="non_reentrant",
    fused=True,
    preserve_rng=True,
    x0_source="pre",
    x1_grad=True,
    pair_grad=None,
    ops=("lin_a", "ip_linear", "tanh"),
    out="tensor",
    tied=False,
    mix="lin_a",
    frozen=((False,) * 7, (False,) * 7),
    nested_mode="reentrant",
    scale=1.0,
    shift_kw=0.0,
    seed=5,
    in_place="mp_allreduce",
)
_clean_refs: dict = {}


def _gist(error):
    """An exception's type and first line, without tensor/PyLayer names and source places."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = re.sub(r"\(at [^)]*\)", "", text)
    text = re.sub(r"\b(_ReentrantRecompute|RecomputeFunction)\s*:\s*", "", text)
    text = re.sub(r"\w*tensor\w*_\d+|eager_in_tmp_\d+", "T", text)
    return type(error).__name__, text.strip()


def assert_clean_after_error(case):
    """After a case that raised: grad mode is on, and the next training in this process equals
    a fresh one (nothing of the failed step -- hooks, recomputation state, RNG, the op -- left
    behind)."""
    assert paddle.is_grad_enabled(), f"{case}: grad mode left off after the error"
    mode = case.mode
    clean = Case(**{**CLEAN.__dict__, "mode": mode, "policy": case.policy})
    if mode not in _clean_refs:  # (the run without recompute: the same for every policy)
        _clean_refs[mode] = run_case(clean, "none")
    try:
        got = run_case(clean, mode)
    except Exception as e:
        raise AssertionError(f"after {case} raised, a clean training raised too: {e!r}") from e
    problems = differences(got, _clean_refs[mode])
    assert not problems, f"after {case} raised, a clean training differs: " + "; ".join(
        problems[:8]
    )


def check_case(case):
    """The oracle (module docstring); returns the outcome, raises AssertionError naming what
    differs."""
    try:
        ref = run_case(case, "none")
    except Exception as e:  # pragma: no cover - the generator builds valid models
        raise AssertionError(f"the model without recompute failed: {e!r}") from e
    try:
        got = run_case(case, case.mode)
    except RecomputeError as e:
        assert_clean_after_error(case)
        if expects_value_check(case):
            return "value_check"
        # (a policy runs reentrant calls non-reentrant: the block's activations are kept)
        if (
            case.mode == "reentrant"
            and case.policy == "full"
            and case.changes_input
            and "changed its tensor argument #" in str(e)
        ):
            return "refused_input_change"
        raise
    except Exception as e:
        assert_clean_after_error(case)
        try:
            run_case(case, "native")
        except Exception as native:
            if _gist(native) == _gist(e):
                return "raises_as_paddle"
            raise AssertionError(
                f"{case}: ours raised {e!r}; Paddle's own recompute raises "
                f"something else: {native!r}"
            ) from e
        raise AssertionError(f"{case}: ours raised {e!r}; Paddle's own recompute does not") from e
    assert paddle.is_grad_enabled(), f"{case}: grad mode left off"
    problems = differences(got, ref)
    assert not problems, f"{case}: " + "; ".join(problems[:8])
    return "equal"


def fuzz(
    examples,
    derandomize=True,
    seed_value=None,
    report_multiple_bugs=True,
    policies=POLICIES,
    ops_with=(),
):
    """Run the oracle on ``examples`` drawn cases (under one of ``policies``; every block with
    ``ops_with``, see :func:`recompute_fuzz.cases`); returns the outcome counts by mode."""
    outcomes = collections.Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=report_multiple_bugs,
    )
    @given(case=cases(policies, ops_with))
    def run(case):
        outcome = check_case(case)
        event(f"{case.mode}: {outcome}")
        event(f"policy {case.policy}: {outcome}")
        outcomes[case.mode, outcome] += 1
        outcomes["policy " + case.policy, outcome] += 1

    if seed_value is not None:
        run = seed(seed_value)(run)
    run()
    return outcomes


def test_recompute_equals_no_recompute():
    stats.reset()
    outcomes = fuzz(EXAMPLES, SEED is None, None if SEED is None else int(SEED))
    print(f"\nMEASURED fuzzer outcomes over {EXAMPLES} examples: {dict(outcomes)}")
    # every policy that keeps something kept something in its examples (not only full again)
    spared = stats.snapshot()["policy"]
    print(f"MEASURED fuzzer policy counters: {spared}")
    # (budget:0.5: in blocks this small a sublayer's output alone often costs more than half
    # the block's activations, so its plans may keep nothing)
    for policy in set(POLICIES) - {"full", "budget:0.5"}:
        what = "gemms_not_recomputed" if policy == "gemm" else "sublayers_not_recomputed"
        assert spared[policy][what] > 0, (policy, spared)
    # budget:1's plans (one block alive at a time here: recompute_fuzz.run_case) keep linear
    # outputs too, not only sublayers
    assert spared["budget:1"]["gemms_not_recomputed"] > 0, spared
    # budget:0.5's plans keep a step's last block whole (every example's last block call)
    assert spared["budget:0.5"]["blocks_kept_whole"] > 0, spared
    for mode in ("reentrant", "non_reentrant", *("policy " + p for p in POLICIES)):
        total = sum(n for (m, _), n in outcomes.items() if m == mode)
        drawn = 2 if mode in ("reentrant", "non_reentrant") else len(POLICIES)
        assert total >= EXAMPLES // (2 * drawn), (mode, dict(outcomes))
        assert outcomes[mode, "equal"] >= EQUAL_FLOOR * total, (mode, dict(outcomes))
    # the in-place kinds are drawn: the cases that change the block's input compare values in
    # the non-reentrant mode (kept activations) and are refused, by name, in the reentrant one
    assert outcomes["reentrant", "refused_input_change"] > 0, dict(outcomes)


def test_the_fuzzer_finds_a_leaf_output_of_the_replayed_linear(monkeypatch):
    """The fuzzer's own mutation check: with the replayed linear's output a leaf that needs a
    gradient again (what once stopped tensor parallelism and 7 of 11 PaddleFormers families),
    the fuzzer finds Paddle's in-place refusal by itself, within CI's first examples."""
    from paddle_mgrad import linear
    from paddle_mgrad._compat import tracer

    def leaf_output(x, weight, bias, pack):
        tr = tracer()
        tr._has_grad = False
        try:
            y = linear._paddle_linear(x, weight, bias)
        finally:
            tr._has_grad = True
        pack(x)
        y.stop_gradient = False
        return y

    monkeypatch.setattr(linear, "_recomputed_linear", leaf_output)
    with pytest.raises(AssertionError, match="can't use inplace strategy"):
        fuzz(min(EXAMPLES, 300), report_multiple_bugs=False)


def test_the_oracle_sees_a_lost_gradient(monkeypatch):
    """The fuzzer's own mutation check: a case with a data input and the parameter argument
    ``extra`` frozen too passes, and fails again once the reentrant path stops noticing that
    no argument needs a gradient."""
    from paddle_mgrad.recomputation import reentrant

    case = Case(
        mode="reentrant",
        fused=True,
        preserve_rng=True,
        x0_source="data",
        x1_grad=None,
        pair_grad=None,
        ops=("lin_a", "tanh"),
        out="tensor",
        tied=False,
        mix="all",
        frozen=((False,) * 6 + (True,),) * 2,
        nested_mode="reentrant",
        scale=1.0,
        shift_kw=0.0,
        seed=0,
    )
    assert check_case(case) == "equal"
    monkeypatch.setattr(reentrant, "any_needs_grad", lambda obj: True)
    with pytest.raises(AssertionError, match="lin_a.weight.main_grad"):
        check_case(case)


def test_the_fuzzer_finds_a_kept_output_changed_in_place(monkeypatch):
    """The fuzzer's own mutation check for policies: when the gemm policy hands back a linear's
    output that the forward changed in place afterwards (the all-reduce or ``add_`` then runs
    twice on it in the recomputation), the fuzzer finds the wrong gradients by itself."""
    from paddle_mgrad.autograd import recomputing

    monkeypatch.setattr(recomputing.KeptOutputs, "unchanged", staticmethod(lambda t, v: True))
    with pytest.raises(AssertionError, match=r"policy=.gemm.*max abs diff"):
        fuzz(
            min(EXAMPLES, 300),
            report_multiple_bugs=False,
            policies=("gemm",),
            ops_with=("ip_linear",),
        )


def test_the_fuzzer_finds_a_kept_sublayer_output_changed_in_place(monkeypatch):
    """The same for ``save:``: when a kept sublayer whose output the forward changed in place
    afterwards is skipped in the recomputation (its held output already carries the change),
    the fuzzer finds the wrong gradients by itself."""
    from paddle_mgrad.recomputation import saved_sublayers

    monkeypatch.setattr(saved_sublayers._Region, "unchanged", lambda self: True)
    with pytest.raises(AssertionError, match=r"policy=.save:.*max abs diff"):
        fuzz(
            min(EXAMPLES, 300),
            report_multiple_bugs=False,
            policies=("save:Linear",),  # (ip_linear's linear is lin_b)
            ops_with=("ip_linear",),
        )
