"""numpy_rng: the fast snapshot of ``np.random`` against numpy's own get_state/set_state.

The reference is numpy itself: a state captured by ``numpy_rng.capture()`` and one by
``np.random.get_state()`` at the same moment must replay the same draws however the
generator moved in between (uniform draws that regenerate the key, normal draws that fill or
empty the legacy cache, reseeding); hypothesis draws those histories.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import paddle_mgrad  # noqa: F401  (the package's import order: zlib, paddle)
from paddle_mgrad.recomputation import numpy_rng, rng

# what a history step does to np.random
_STEPS = {
    "uniform": lambda n: np.random.rand(n),  # the key only (n > 624: regenerated)
    "normal": lambda n: np.random.randn(n),  # key and the normal-draw cache
    "one_normal": lambda n: np.random.standard_normal(),  # one value: the cache flips
    "seed": lambda n: np.random.seed(n),  # key reset, cache emptied
    "int": lambda n: np.random.randint(0, 1 << 30, size=n),
}
_history = st.lists(st.tuples(st.sampled_from(sorted(_STEPS)), st.integers(0, 1500)), max_size=6)


def _run(history):
    return [_STEPS[name](n) for name, n in history]


def _draws():
    """What a block would draw after the state was applied (a normal first: the cache)."""
    return (np.random.standard_normal(), np.random.rand(700), np.random.randn(3))


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture(autouse=True)
def _keep_global_state():
    state = np.random.get_state()
    yield
    np.random.set_state(state)


def test_the_fast_path_is_calibrated_on_this_numpy(monkeypatch):
    """On the numpys of the test sessions the calibration finds the layout: the fast path
    runs (else every snapshot is numpy's ~30 us get_state, still correct).  Calibrated afresh:
    a process calibrates once, at its first capture."""
    monkeypatch.setattr(numpy_rng, "_layout", numpy_rng._UNKNOWN)
    assert numpy_rng._fast_layout(np.random.mtrand._rand) is not None
    assert type(numpy_rng.capture()) is numpy_rng._Snapshot


def test_a_fast_snapshot_is_restored_by_the_fast_path(monkeypatch):
    """A snapshot taken by the fast path is written back by it (``_apply``) and, while numpy's
    normal cache still holds what the snapshot does, without numpy's ``set_state``."""
    assert numpy_rng._fast_layout(np.random.mtrand._rand) is not None  # (calibrated first)
    applied, legacy = [], []
    real_apply, real_legacy = numpy_rng._apply, numpy_rng._Snapshot.legacy
    monkeypatch.setattr(numpy_rng, "_apply", lambda *a: applied.append(1) or real_apply(*a))
    monkeypatch.setattr(
        numpy_rng._Snapshot, "legacy", lambda self: legacy.append(1) or real_legacy(self)
    )
    np.random.seed(5)
    snap = numpy_rng.capture()
    want = np.random.rand(700)  # the key moves (regenerated); the normal cache stays empty
    numpy_rng.restore(snap)
    np.testing.assert_array_equal(np.random.rand(700), want)
    assert (applied, legacy) == ([1], [])


def test_a_fast_snapshot_restored_without_a_layout_uses_numpy(monkeypatch):
    """The layout gone between capture and restore (the generator no longer the calibrated
    kind): numpy's ``set_state`` writes the snapshot."""
    np.random.seed(6)
    np.random.standard_normal()  # a normal cached
    snap = numpy_rng.capture()
    assert type(snap) is numpy_rng._Snapshot
    want = _draws()
    monkeypatch.setattr(numpy_rng, "_layout", None)
    numpy_rng.restore(snap)
    assert _same(_draws(), want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=_history, between=_history, seed=st.integers(0, 2**32 - 1))
def test_capture_restore_replays_like_numpy(before, between, seed):
    np.random.seed(seed)
    _run(before)
    ours, ref = numpy_rng.capture(), np.random.get_state()
    legacy = ours.legacy()
    assert np.array_equal(legacy[1], ref[1]) and legacy[2:] == tuple(ref[2:])
    _run(between)
    numpy_rng.restore(ours)
    got = _draws()
    np.random.set_state(ref)
    want = _draws()
    assert _same(got, want)
    # a snapshot replays the same draws every time (retain_graph: several recomputations)
    _run(between)
    numpy_rng.restore(ours)
    assert _same(_draws(), want)


def test_a_cached_normal_used_in_between_is_given_back():
    """One normal draw taken from the cache moves no key word: the MT19937 bytes are equal,
    only the cache differs -- the snapshot must still bring the cached value back."""
    np.random.seed(5)
    np.random.standard_normal()  # two values made, one cached
    snap = numpy_rng.capture()
    cached = np.random.standard_normal()  # the cached one; the key did not move
    assert snap.mt == numpy_rng.capture().mt
    numpy_rng.restore(snap)
    assert np.random.standard_normal() == cached


def test_another_bit_generator_uses_numpys_functions():
    """``np.random.set_bit_generator`` swaps the global generator's bit generator: snapshots
    are then numpy's own state, and a fast snapshot taken before is applied by numpy."""
    if not hasattr(np.random, "set_bit_generator"):
        pytest.skip("numpy < 1.25 has no np.random.set_bit_generator")
    original = np.random.get_bit_generator()
    try:
        np.random.set_bit_generator(np.random.PCG64(3))
        snap = numpy_rng.capture()
        assert type(snap) is not numpy_rng._Snapshot
        want = np.random.rand(5)
        numpy_rng.restore(snap)
        assert np.array_equal(np.random.rand(5), want)
        np.random.set_bit_generator(np.random.MT19937(4))  # MT19937 again: fast
        snap = numpy_rng.capture()
        assert type(snap) is numpy_rng._Snapshot
        want = _draws()
        np.random.set_bit_generator(np.random.MT19937(9))  # another object, same type
        numpy_rng.restore(snap)
        assert _same(_draws(), want)
    finally:
        np.random.set_bit_generator(original)


@pytest.mark.parametrize("calibration", ["none", "raises"])
def test_without_a_calibration_numpys_functions_do_it(monkeypatch, calibration):
    def calibrate():
        if calibration == "raises":
            raise RuntimeError("unknown layout")
        return None

    monkeypatch.setattr(numpy_rng, "_calibrate", calibrate)
    monkeypatch.setattr(numpy_rng, "_layout", numpy_rng._UNKNOWN)
    np.random.seed(11)
    np.random.standard_normal()
    snap = numpy_rng.capture()
    assert type(snap) is tuple and snap[3] == 1
    want = _draws()
    numpy_rng.restore(snap)
    assert _same(_draws(), want)


@pytest.mark.parametrize("unsure", ["d", "i", "both"])
def test_calibration_rejects_a_layout_it_cannot_confirm(monkeypatch, unsure):
    """No unique place for the cached value (``d``), for the flag (``i``), or for either:
    no fast path (None, not an error)."""
    only_offset = numpy_rng._only_offset

    def offset(samples, fmt, values):
        return None if unsure in (fmt, "both") else only_offset(samples, fmt, values)

    monkeypatch.setattr(numpy_rng, "_only_offset", offset)
    assert numpy_rng._calibrate() is None


def test_the_calibration_finds_where_numpy_keeps_the_normal_cache():
    """Calibrated afresh (the suite's processes calibrated once, at their first capture): the
    layout reads a ``RandomState``'s normal-draw cache as ``get_state()`` shows it, cache on
    and off, on a generator the calibration never saw."""
    layout = numpy_rng._calibrate()
    assert layout is not None
    assert layout.rs_type is np.random.RandomState and layout.mt_type is np.random.MT19937
    rs = np.random.RandomState(5)
    for draws in range(1, 6):  # an odd count of normal draws leaves the second value cached
        rs.standard_normal(draws)
        want = rs.get_state()
        assert numpy_rng._read_cache(rs, layout) == (want[3], want[4]), draws
    snap = numpy_rng._read(rs, layout)
    assert snap.legacy()[3:] == tuple(rs.get_state()[3:])


@pytest.mark.parametrize("broken", ["read", "apply", "cache", "generator"])
def test_the_calibration_refuses_what_does_not_replay_like_numpy(monkeypatch, broken):
    """Its own round trip against numpy's functions fails -- a snapshot that is not
    ``get_state()``'s, an apply that does not replay the draws, a cache read at the wrong
    place, another bit generator: no layout, numpy's own functions do it."""
    if broken == "read":
        read = numpy_rng._read
        monkeypatch.setattr(numpy_rng, "_read", lambda rs, layout: _changed(read(rs, layout)))
    elif broken == "apply":
        monkeypatch.setattr(numpy_rng, "_apply", lambda rs, layout, snap: None)
    elif broken == "cache":
        monkeypatch.setattr(numpy_rng, "_read_cache", lambda rs, layout: (0, 0.0))
    else:
        real = np.random.RandomState
        monkeypatch.setattr(np.random, "RandomState", lambda seed: real(np.random.PCG64(seed)))
    assert numpy_rng._calibrate() is None


def _changed(snap):
    """``snap`` with its key's first word changed."""
    mt = bytearray(snap.mt)
    mt[0] ^= 0xFF
    return numpy_rng._Snapshot(bytes(mt), snap.has_gauss, snap.gauss)


@pytest.mark.parametrize(
    "samples, fmt, values, want",
    [
        ([b"\0\0\0\0\x07\0\0\0", b"\0\0\0\0\x09\0\0\0"], "i", [7, 9], 4),
        ([b"\x07\0\0\0\x07\0\0\0", b"\x09\0\0\0\x09\0\0\0"], "i", [7, 9], None),
        ([b"\0\0\0\0\x07\0\0\0", b"\0\0\0\0\x08\0\0\0"], "i", [7, 9], None),
        ([b"\0\x07\0\0\0\0\0\0", b"\0\x09\0\0\0\0\0\0"], "i", [7, 9], None),
        ([b"\0" * 8 + b"\x07" + b"\0" * 7], "q", [7], 8),
        ([b"\x07\0\0\0\0\0\0"], "i", [7], 0),  # (no place past the end: 7 bytes)
    ],
)
def test_only_offset_is_the_one_aligned_place_of_every_value(samples, fmt, values, want):
    """One aligned offset holds each sample's value (the first sample's at 4); two do (none
    unique); none does; only an unaligned one does; the last place of a sample counts."""
    assert numpy_rng._only_offset(samples, fmt, values) == want


def test_rng_state_snapshot_replays_numpy():
    """Through rng.RNGState, as recompute uses it: the block's numpy draws replay, the
    caller's state is back after."""
    np.random.seed(2)
    np.random.standard_normal()
    snap = rng.capture()
    first = _draws()  # the forward
    after = np.random.get_state()
    ref = _draws()  # what the caller draws next without a recomputation
    np.random.set_state(after)
    with snap.restored():
        assert _same(_draws(), first)  # the recomputation
    assert _same(_draws(), ref)
