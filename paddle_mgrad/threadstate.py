"""Per-thread state whose fields are declared, with their defaults.

The fused linear's forward and backward read several per-thread fields per call (the running
recomputation, the running pass, the guard a forward made).  A field a thread never set costs a
plain ``threading.local`` an ``AttributeError`` raised and caught inside every
``getattr(local, name, default)`` -- about a microsecond each on these machines, in every call
of every linear.  :func:`thread_state` makes a ``threading.local`` subclass whose class
attributes are the defaults: a field the thread never set is found on the class, no exception.
The defaults are shared by all threads, hence immutable (None, 0, False); a thread's own
assignments shadow them for that thread only.
"""

from __future__ import annotations

import threading

__all__ = ["thread_state"]


def thread_state(name: str, **defaults):
    """A new ``threading.local`` whose fields start as ``defaults`` in every thread, read as
    plain attributes.  ``name`` names its class (in reprs and errors)."""
    for field, value in defaults.items():
        if not isinstance(value, (type(None), bool, int, float, str, tuple)):
            raise TypeError(f"thread_state({name}): default {field}={value!r} is mutable")
    return type(name, (threading.local,), dict(defaults))()
