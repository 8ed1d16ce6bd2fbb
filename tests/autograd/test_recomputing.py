"""How a ``budget:`` policy's measuring calls time a candidate
(:func:`paddle_mgrad.autograd.recomputing.timed`): on the host, the call itself; on an
accelerator, the queue emptied at both ends, so that the time is the call's work and not its
launch (through a stand-in tensor on a non-CPU place and a stand-in ``synchronize``: no GPU
here)."""

import paddle
import pytest

from helpers import StandInPlace, tensor_on
from paddle_mgrad.autograd import recomputing


def _on(cpu):
    return tensor_on(StandInPlace(cpu=cpu))


class _Clock:
    """``time.perf_counter`` advancing one second per reading, logging each."""

    def __init__(self, events):
        self.now, self.events = 0.0, events

    def __call__(self):
        self.events.append("clock")
        self.now += 1.0
        return self.now


@pytest.fixture
def events(monkeypatch):
    log = []
    monkeypatch.setattr(recomputing.time, "perf_counter", _Clock(log))
    monkeypatch.setattr(paddle.device, "synchronize", lambda *a: log.append("sync"))
    return log


def _call(log):
    def fn(a, b=0):
        log.append("call")
        return a + b

    return fn


def test_on_an_accelerator_the_queue_is_emptied_at_both_ends(events):
    """The order is sync, clock, call, sync, clock: the clock starts after the work queued
    before the call is done and stops after the call's own work is (an asynchronous launch
    alone would read as nearly nothing)."""
    out, seconds = recomputing.timed(_on(cpu=False), _call(events), 2, b=3)
    assert (out, seconds) == (5, 1.0)
    assert events == ["sync", "clock", "call", "sync", "clock"]


@pytest.mark.parametrize("first", [_on(cpu=True), None], ids=["host tensor", "no tensor"])
def test_on_the_host_nothing_is_synchronised(events, first):
    """A host tensor, or a call that reads no tensor (a sublayer called without one): the
    host clock around the call, no synchronisation."""
    out, seconds = recomputing.timed(first, _call(events), 2)
    assert (out, seconds) == (2, 1.0)
    assert events == ["clock", "call", "clock"]
