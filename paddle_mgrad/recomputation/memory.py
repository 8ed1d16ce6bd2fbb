"""What Paddle's allocator says about the memory of the place a block runs on: the bytes
allocated now and the most allocated at once (since the last reset of that statistic).

The ``budget:`` planner reads them while it measures a step, to learn what the step holds
outside its recompute blocks (:mod:`.budget`).  Paddle keeps both figures per place in its
allocator statistics (the host's, a GPU's: ``_compat.HOST_MEMORY_STATS``,
``DEVICE_MEMORY_STATS``; Paddle 2.6 and 3.x): reading one is a C++ call, no
synchronisation.  A place without such statistics (XPU, a custom device) reads as None: the
planner then counts no memory outside the blocks.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from .. import _compat

__all__ = ["Allocated", "allocated_on"]

#: Paddle's name of the statistic: bytes handed out by the allocator (not those it reserved)
_STAT = "Allocated"


class Allocated(NamedTuple):
    """The two readings of one place: ``now()`` and ``peak()``, bytes."""

    now: Callable[[], int]
    peak: Callable[[], int]


def allocated_on(tensor) -> Optional[Allocated]:
    """The allocator statistics of ``tensor``'s place, or None where Paddle keeps none."""
    place = tensor.place
    if place.is_cpu_place():
        stats, device = _compat.HOST_MEMORY_STATS, 0
    elif place.is_gpu_place():
        stats, device = _compat.DEVICE_MEMORY_STATS, place.gpu_device_id()
    else:
        return None
    if stats is None:
        return None
    now, peak = stats
    return Allocated(lambda: now(_STAT, device), lambda: peak(_STAT, device))
