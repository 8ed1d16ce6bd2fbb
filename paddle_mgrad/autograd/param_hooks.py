"""Which tensors carry a user gradient hook (``Tensor.register_hook``).

A gradient hook sees a parameter's gradient and may replace it.  The fused linear's
in-place path never hands Paddle a weight/bias gradient (it accumulates into
``main_grad`` or ``.grad`` itself and returns None), so a user hook would receive None
(Paddle 3.x) or an uninitialized tensor (Paddle 2.6, where ``g * 2`` on it corrupts the
heap) and its return value would be lost.  Our backward therefore asks
:func:`has_user_hooks` and, for a parameter with a live user hook, returns the plain
gradient instead: Paddle then runs the hooks and accumulates exactly as without
paddle_mgrad.  Parameters without user hooks keep the fused path.

The count comes from a wrapper of ``Tensor.register_hook`` (registry entry
``Tensor.register_hook``, installed with the fused linear): it counts each registration
and patches the returned handle's ``remove()`` to count the removal.  Hooks registered
through the private ``Tensor._register_grad_hook`` are not counted -- that is how
``MixPrecisionLayer`` registers its ``main_grad`` hook, which handles a None gradient.
Hooks registered before the wrapper was installed (before ``paddle_mgrad.enable``) are
not seen.
"""

from __future__ import annotations

import functools
import threading
import weakref

__all__ = ["has_user_hooks", "wrap_register_hook"]

# Reentrant: counting a hook allocates under it, an allocation may run the garbage collector, and
# the collector may free another tensor with a hook (its handle holds it in a reference cycle):
# that tensor's weakref callback (_forget) then takes the lock again, in the same thread.
_lock = threading.RLock()
# id(tensor) -> [weakref to the tensor, number of live user hooks]
_counts: dict = {}
#: the same dict, read-only for hot paths: empty means no tensor has a user hook (nothing to ask)
hooked = _counts


def _forget(key, ref):
    with _lock:
        entry = _counts.get(key)
        if entry is not None and entry[0] is ref:
            del _counts[key]


def _add(tensor, n):
    key = id(tensor)
    with _lock:
        entry = _counts.get(key)
        if entry is None or entry[0]() is not tensor:
            if n < 0:
                return
            entry = _counts[key] = [weakref.ref(tensor, functools.partial(_forget, key)), 0]
        entry[1] = max(0, entry[1] + n)


def has_user_hooks(tensor) -> bool:
    """Whether ``tensor`` has a gradient hook registered with ``register_hook`` that was
    not removed since."""
    entry = _counts.get(id(tensor))
    return entry is not None and entry[1] > 0 and entry[0]() is tensor


def wrap_register_hook(orig):
    """Registry factory for ``paddle.Tensor.register_hook``: the original, counting."""

    @functools.wraps(orig)
    def register_hook(self, hook):
        helper = orig(self, hook)
        _add(self, 1)
        remove = getattr(helper, "remove", None)
        if remove is not None:
            removed = []

            @functools.wraps(remove)
            def counted_remove(*args, **kwargs):
                ok = remove(*args, **kwargs)
                if ok and not removed:  # a second remove() of one handle counts once
                    removed.append(True)
                    _add(self, -1)
                return ok

            try:
                helper.remove = counted_remove
            except AttributeError:  # a handle type without instance attributes: keep it
                pass
        return helper

    register_hook.__wrapped_by_paddle_mgrad__ = True
    return register_hook
