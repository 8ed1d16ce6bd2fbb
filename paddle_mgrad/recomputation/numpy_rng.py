"""numpy's global random state, captured and restored exactly in about a microsecond.

Recompute replays numpy's global generator (``np.random``) as Paddle 3.x does: its state in
the block's forward, applied around the recomputation, the current one put back after.
``np.random.get_state()`` and ``set_state()`` cost ~30 µs each (numpy copies the MT19937 key
one word at a time in interpreted code), four calls per recomputed block: ~130 µs, a quarter
of a small block's host cost -- and Paddle's own recompute pays the same.

The global generator's state has two parts:

* the MT19937 bit generator's C struct (``uint32 key[624]; int pos``), which numpy publishes
  for C code at ``bit_generator.ctypes.state_address``: copied out with ``ctypes.string_at``
  and back with ``ctypes.memmove`` (what ``set_state`` writes too: the key and the position);
* the legacy normal-draw cache of the ``RandomState`` (``has_gauss``, ``gauss``: one normal
  draw makes two values and keeps the second), which numpy shows only through
  ``get_state()``.  Where it lies in the object is found once per process by calibration on a
  private ``RandomState``: ``set_state`` with two different cached values, the one offset
  where exactly those bytes change is ``gauss``; cache on and off, the one int that flips is
  ``has_gauss``.  Read there, never written: a snapshot whose cache differs from the live one
  is applied by numpy's own ``set_state``.

The calibration then checks the whole round trip on its private generator against numpy's
own functions (a snapshot equals ``get_state()``; after draws, applying it replays the same
uniform and normal draws).  Where anything does not check out -- another numpy layout, a
global generator that is not a plain ``RandomState`` over MT19937 (``np.random.
set_bit_generator``) -- snapshots are numpy's own ``get_state()`` tuples and are applied with
``set_state()``: slower, the same states.  Reads and writes hold the bit generator's lock, as
numpy's draws do.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

__all__ = ["capture", "restore"]

_KEY_WORDS = 624
_STATE_BYTES = 4 * _KEY_WORDS + 4  # uint32 key[624]; int pos


class _Layout:
    """Where a ``RandomState`` of this numpy keeps its normal-draw cache (byte offsets)."""

    __slots__ = ("rs_type", "mt_type", "has_gauss", "gauss")

    def __init__(self, rs_type, mt_type, has_gauss, gauss):
        self.rs_type, self.mt_type = rs_type, mt_type
        self.has_gauss, self.gauss = has_gauss, gauss


class _Snapshot:
    """The fast form of a state: the bit generator's struct bytes and the cache."""

    __slots__ = ("mt", "has_gauss", "gauss")

    def __init__(self, mt, has_gauss, gauss):
        self.mt, self.has_gauss, self.gauss = mt, has_gauss, gauss

    def legacy(self):
        """The state as ``np.random.get_state()`` returns it."""
        key = np.frombuffer(self.mt, dtype=np.uint32, count=_KEY_WORDS).copy()
        pos = struct.unpack_from("i", self.mt, 4 * _KEY_WORDS)[0]
        return ("MT19937", key, pos, self.has_gauss, self.gauss)


def _read_cache(rs, layout):
    base = id(rs)
    return (
        ctypes.c_int.from_address(base + layout.has_gauss).value,
        ctypes.c_double.from_address(base + layout.gauss).value,
    )


def _read(rs, layout):
    bg = rs._bit_generator
    with bg.lock:
        mt = ctypes.string_at(bg.ctypes.state_address, _STATE_BYTES)
        has_gauss, gauss = _read_cache(rs, layout)
    return _Snapshot(mt, has_gauss, gauss)


def _apply(rs, layout, snap):
    bg = rs._bit_generator
    with bg.lock:
        if _read_cache(rs, layout) == (snap.has_gauss, snap.gauss):
            ctypes.memmove(bg.ctypes.state_address, snap.mt, _STATE_BYTES)
            return
    rs.set_state(snap.legacy())  # the cache differs: numpy writes it (and the key)


def _only_offset(samples, fmt, values):
    """The one aligned offset at which each bytes sample holds its value packed as ``fmt``,
    or None when there is none or more than one."""
    size = struct.calcsize(fmt)
    found = [
        off
        for off in range(0, len(samples[0]) - size + 1, size)
        if all(struct.unpack_from(fmt, s, off)[0] == v for s, v in zip(samples, values))
    ]
    return found[0] if len(found) == 1 else None


def _calibrate():
    """The :class:`_Layout` of this numpy's ``RandomState``, checked; None when unsure."""
    rs = np.random.RandomState(20261202)
    mt_type = type(rs._bit_generator)
    if mt_type.__name__ != "MT19937":
        return None
    size = type(rs).__basicsize__
    key = rs.get_state()[1].copy()

    def memory(has_gauss, gauss):
        rs.set_state(("MT19937", key, 17, has_gauss, gauss))
        return ctypes.string_at(id(rs), size)

    g1, g2 = 1.2345678901234567, -0.0098765432109876
    on1, on2, off2 = memory(1, g1), memory(1, g2), memory(0, g2)
    gauss = _only_offset([on1, on2], "d", [g1, g2])
    has_gauss = _only_offset([on2, off2], "i", [1, 0])
    if gauss is None or has_gauss is None:
        return None
    layout = _Layout(type(rs), mt_type, has_gauss, gauss)
    # the round trip against numpy's own functions
    rs.seed(7)
    rs.standard_normal()  # a normal draw: the cache is on
    snap = _read(rs, layout)
    want = rs.get_state()
    got = snap.legacy()
    if not (np.array_equal(got[1], want[1]) and got[2:] == tuple(want[2:]) and got[3] == 1):
        return None
    drawn = rs.random_sample(2 * _KEY_WORDS), rs.standard_normal(3)  # the key regenerates
    _apply(rs, layout, snap)  # the cache differs now: numpy's set_state
    again = rs.random_sample(2 * _KEY_WORDS), rs.standard_normal(3)
    rs.set_state(want)
    rs.random_sample(5)  # only the key moves: the fast write
    _apply(rs, layout, snap)
    third = rs.random_sample(2 * _KEY_WORDS), rs.standard_normal(3)
    if not all(np.array_equal(a, b) for a, b in zip(drawn + drawn, again + third)):
        return None
    return layout


_UNKNOWN = object()
_layout = _UNKNOWN  # the calibrated layout, None (numpy's own functions), or not asked yet


def _fast_layout(rs):
    """The layout when the fast path applies to ``rs``, else None."""
    global _layout
    if _layout is _UNKNOWN:
        try:
            _layout = _calibrate()
        except Exception:  # noqa: BLE001 -- any surprise: numpy's own functions
            _layout = None
    layout = _layout
    if (
        layout is None
        or type(rs) is not layout.rs_type
        or type(rs._bit_generator) is not layout.mt_type
    ):
        return None
    return layout


def _global():
    return np.random.mtrand._rand


def capture():
    """The global generator's state: a fast snapshot, or numpy's ``get_state()`` tuple."""
    rs = _global()
    layout = _fast_layout(rs)
    if layout is None:
        return rs.get_state()
    return _read(rs, layout)


def restore(state):
    """Make ``state`` (from :func:`capture`) the global generator's state."""
    rs = _global()
    if type(state) is not _Snapshot:
        rs.set_state(state)
        return
    layout = _fast_layout(rs)
    if layout is None:  # the generator changed since the capture: numpy applies it
        rs.set_state(state.legacy())
        return
    _apply(rs, layout, state)
