"""Capture and restore every random state a recomputed block can consume.

Recomputation must replay dropout masks bit for bit.  Paddle 3.x does this for
CPU, GPU, XPU and custom devices; Paddle 2.6's non-reentrant recompute raises
``RuntimeError: ... not support current device: cpu`` instead.  We capture:

* the CPU generator (always: CPU-side sampling happens on GPU machines too),
* the current accelerator's generators (GPU / XPU / custom device),
* fleet's model-parallel RNG tracker (``get_rng_state_tracker``),
* numpy's and Python's global generators (as Paddle 3.x does; numpy's through
  :mod:`.numpy_rng`, ~1 µs instead of numpy's ~30 µs per get/set),
* the user-registered custom state of Paddle 3.x's ``custom_state_manager``.

These generators are process-wide.  With recompute running in several Python
threads, one thread's random ops could draw between another thread's capture
and its dropout (or during its replay), so recomputation replayed other masks
than the forward used: silently wrong gradients.  A process-wide lock is held
from the capture to the end of the block's forward and during each replay
(:func:`exclusive`, :func:`replayed`), so recompute blocks of different threads
never interleave their random draws (uncontended in a single thread).  Random
ops *outside* recompute in other threads still share the generators, as in
Paddle.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import threading

from .._compat import core, paddle
from . import numpy_rng

_custom_states = None  # Paddle's custom_state_manager, or False where Paddle has none


def _custom_state_funcs():
    """The get/set functions a user registered with Paddle's ``custom_state_manager`` (3.x;
    Paddle's recompute replays that state too), read at each capture; ``(None, None)``."""
    global _custom_states
    if _custom_states is None:
        # the module, by name: the package's ``recompute`` attribute is the function
        module = importlib.import_module("paddle.distributed.fleet.recompute.recompute")
        _custom_states = getattr(module, "custom_state_manager", None) or False
    mgr = _custom_states
    if not mgr or mgr.custom_get_state_func is None:
        return None, None
    return mgr.custom_get_state_func, mgr.custom_set_state_func


_get_tracker = None  # fleet's get_rng_state_tracker, imported at the first capture


def _tracker():
    global _get_tracker
    if _get_tracker is None:  # (fleet is a heavy import: not at ours)
        from paddle.distributed.fleet.meta_parallel.parallel_layers.random import (
            get_rng_state_tracker,
        )

        _get_tracker = get_rng_state_tracker
    return _get_tracker()


class RNGState:
    """A snapshot of all generators; ``restored()`` replays it temporarily."""

    __slots__ = (
        "cpu",
        "device_kind",
        "device",
        "device_state",
        "tracker",
        "numpy",
        "python",
        "custom",
        "_custom_set",
    )

    def __init__(self):
        self.cpu = core.default_cpu_generator().get_state()
        dev = paddle.get_device()
        self.device = dev
        if dev.startswith("gpu"):
            self.device_kind = "gpu"
            self.device_state = paddle.get_cuda_rng_state()
        elif dev.startswith("xpu"):
            self.device_kind = "xpu"
            self.device_state = paddle.get_rng_state()
        elif dev.split(":")[0] in (paddle.device.get_all_custom_device_type() or ()):  # may be None
            self.device_kind = "custom"
            self.device_state = paddle.get_rng_state(dev)
        else:
            self.device_kind = "cpu"
            self.device_state = None
        self.tracker = _tracker().get_states_tracker()
        self.numpy = numpy_rng.capture()  # np.random's state, fast (numpy_rng.py)
        self.python = random.getstate()
        get_custom, set_custom = _custom_state_funcs()
        self.custom = get_custom() if get_custom is not None else None
        self._custom_set = set_custom

    def apply(self):
        """Set every generator to this snapshot's state."""
        core.default_cpu_generator().set_state(self.cpu)
        if self.device_kind == "gpu":
            paddle.set_cuda_rng_state(self.device_state)
        elif self.device_kind == "xpu":
            paddle.set_rng_state(self.device_state)
        elif self.device_kind == "custom":
            paddle.set_rng_state(self.device_state, self.device)
        # a copy: Paddle 2.6's tracker keeps the dict it is given and writes each
        # advanced state back into it, which would advance this snapshot and give a
        # second replay (retain_graph=True) other dropout masks
        _tracker().set_states_tracker(dict(self.tracker))
        numpy_rng.restore(self.numpy)
        random.setstate(self.python)
        if self._custom_set is not None and self.custom is not None:
            self._custom_set(self.custom)

    @contextlib.contextmanager
    def restored(self):
        """Run the body with this snapshot's state, then put back the current one."""
        current = RNGState()
        self.apply()
        try:
            yield
        finally:
            current.apply()


_lock = threading.RLock()  # see the module docstring


def capture() -> RNGState:
    return RNGState()


def exclusive(active: bool):
    """Hold the RNG lock (capture and forward of a block that preserves RNG state)."""
    return _lock if active else contextlib.nullcontext()


@contextlib.contextmanager
def replayed(state):
    """``state.restored()`` under the RNG lock, or nothing when no state was captured."""
    if state is None:
        yield
        return
    with _lock, state.restored():
        yield
