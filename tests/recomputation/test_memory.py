"""The allocator statistics a ``budget:`` plan reads (:mod:`paddle_mgrad.recomputation.memory`):
the host's on the CPU (Paddle 2.6 and 3.x), a GPU's by its device id (through stand-ins for
Paddle's statistics: no GPU here), none elsewhere."""

import paddle

from helpers import StandInPlace, tensor_on
from paddle_mgrad import _compat
from paddle_mgrad.recomputation import memory


def test_the_host_statistics_follow_an_allocation():
    """A CPU tensor reads the host statistics: 1000·1000 float32 more allocated now, and the
    peak at least that."""
    allocated = memory.allocated_on(paddle.ones([1]))
    before = allocated.now()
    x = paddle.empty([1000, 1000], dtype="float32")
    assert allocated.now() - before == 4_000_000
    assert allocated.peak() >= allocated.now()
    del x
    assert allocated.now() == before


def test_a_gpu_tensor_reads_its_devices_statistics(monkeypatch):
    """A tensor on GPU 3 reads Paddle's device statistics of device 3 ("Allocated": what the
    allocator handed out, not what it reserved)."""
    asked = []

    def stat(which):
        return lambda name, device: asked.append((which, name, device)) or 7

    monkeypatch.setattr(_compat, "DEVICE_MEMORY_STATS", (stat("now"), stat("peak")))
    allocated = memory.allocated_on(tensor_on(StandInPlace(gpu=3)))
    assert (allocated.now(), allocated.peak()) == (7, 7)
    assert asked == [("now", "Allocated", 3), ("peak", "Allocated", 3)]


def test_places_without_statistics_read_none(monkeypatch):
    """A place that is neither the host nor a GPU (XPU, a custom device), or a Paddle without
    the statistics: None (the plan then counts no memory outside the blocks)."""
    assert memory.allocated_on(tensor_on(StandInPlace())) is None
    monkeypatch.setattr(_compat, "HOST_MEMORY_STATS", None)
    monkeypatch.setattr(_compat, "DEVICE_MEMORY_STATS", None)
    assert memory.allocated_on(tensor_on(StandInPlace(cpu=True))) is None
    assert memory.allocated_on(tensor_on(StandInPlace(gpu=0))) is None
