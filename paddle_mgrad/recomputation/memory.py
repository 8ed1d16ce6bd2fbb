"""What Paddle's allocator says about the memory of the place a block runs on: the bytes
allocated now and the most allocated at once (since the last reset of that statistic).

The ``budget:`` planner reads them while it measures a step, to learn what the step holds
outside its recompute blocks (:mod:`.budget`).  Paddle keeps both figures per place in its
allocator statistics (``core.host_memory_stat_*`` for the host, ``core.device_memory_stat_*``
for a GPU; Paddle 2.6 and 3.x): reading one is a C++ call, no synchronisation.  A place
without such statistics (XPU, a custom device) reads as None: the planner then counts no
memory outside the blocks.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

from .._compat import core

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
        now, peak, device = "host_memory_stat_current_value", "host_memory_stat_peak_value", 0
    elif place.is_gpu_place():
        device = place.gpu_device_id()
        now, peak = "device_memory_stat_current_value", "device_memory_stat_peak_value"
    else:
        return None
    now, peak = getattr(core, now, None), getattr(core, peak, None)
    if now is None or peak is None:
        return None
    return Allocated(lambda: now(_STAT, device), lambda: peak(_STAT, device))
