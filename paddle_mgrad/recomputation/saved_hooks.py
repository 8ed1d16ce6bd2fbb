"""Saved-tensor hooks per thread, and ``save_for_backward`` of any Python object.

**Hooks.** Paddle has one process-wide slot for a pair of saved-tensor hooks
(``core.eager.register_saved_tensors_hooks`` raises when it is taken, ``reset``
empties it).  Every op of every thread calls whatever pair is there.  Installing
a recompute's pair directly meant that, with several Python threads, one
thread's ops were packed by another thread's recompute (and its pair replaced
or removed while the other still ran): 139-145 of 200 iterations ended with
neither ``main_grad`` nor ``.grad`` and no error.  Instead, :func:`hooks` pushes
the pair on a *per-thread* stack and the slot holds one dispatcher of ours
(:class:`_Epoch`):

* a tensor saved by a thread with a non-empty stack goes to that thread's top
  pair; what the pair's pack returns travels with its own unpack, so backward
  (in whatever thread) calls the unpack that belongs to the save;
* a tensor saved by any other thread **passes through**: kept as Paddle keeps
  it without hooks (a buffer-sharing view; a ``PyLayer`` save keeps the very
  object), including Paddle's check that it was not modified in place before
  backward.

Nesting (a recompute inside a recompute) is the same stack.  The dispatcher is
registered when the first frame in the process starts and removed when the last
one ends.  Paddle reads the slot without a lock, so emptying it while another
thread runs ops can hand that thread a null hook (a segfault, also with Paddle's
own hooks): on Paddle 3.x, once another thread was seen saving tensors or
running its own recompute, the dispatcher stays registered (every save in the
process then passes through one Python call) until :func:`paddle_mgrad.disable`
(:func:`release`) or exit.

Paddle 2.6 never releases what a pack hook returns.  There the dispatcher's
pack returns a small int and owns the rest itself; Paddle keeps the registered
unpack callable in each saved tensor and does release *that*, so what we own
dies with the graph (before, every tensor a recompute kept -- its inputs --
leaked: about 2 MiB per step for a 1 MiB input).  The price: the dispatcher
cannot stay registered for good on 2.6 (it would own every saved tensor of the
process), so recompute frames of different threads take turns (a lock), and a
thread that records autograd *outside* recompute while another thread's frame
ends can still meet Paddle 2.6's unlocked slot (documented limit).

**Non-tensor saves.** ``PyLayerContext.save_for_backward`` stores its arguments
in a C++ ``container`` whose setter, while a hook pair is active, runs the pack
hook on every element and raises ``ValueError: save_for_backward only support
Tensor, list of Tensor, tuple of Tensor`` for anything else (Paddle 2.6 also for
``None``; a list of tensors crashes Paddle's unpack).  :func:`wrap_save_for_backward`
flattens the arguments: every tensor, also inside tuples, lists and dict values,
is its own container element (so it gets every guarantee a saved tensor has:
parameters come back as the very object under recompute); everything else
(bool, int, float, None, strings, other objects) is kept on the context as it
is, and :func:`wrap_saved_tensor` rebuilds the arguments in place.  Calls that
save only tensors go to Paddle unchanged.  The pair is a registry entry
(``support``) installed by :func:`paddle_mgrad.enable` and by the first
non-reentrant recompute, and removed by :func:`paddle_mgrad.disable`.  It also
tells the pack hook that the tensors come from a PyLayer (on 2.6 the C++ side
of an ordinary op *moves* the buffer out of whatever the unpack hook returns, so
only PyLayer saves may be given back as the original object).
"""
from __future__ import annotations

import atexit
import contextlib
import threading

from .. import registry
from .._compat import IS_PADDLE_2, core, is_tensor
from ..errors import RecomputeError
from .tensors import buffer_sharing_tensor

_local = threading.local()  # .stack: [(pack, unpack)]; .pylayer_save: bool
_lock = threading.Lock()
_slot = {"epoch": None, "frames": 0, "sticky": False}
_frames_by_thread: dict = {}  # thread id -> number of active frames

#: Paddle 2.6 never releases what a pack hook returns (3.x holds it in a shared_ptr)
PACKED_VALUES_LEAK = IS_PADDLE_2


def in_pylayer_save() -> bool:
    """True while a PyLayer's ``save_for_backward`` runs the pack hook (our shim)."""
    return getattr(_local, "pylayer_save", False)


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


# ------------------------------------------------------------- the dispatcher
class _Routed:
    """A tensor packed by a thread's own pair: the pair's packed value and its unpack."""

    __slots__ = ("unpack", "value")

    def __init__(self, unpack, value):
        self.unpack = unpack
        self.value = value


class _Passthrough:
    """A tensor saved by a thread without a pair of ours: kept as Paddle would."""

    __slots__ = ("tensor", "version", "pylayer")

    def __init__(self, tensor, version, pylayer):
        self.tensor = tensor
        self.version = version
        self.pylayer = pylayer


class _Epoch:
    """The dispatcher pair for one registration in Paddle's slot.

    Paddle keeps the unpack callable (this object) in every saved tensor packed
    while it was registered, and releases it with them.  On Paddle 2.6, which never
    releases what a pack hook returns, the pack hook therefore returns a small int
    and what must live as long as the saved tensor (the routed value with its
    frame, a passed-through tensor) is owned here, so it dies with the graph."""

    __slots__ = ("owned", "__weakref__")

    def __init__(self):
        self.owned: dict = {}

    def pack(self, x):
        stack = getattr(_local, "stack", None)
        if stack:
            pack, unpack = stack[-1]
            packed = _Routed(unpack, pack(x))
        else:
            # Another thread saves while one of ours recomputes: from now on the slot is
            # never emptied while threads run (Paddle reads it without a lock).
            _slot["sticky"] = True
            if x is None:
                return None
            if in_pylayer_save():  # the user's own object, as Paddle keeps it without hooks
                packed = _Passthrough(x, None, True)
            else:
                # a view without x's grad node: holding x would keep its node (which holds
                # this packed value) alive in a cycle Python's GC cannot see
                packed = _Passthrough(x.detach(), x._inplace_version(), False)
        if not PACKED_VALUES_LEAK:
            return packed
        key = len(self.owned)
        self.owned[key] = packed
        return key

    def unpack(self, packed):
        if packed is None:
            return None
        if PACKED_VALUES_LEAK:
            packed = self.owned[packed]
        if type(packed) is _Routed:
            return packed.unpack(packed.value)
        t = packed.tensor
        if packed.pylayer:
            return t
        if t._inplace_version() != packed.version:
            # Paddle's own check, which a hook pair bypasses
            raise RuntimeError(
                f"Tensor '{t.name}' used in gradient computation has been modified by an "
                f"inplace operation. Its version is {t._inplace_version()} but the expected "
                f"version is {packed.version}.")
        # 2.6 moves the buffer out of what we return: give it its own DenseTensor
        return buffer_sharing_tensor(t) if IS_PADDLE_2 else t


def _register():
    epoch = _Epoch()
    try:
        core.eager.register_saved_tensors_hooks(epoch.pack, epoch.unpack)
    except Exception as e:  # another (non-paddle_mgrad) hook pair is active
        raise RecomputeError(
            "paddle_mgrad.recompute could not install its saved-tensor hooks because "
            "another pair (paddle.autograd.saved_tensors_hooks, or Paddle's own "
            "recompute) is active; call paddle_mgrad.enable() so that Paddle's "
            f"recompute is ours, or do not nest them. Paddle said: {e}"
        ) from e
    _slot["epoch"] = epoch


def _unregister():
    core.eager.reset_saved_tensors_hooks()
    _slot["epoch"] = None


#: Paddle 2.6: frames of different threads take turns (see the module docstring)
_one_thread_at_a_time = threading.RLock()


@contextlib.contextmanager
def hooks(pack, unpack):
    """Run the body with ``(pack, unpack)`` as this thread's saved-tensor hooks."""
    stack = _stack()
    me = threading.get_ident()
    if PACKED_VALUES_LEAK:
        _one_thread_at_a_time.acquire()
    try:
        with _lock:
            if _slot["epoch"] is None:
                _register()
            stack.append((pack, unpack))
            _slot["frames"] += 1
            _frames_by_thread[me] = _frames_by_thread.get(me, 0) + 1
            if len(_frames_by_thread) > 1:
                _slot["sticky"] = True
        try:
            yield
        finally:
            with _lock:
                stack.pop()
                _slot["frames"] -= 1
                left = _frames_by_thread[me] - 1
                if left:
                    _frames_by_thread[me] = left
                else:
                    del _frames_by_thread[me]
                if _slot["frames"] == 0 and (PACKED_VALUES_LEAK or not _slot["sticky"]):
                    _unregister()
    finally:
        if PACKED_VALUES_LEAK:
            _one_thread_at_a_time.release()


def release():
    """Empty Paddle's hook slot if our dispatcher holds it and no recompute runs
    (:func:`paddle_mgrad.disable`); a running one empties it when it ends."""
    with _lock:
        _slot["sticky"] = False
        if _slot["epoch"] is not None and _slot["frames"] == 0:
            _unregister()


@atexit.register
def _at_exit():
    # Paddle's hook slot is a C++ static destroyed after the interpreter: a pair still
    # in it would release its Python callables then, and that hangs the exit.
    with _lock:
        if _slot["epoch"] is not None:
            _unregister()


def is_registered() -> bool:
    return _slot["epoch"] is not None


# ------------------------------------------------------ non-tensor save_for_backward
_LAYOUT = "_paddle_mgrad_saved_layout"


class _Slot:
    """Where the ``index``-th saved tensor goes back in the layout."""

    __slots__ = ("index",)

    def __init__(self, index):
        self.index = index


def _flatten(obj, tensors):
    if is_tensor(obj):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if type(obj) in (tuple, list):
        return type(obj)(_flatten(o, tensors) for o in obj)
    if type(obj) is dict:
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    return obj


def _fill(layout, tensors):
    if type(layout) is _Slot:
        return tensors[layout.index]
    if type(layout) in (tuple, list):
        return type(layout)(_fill(o, tensors) for o in layout)
    if type(layout) is dict:
        return {k: _fill(v, tensors) for k, v in layout.items()}
    return layout


def wrap_save_for_backward(orig):
    """Registry factory: ``PyLayerContext.save_for_backward`` accepting any objects."""

    def save_for_backward(self, *objects):
        if all(is_tensor(o) for o in objects):
            tensors = objects
            if hasattr(self, _LAYOUT):
                delattr(self, _LAYOUT)
        else:
            flat: list = []
            setattr(self, _LAYOUT, tuple(_flatten(o, flat) for o in objects))
            tensors = tuple(flat)
        _local.pylayer_save = True
        try:
            orig(self, *tensors)
        finally:
            _local.pylayer_save = False

    save_for_backward.__wrapped__ = orig
    return save_for_backward


def wrap_saved_tensor(orig):
    """Registry factory: ``PyLayerContext.saved_tensor`` rebuilding non-tensor saves."""

    def saved_tensor(self):
        saved = orig(self)
        layout = getattr(self, _LAYOUT, None)
        if layout is None:
            return saved
        tensors = list(saved) if saved is not None else []
        return tuple(_fill(o, tensors) for o in layout)

    saved_tensor.__wrapped__ = orig
    return saved_tensor


SHIM_KEYS = ("PyLayerContext.save_for_backward", "PyLayerContext.saved_tensor")


def install_save_shim() -> bool:
    """Install the ``save_for_backward`` pair (idempotent); True if installed."""
    if all(registry.is_installed(k) for k in SHIM_KEYS):  # skip the lock once installed
        return True
    return registry.ensure(*SHIM_KEYS)
