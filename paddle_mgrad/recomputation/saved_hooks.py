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
process) and must be emptied after each recompute, which crashes a thread that
records autograd at that moment.  So on 2.6 non-reentrant recompute runs in one
thread, while no other thread is seen recording autograd; otherwise it raises
:class:`RecomputeError` every time (:func:`_paddle2_refuse_threads`).

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
import itertools
import threading

from .. import registry
from .._compat import PACKED_VALUES_LEAK, UNPACK_MOVES_HOLDER, core, is_tensor
from ..errors import RecomputeError
from ..threadstate import thread_state
from .tensors import buffer_sharing_tensor

# .stack: [(pack, unpack)]; .pylayer_save: bool
_local = thread_state("SavedHookState", stack=None, pylayer_save=False)
_lock = threading.Lock()
_slot = {"epoch": None, "frames": 0, "sticky": False}
_frames_by_thread: dict = {}  # thread id -> number of active frames


def in_pylayer_save() -> bool:
    """True while a PyLayer's ``save_for_backward`` runs the pack hook (our shim)."""
    return _local.pylayer_save


def _stack() -> list:
    stack = _local.stack
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

    __slots__ = ("owned", "_keys", "__weakref__")

    def __init__(self):
        self.owned: dict = {}
        # next() of a C counter is atomic under the GIL; len(owned) was not: two threads
        # packing at once got the same key, and one saved tensor came back as the other
        self._keys = itertools.count()

    def pack(self, x):
        stack = _local.stack
        if stack:
            pack, unpack = stack[-1]
            packed = _Routed(unpack, pack(x))
        else:
            # Another thread saves while one of ours recomputes: from now on the slot is
            # never emptied while threads run (Paddle reads it without a lock); on 2.6,
            # where it must be, non-reentrant recompute is refused from now on instead.
            _slot["sticky"] = True
            if PACKED_VALUES_LEAK:
                _paddle2_threads["other"] = threading.current_thread()
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
        key = next(self._keys)
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
                f"version is {packed.version}."
            )
        # (2.6 moves the buffer out of what we return: give it its own DenseTensor)
        return buffer_sharing_tensor(t) if UNPACK_MOVES_HOLDER else t


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


#: Paddle 2.6: the thread that runs non-reentrant recompute, and another thread seen
#: recording autograd meanwhile (see :func:`_paddle2_refuse_threads`)
_paddle2_threads = {"owner": None, "other": None}


def _paddle2_refuse_threads():
    """Paddle 2.6: non-reentrant recompute runs in one thread while no other thread records
    autograd, else RecomputeError -- every time, before any hook is installed.

    On 2.6 the hook slot must be emptied after each recompute (2.6 never frees what a
    pack hook returns; a permanent dispatcher would own every tensor the process saves), and
    emptying it while another thread is between Paddle's unlocked read of the slot and its
    use crashes that thread (segfault; also with Paddle's own hooks).  The first thread to
    recompute owns it (a new one once it has ended); another thread seen saving tensors
    while ours ran (the pass-through) refuses it until that thread ends."""
    me = threading.current_thread()
    state = _paddle2_threads
    if state["owner"] is None or not state["owner"].is_alive():
        state["owner"] = me
    if state["other"] is not None and not state["other"].is_alive():
        state["other"] = None
    if state["owner"] is not me:
        why = (
            f"thread {state['owner'].name!r} ran it first (one thread per process, until "
            "that thread ends or paddle_mgrad.disable())"
        )
    elif state["other"] is not None and state["other"] is not me:
        why = (
            f"thread {state['other'].name!r} also records autograd (it saved tensors "
            "while a recompute ran)"
        )
    else:
        return
    raise RecomputeError(
        f"paddle_mgrad.recompute(use_reentrant=False) refused in thread {me.name!r}: {why}. "
        "On Paddle 2.6 non-reentrant recompute needs saved-tensor hooks, which are "
        "process-wide and read without a lock, so installing and removing them while another "
        "thread runs Paddle ops can crash the process (Paddle's own recompute too). Use "
        "use_reentrant=True in threads (no hooks), keep autograd in one thread, or Paddle 3.x."
    )


@contextlib.contextmanager
def hooks(pack, unpack):
    """Run the body with ``(pack, unpack)`` as this thread's saved-tensor hooks."""
    stack = _stack()
    me = threading.get_ident()
    with _lock:
        if PACKED_VALUES_LEAK:
            _paddle2_refuse_threads()
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


def release():
    """Empty Paddle's hook slot if our dispatcher holds it and no recompute runs
    (:func:`paddle_mgrad.disable`); a running one empties it when it ends."""
    with _lock:
        _slot["sticky"] = False
        _paddle2_threads.update(owner=None, other=None)
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
        only_tensors = True
        for o in objects:  # (a loop, not all(<generator>): this runs in every linear's forward)
            if not is_tensor(o):
                only_tensors = False
                break
        if only_tensors:
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
