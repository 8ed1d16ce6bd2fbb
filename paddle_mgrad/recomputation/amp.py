"""Capture the dygraph tracer's AMP state in forward and replay it in recomputation.

We restore the tracer fields directly instead of re-entering
``paddle.amp.auto_cast``: auto_cast maps some combinations (e.g. dtype
``float32``) to others and validates levels, so it cannot always reproduce
what the forward ran under, while the tracer fields are exactly what the op
dispatcher reads.
"""

from __future__ import annotations

import contextlib

from .._compat import tracer


class AmpState:
    __slots__ = ("level", "dtype", "white", "black", "use_promote")

    def __init__(self):
        t = tracer()
        self.level = t._amp_level
        self.dtype = t._amp_dtype
        white, black = t._get_amp_op_list()
        self.white, self.black = set(white), set(black)
        self.use_promote = getattr(t, "_use_promote", None)

    def _apply(self):
        t = tracer()
        t._amp_level = self.level
        t._amp_dtype = self.dtype
        t._set_amp_op_list(set(self.white), set(self.black))
        if self.use_promote is not None:
            t._use_promote = self.use_promote

    @contextlib.contextmanager
    def replayed(self):
        current = AmpState()
        self._apply()
        try:
            yield
        finally:
            current._apply()


def capture() -> AmpState:
    return AmpState()
