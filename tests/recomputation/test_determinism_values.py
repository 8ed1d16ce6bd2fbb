"""determinism_check="values": same shapes, different values in recomputation -> RecomputeError.

Each non-deterministic block below saves tensors of the same shapes and dtypes in
the forward and in recomputation, so the default shape check (like torch's
CheckpointError and Paddle) lets it through with silently inconsistent gradients;
that is asserted too, to document what "values" adds.
"""

import gc
import weakref

import numpy as np
import paddle
import pytest

import paddle_mgrad
from paddle_mgrad import RecomputeError
from paddle_mgrad.errors import EnvError
from paddle_mgrad.recomputation import non_reentrant, tensors
from paddle_mgrad.recomputation.api import ENV_DETERMINISM_CHECK
from paddle_mgrad.recomputation.tensors import fingerprint, fingerprint_mismatch
from userlayers import Block

MODES = [False, True]  # use_reentrant


@pytest.fixture(autouse=True)
def _fresh_sample_weights():
    """Each test makes the fingerprint's sample weights itself: they are cached per (place,
    size), and mutation testing forks each mutant from a process whose cache the tests filled
    (a mutant of the code that makes them would otherwise never run)."""
    tensors._weights.clear()


def _unseeded_random():
    def fn(x):  # a random op whose state is not replayed (preserve_rng_state=False)
        return paddle.tanh(x * paddle.rand(x.shape))

    return fn, {"preserve_rng_state": False}


def _mutated_global():
    scale = {"v": 1.0}

    def fn(x):
        out = paddle.tanh(x * scale["v"])
        scale["v"] += 1.0  # e.g. a schedule stepped between forward and backward
        return out

    return fn, {}


def _data_dependent_slice():
    calls = []
    big = paddle.randn([4, 8])

    def fn(x):
        calls.append(1)
        k = len(calls) % 2  # a different window each time it runs, same shape
        return paddle.tanh(x * big[k : k + 2])

    return fn, {}


CASES = {
    "unseeded_random": _unseeded_random,
    "mutated_global": _mutated_global,
    "data_dependent_slice": _data_dependent_slice,
}


def _run(case, use_reentrant, **kw):
    paddle.seed(5)
    fn, extra = CASES[case]()
    x = paddle.randn([2, 8])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(fn, x, use_reentrant=use_reentrant, **extra, **kw)
    (y * y).sum().backward()
    return x.grad.numpy()


@pytest.mark.parametrize("use_reentrant", MODES, ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_values_check_catches_what_shapes_check_misses(case, use_reentrant):
    with pytest.raises(RecomputeError) as e:
        _run(case, use_reentrant, determinism_check="values")
    msg = str(e.value)
    assert "is not deterministic" in msg and "has different values" in msg
    assert " in the forward, " in msg and " in recomputation" in msg
    if use_reentrant:
        assert "output #0 (forward name '" in msg
    else:
        assert "saved tensor #" in msg and "(forward name '" in msg and "shape=[2, 8]" in msg
    assert paddle.framework._dygraph_tracer()._has_grad
    # the default shape check does not see it (documented: that is what "values" is for)
    _run(case, use_reentrant)
    _run(case, use_reentrant, determinism_check="shapes")


@pytest.mark.parametrize("use_reentrant", MODES, ids=["non_reentrant", "reentrant"])
def test_values_check_silent_and_same_grads_when_deterministic(use_reentrant):
    """Dropout with preserve_rng_state=True replays bit for bit: no false alarm, and
    the gradients equal the unchecked run's."""
    grads = {}
    for check in ("shapes", "values", "none"):
        paddle.seed(9)
        blk = Block(bias=True, dropout=0.4)
        x = paddle.randn([3, 8])
        x.stop_gradient = False
        y = paddle_mgrad.recompute(blk, x, use_reentrant=use_reentrant, determinism_check=check)
        (y * y).sum().backward()
        grads[check] = [x.grad.numpy()] + [p.grad.numpy() for p in blk.parameters()]
    for check in ("values", "none"):
        for a, b in zip(grads["shapes"], grads[check]):
            assert np.array_equal(a, b)


def test_environment_variable_read_at_call_time(monkeypatch):
    monkeypatch.setenv(ENV_DETERMINISM_CHECK, "values")
    with pytest.raises(RecomputeError, match="has different values"):
        _run("mutated_global", False)
    _run("mutated_global", False, determinism_check="shapes")  # the argument wins
    monkeypatch.setenv(ENV_DETERMINISM_CHECK, "shapes")
    _run("mutated_global", False)
    monkeypatch.setenv(ENV_DETERMINISM_CHECK, "bogus")
    x = paddle.randn([2])
    x.stop_gradient = False
    # read through paddle_mgrad.env (its table names the accepted values)
    with pytest.raises(
        EnvError, match=f"{ENV_DETERMINISM_CHECK}='bogus' is not valid; accepted: shapes"
    ):
        paddle_mgrad.recompute(paddle.tanh, x, use_reentrant=False)
    with pytest.raises(ValueError, match="determinism_check='shape': expected one of"):
        paddle_mgrad.recompute(paddle.tanh, x, use_reentrant=False, determinism_check="shape")


def test_environment_variable_reaches_paddles_own_recompute(monkeypatch):
    """Trainers call Paddle's recompute: with enable(), the env var alone switches it on."""
    from paddle.distributed.fleet.utils import recompute as native_recompute

    monkeypatch.setenv(ENV_DETERMINISM_CHECK, "values")
    paddle_mgrad.enable(recompute=True)
    try:
        fn, _ = _mutated_global()
        x = paddle.randn([2, 8])
        x.stop_gradient = False
        y = native_recompute(fn, x, use_reentrant=False)
        with pytest.raises(RecomputeError, match="has different values"):
            y.sum().backward()
    finally:
        paddle_mgrad.disable()


def test_none_skips_the_shape_check_too():
    calls = []

    def fn(x):
        calls.append(1)
        h = paddle.tanh(x)
        if len(calls) == 1:
            h = paddle.tanh(h)  # the forward saves one tensor more than recomputation
        return h.sum()

    x = paddle.randn([4])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(fn, x, use_reentrant=False, determinism_check="none")
    try:
        y.backward()  # no RecomputeError from the check (Paddle may still fail on its own)
    except RecomputeError as e:
        assert "was not reproduced" in str(e)  # the defensive error, not the check's
    except Exception:  # noqa: BLE001
        pass
    paddle.framework._dygraph_tracer()._has_grad = True


def test_none_lets_a_recomputation_save_more_than_the_forward():
    """``"none"``: a recomputation that saves tensors the forward did not is no error (nothing
    of the extra ones is handed to backward), and the gradients are the forward's."""
    calls = []

    def fn(x):
        calls.append(1)
        h = paddle.tanh(x)
        if len(calls) > 1:
            paddle.tanh(h * 2.0)  # saved, and used by nothing
        return h.sum()

    x = paddle.randn([4])
    x.stop_gradient = False
    paddle_mgrad.recompute(fn, x, use_reentrant=False, determinism_check="none").backward()
    np.testing.assert_allclose(x.grad.numpy(), 1 - np.tanh(x.numpy()) ** 2, rtol=1e-6, atol=1e-6)


def test_values_check_names_the_first_three_tensors_that_differ():
    """Four recomputed tensors with other values than the forward's: the error names three."""
    scale = {"v": 1.0}

    def fn(x):
        h = x * scale["v"]
        for _ in range(4):
            h = paddle.tanh(h)  # each saves its output: all four differ in recomputation
        scale["v"] += 1.0
        return h.sum()

    x = paddle.randn([4])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(fn, x, use_reentrant=False, determinism_check="values")
    with pytest.raises(RecomputeError) as e:
        y.backward()
    assert str(e.value).count("has different values") == 3, str(e.value)


def test_fingerprints_only_for_recomputed_tensors_and_freed_with_frame(monkeypatch):
    frames = []
    orig_init = non_reentrant._Frame.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        frames.append(weakref.ref(self))

    monkeypatch.setattr(non_reentrant._Frame, "__init__", init)
    paddle.seed(2)
    blk = Block(bias=True)
    x = paddle.randn([3, 8])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(blk, x, use_reentrant=False, determinism_check="values")
    frame = frames[-1]()
    alive = [h() for h in frame.holders]
    kept = {h.index for h in alive if h is not None and h.kept}
    dropped = {h.index for h in alive if h is not None and not h.kept}
    assert kept and dropped  # parameters/x are kept, activations dropped
    assert set(frame.prints) == dropped  # no fingerprint for kept holders
    assert all(fp.shape == [4] and fp.dtype == paddle.float64 for _, fp in frame.prints.values())
    del frame, alive
    y.sum().backward()
    del y
    gc.collect()
    assert frames[-1]() is None, "the frame (and its fingerprints) outlived the graph"


def test_fingerprint_sees_permutations_and_small_changes():
    x = paddle.randn([64, 33])
    base = fingerprint(x).numpy()
    assert fingerprint_mismatch(base, fingerprint(x.clone()).numpy()) is None
    assert fingerprint_mismatch(base, fingerprint(x.flip(0)).numpy()) is not None  # permuted
    # two sampled elements swapped: sum, sum of squares and the sample's plain sum stay equal;
    # only the position weights see it
    flat = np.full([2048], 1e-3, dtype="float32")  # sample step 2: elements 0, 2, 4, ...
    flat[0], flat[2] = 5.0, -3.0
    swapped = flat.copy()
    swapped[[0, 2]] = swapped[[2, 0]]
    assert (
        fingerprint_mismatch(
            fingerprint(paddle.to_tensor(flat)).numpy(),
            fingerprint(paddle.to_tensor(swapped)).numpy(),
        )
        == 2
    )
    bumped = x.numpy().copy()
    bumped[7, 3] += 0.5
    assert fingerprint_mismatch(base, fingerprint(paddle.to_tensor(bumped)).numpy()) is not None
    for dt in ("int64", "bool", "float64"):
        assert fingerprint(x.astype(dt)).shape == [4]
    nan = paddle.to_tensor([1.0, float("nan")])
    assert fingerprint_mismatch(fingerprint(nan).numpy(), fingerprint(nan).numpy()) is None
    assert fingerprint(paddle.zeros([0, 4])).numpy().tolist() == [0.0] * 4


# -------------------------------------------------- non-finite and huge values
INF = float("inf")


def _runs(fn, use_reentrant, x):
    """fn's first call is the forward, later calls the recomputation."""
    xt = paddle.to_tensor(x, stop_gradient=False)
    y = paddle_mgrad.recompute(fn, xt, use_reentrant=use_reentrant, determinism_check="values")
    y.sum().backward()
    return xt.grad.numpy()


def _two_faced(first, later):
    """A block whose saved tensor (h, saved by the multiply) and output are ``first(x)`` in
    the forward and ``later(x)`` in recomputation."""
    calls = []

    def fn(x):
        calls.append(1)
        h = (first if len(calls) == 1 else later)(x)
        return h * x  # saves h (and x)

    return fn


def _with(values):
    """x -> x * 1 with some entries replaced by ``values`` ({flat index: value})."""

    def make(x):
        mask = np.zeros(x.shape, "float32")
        fill = np.zeros(x.shape, "float32")
        for i, v in values.items():
            mask.flat[i] = 1.0
            fill.flat[i] = v
        m, f = paddle.to_tensor(mask), paddle.to_tensor(fill)
        return paddle.where(m > 0, f, x * 1.0)

    return make


LEGIT = {
    "minus_inf": _with({3: -INF}),  # an attention mask's -inf
    "plus_and_minus_inf": _with({1: INF, 6: -INF}),  # sums are NaN in both runs
    "nan": _with({2: float("nan")}),
    "near_1e20": lambda x: x * 1e20,  # fp32 sum of squares overflows to inf
}


@pytest.mark.parametrize("use_reentrant", MODES, ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("case", sorted(LEGIT))
def test_values_check_no_false_alarm_on_non_finite_or_huge_values(case, use_reentrant):
    """The same non-finite / huge values in the forward and in recomputation: no
    RecomputeError ("sum -inf in the forward, -inf in recomputation" was raised: inf - inf
    is NaN), and the gradients equal an unchecked run's."""
    x = np.random.RandomState(1).standard_normal([2, 8]).astype("float32")
    make = LEGIT[case]
    got = _runs(_two_faced(make, make), use_reentrant, x)
    ref = paddle.to_tensor(x, stop_gradient=False)
    (make(ref) * ref).sum().backward()
    np.testing.assert_array_equal(got, ref.grad.numpy())


REAL = {
    "nan_appears": (_with({3: -INF}), _with({3: -INF, 5: float("nan")})),
    "inf_changes_sign": (_with({3: INF}), _with({3: -INF})),
    "two_infs_swap_signs": (_with({0: INF, 1: -INF}), _with({0: -INF, 1: INF})),
    "inf_appears": (_with({}), _with({4: INF})),
    "value_changes_near_1e20": (lambda x: x * 1e20, lambda x: x * 1e20 * 1.01),
    "nan_moves": (_with({2: float("nan")}), _with({4: float("nan")})),
}


@pytest.mark.parametrize("use_reentrant", MODES, ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("case", sorted(REAL))
def test_values_check_still_sees_real_differences_among_non_finite_values(case, use_reentrant):
    x = np.random.RandomState(1).standard_normal([2, 8]).astype("float32")
    first, later = REAL[case]
    with pytest.raises(RecomputeError, match="has different values"):
        _runs(_two_faced(first, later), use_reentrant, x)
    paddle.framework._dygraph_tracer()._has_grad = True


def test_fingerprint_mismatch_rules_for_non_finite_fields():
    f = np.array
    assert fingerprint_mismatch(f([-INF, INF, 1.0, 0.0]), f([-INF, INF, 1.0, 0.0])) is None
    assert fingerprint_mismatch(f([np.nan, 1.0, 1.0, 0.0]), f([np.nan, 1.0, 1.0, 0.0])) is None
    assert fingerprint_mismatch(f([INF, 1.0, 1.0, 0.0]), f([-INF, 1.0, 1.0, 0.0])) == 0
    assert fingerprint_mismatch(f([INF, 1.0, 1.0, 0.0]), f([3e38, 1.0, 1.0, 0.0])) == 0
    assert fingerprint_mismatch(f([1.0, np.nan, 1.0, 0.0]), f([1.0, 2.0, 1.0, 0.0])) == 1
    assert fingerprint_mismatch(f([1.0, 1.0, 1.0, 0.0]), f([1.0, 1.0, 1.0, 5.0])) == 3


def test_fingerprint_tells_small_dropout_masks_apart():
    """Found by the recompute fuzzer: with position weights 1..n, two 0/1 masks with the same
    count and the same position sum ({1, 4} and {2, 3} of 8) would have equal fingerprints, so a
    dropout replayed without its RNG state would pass the values check with other gradients."""
    a = np.zeros([2, 4], dtype="float32")
    b = a.copy()
    a.reshape(-1)[[1, 4]] = 1
    b.reshape(-1)[[2, 3]] = 1
    fa, fb = (fingerprint(paddle.to_tensor(m)).numpy() for m in (a, b))
    assert fingerprint_mismatch(fa, fb) == 2
    # and every pair of different 8-element masks with 1..3 ones
    import itertools

    masks = [m for k in (1, 2, 3) for m in itertools.combinations(range(8), k)]
    prints = []
    for m in masks:
        t = np.zeros([8], dtype="float32")
        t[list(m)] = 1
        prints.append(fingerprint(paddle.to_tensor(t).astype("uint8")).numpy())
    for i, j in itertools.combinations(range(len(masks)), 2):
        assert fingerprint_mismatch(prints[i], prints[j]) is not None, (masks[i], masks[j])


def test_fingerprint_mismatch_tolerance_is_relative_to_the_larger_magnitude():
    """Finite fields agree within ``rtol`` times the larger magnitude (a GPU sum may differ in
    its last bits): at 1e6, a difference of 1 (1e-6 relative) is equal, 100 (1e-4) is not;
    near zero, only a difference of that relative size is."""
    f = np.array
    assert fingerprint_mismatch(f([1e6, 1.0, 1.0, 0.0]), f([1e6 + 1, 1.0, 1.0, 0.0])) is None
    assert fingerprint_mismatch(f([1e6, 1.0, 1.0, 0.0]), f([1e6 + 100, 1.0, 1.0, 0.0])) == 0
    assert fingerprint_mismatch(f([1e-3, 1.0, 1.0, 0.0]), f([1e-3 + 1e-9, 1.0, 1.0, 0.0])) is None
    assert fingerprint_mismatch(f([1e-3, 1.0, 1.0, 0.0]), f([1e-3 + 1e-7, 1.0, 1.0, 0.0])) == 0
    assert fingerprint_mismatch(f([1.0, 1.0, 1.0, 2.0]), f([1.0, 1.0, 1.0, 2.0]), rtol=0.0) is None
