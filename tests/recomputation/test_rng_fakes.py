"""GPU / XPU / custom-device RNG capture and replay in recompute, run against fakes.

No accelerator here: ``paddle.get_device`` and the device RNG functions are
replaced by fakes that keep a generator state as a counter and log every call,
and fleet's RNG tracker by a fake with the same two methods.  The tests check
what ``recomputation/rng.py`` does with them: capture in forward, the forward's
state applied during recomputation, the caller's current state put back after,
in that order.  (The CPU generator, numpy and Python ``random`` are real.)
"""

import numpy as np
import paddle
import pytest

import paddle_mgrad
from helpers import custom_state_manager, register_counter_generator
from paddle_mgrad.recomputation import rng


class FakeDevice:
    """A device generator: ``state`` is an int that each draw advances; a log of calls."""

    def __init__(self, kind, dev):
        self.kind, self.dev = kind, dev
        self.state = 100
        self.log = []

    def draw(self):
        self.state += 1
        return self.state

    # paddle.get_cuda_rng_state() -> list of per-device states
    def get_cuda(self):
        self.log.append(("get",))
        return [("cuda", self.state)]

    def set_cuda(self, states):
        assert isinstance(states, list) and states[0][0] == "cuda"
        self.log.append(("set", states[0][1]))
        self.state = states[0][1]

    # paddle.get_rng_state(device=None) / paddle.set_rng_state(states, device=None)
    def get_state(self, device=None):
        self.log.append(("get", device))
        return [(self.kind, self.state)]

    def set_state(self, states, device=None):
        assert states[0][0] == self.kind
        self.log.append(("set", states[0][1], device))
        self.state = states[0][1]


class FakeTracker:
    def __init__(self):
        self.states = {"model_parallel_rng": 7}
        self.log = []

    def get_states_tracker(self):
        self.log.append(("get",))
        return dict(self.states)

    def set_states_tracker(self, states):
        self.log.append(("set", dict(states)))
        self.states = dict(states)


@pytest.fixture
def fake(monkeypatch, request):
    kind = request.param
    dev = {"gpu": "gpu:0", "xpu": "xpu:1", "custom": "npu:0"}[kind]
    f = FakeDevice(kind, dev)
    tracker = FakeTracker()
    monkeypatch.setattr(paddle, "get_device", lambda: dev)
    if kind == "gpu":
        monkeypatch.setattr(paddle, "get_cuda_rng_state", f.get_cuda)
        monkeypatch.setattr(paddle, "set_cuda_rng_state", f.set_cuda)
    else:
        monkeypatch.setattr(paddle, "get_rng_state", f.get_state)
        monkeypatch.setattr(paddle, "set_rng_state", f.set_state)
    monkeypatch.setattr(
        paddle.device, "get_all_custom_device_type", lambda: ["npu"] if kind == "custom" else []
    )
    monkeypatch.setattr(rng, "_tracker", lambda: tracker)
    f.tracker = tracker
    return f


def _expected_device_arg(f):
    return {"gpu": None, "xpu": None, "custom": f.dev}[f.kind]


def _get(f):
    return ("get",) if f.kind == "gpu" else ("get", _expected_device_arg(f))


def _set(f, state):
    return ("set", state) if f.kind == "gpu" else ("set", state, _expected_device_arg(f))


@pytest.mark.parametrize("fake", ["gpu", "xpu", "custom"], indirect=True)
def test_capture_restored_replays_then_puts_back(fake):
    f, tr = fake, fake.tracker
    snap = rng.capture()
    assert snap.device_kind == fake.kind and snap.device == fake.dev
    assert f.log == [_get(f)] and tr.log == [("get",)]
    captured = f.state
    f.draw(), f.draw()  # the forward goes on drawing
    tr.states["model_parallel_rng"] = 9
    current = f.state
    f.log.clear()
    tr.log.clear()
    with snap.restored():
        # inside: the forward's state is live (device and tracker)
        assert f.state == captured and tr.states == {"model_parallel_rng": 7}
        f.draw()  # the recomputation draws too
    # order: read the current state, apply the snapshot, put the current one back
    assert f.log == [_get(f), _set(f, captured), _set(f, current)]
    assert tr.log == [
        ("get",),
        ("set", {"model_parallel_rng": 7}),
        ("set", {"model_parallel_rng": 9}),
    ]
    assert f.state == current and tr.states == {"model_parallel_rng": 9}


@pytest.mark.parametrize("fake", ["gpu", "xpu", "custom"], indirect=True)
def test_restored_puts_back_on_error(fake):
    snap = rng.capture()
    fake.draw()
    current = fake.state
    with pytest.raises(KeyError):
        with snap.restored():
            raise KeyError("boom")
    assert fake.state == current and fake.log[-1] == _set(fake, current)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("fake", ["gpu"], indirect=True)
def test_recompute_replays_device_state_in_backward(fake, use_reentrant):
    """End to end through paddle_mgrad.recompute: the block 'draws' from the fake
    device generator; recomputation sees the forward's state, backward leaves the
    caller's current state in place."""
    seen = []

    def fn(x):
        seen.append(fake.draw())  # a device-side random draw inside the block
        return paddle.tanh(x)

    x = paddle.randn([4])
    x.stop_gradient = False
    y = paddle_mgrad.recompute(fn, x, use_reentrant=use_reentrant, preserve_rng_state=True)
    fake.draw()  # later work on the device
    after_forward = fake.state
    y.sum().backward()
    assert len(seen) == 2 and seen[0] == seen[1]  # same "mask" in recomputation
    assert fake.state == after_forward  # the caller's current state is back
    np.testing.assert_allclose(x.grad.numpy(), 1 - np.tanh(x.numpy()) ** 2, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fake", ["gpu"], indirect=True)
def test_no_capture_without_preserve_rng_state(fake):
    x = paddle.randn([4])
    x.stop_gradient = False
    paddle_mgrad.recompute(
        paddle.tanh, x, use_reentrant=False, preserve_rng_state=False
    ).sum().backward()
    assert fake.log == [] and fake.tracker.log == []


def test_cpu_when_custom_device_list_is_none(monkeypatch):
    """``paddle.device.get_all_custom_device_type()`` is documented to return None when no
    custom device is registered: capture must still work (CPU generator only)."""
    monkeypatch.setattr(paddle.device, "get_all_custom_device_type", lambda: None)
    snap = rng.capture()
    assert snap.device_kind == "cpu" and snap.device_state is None
    a = paddle.rand([3]).numpy()
    with snap.restored():
        b = paddle.rand([3]).numpy()
    assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "name,args",
    [
        ("get_cuda_rng_state", ()),
        ("set_cuda_rng_state", ([],)),
        ("get_rng_state", ()),
        ("get_rng_state", ("npu:0",)),
        ("set_rng_state", ([],)),
        ("set_rng_state", ([], "npu:0")),
    ],
)
def test_fakes_are_called_as_paddles_real_functions_accept(name, args):
    """The calls rng.py makes (and the fakes above receive) bind to the real signatures."""
    import inspect

    inspect.signature(getattr(paddle, name)).bind(*args)


class Paddle26Tracker:
    """fleet's RNG tracker as Paddle 2.6 has it: ``set_states_tracker`` *keeps* the dict it
    is given, and ``rng_state`` writes each advanced state back into that dict."""

    def __init__(self):
        self.states_ = {"model_parallel_rng": 7}

    def get_states_tracker(self):
        return dict(self.states_)

    def set_states_tracker(self, states):
        self.states_ = states

    def draw(self):  # `with tracker.rng_state(): dropout(...)`: use, advance, write back
        value = self.states_["model_parallel_rng"]
        self.states_["model_parallel_rng"] = value + 1
        return value


def test_a_snapshot_replays_the_same_tracker_state_every_time(monkeypatch):
    """Replaying handed 2.6's tracker the snapshot's own dict, so the first replay advanced
    the snapshot and a second one (backward after retain_graph=True) drew other masks."""
    tracker = Paddle26Tracker()
    monkeypatch.setattr(rng, "_tracker", lambda: tracker)
    snap = rng.capture()
    first = tracker.draw()  # the forward
    replays = []
    for _ in range(3):
        with snap.restored():
            replays.append(tracker.draw())
    assert replays == [first] * 3
    assert snap.tracker == {"model_parallel_rng": 7}
    assert tracker.states_ == {"model_parallel_rng": 8}  # the caller's state is back


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_custom_state_registered_with_paddle_is_replayed(monkeypatch, use_reentrant):
    """A user's own generator registered with Paddle's ``custom_state_manager`` (get/set
    functions): recomputation draws what the forward drew, and backward leaves the state the
    caller had moved on to.  The block scales by its draw, so a replay with another draw gives
    another gradient."""
    counter = register_counter_generator(monkeypatch)  # each draw returns n and advances it
    draws = []

    def block(x):
        draws.append(counter["n"])
        counter["n"] += 1
        return paddle.tanh(x) * float(draws[-1] + 2)  # tanh saves its output: a replay

    data = [0.5, -2.0, 3.0]
    x = paddle.to_tensor(data, stop_gradient=False)
    y = paddle_mgrad.recompute(block, x, use_reentrant=use_reentrant)
    counter["n"] = 40  # the caller drew on after the forward
    y.sum().backward()
    assert draws == [0, 0]  # the replay drew what the forward drew
    assert counter["n"] == 40  # and the caller's state is back
    ref = paddle.to_tensor(data, stop_gradient=False)
    (paddle.tanh(ref) * 2.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), ref.grad.numpy())


def test_a_custom_state_of_none_is_not_set(monkeypatch):
    """A registered getter that returns None (the user's generator not started): as Paddle's
    recompute, nothing is handed to the setter -- in the replay or after it."""
    mgr = custom_state_manager()
    calls = []
    monkeypatch.setattr(mgr, "custom_get_state_func", lambda: None)
    monkeypatch.setattr(mgr, "custom_set_state_func", calls.append)
    x = paddle.to_tensor([0.5, -2.0], stop_gradient=False)
    paddle_mgrad.recompute(paddle.tanh, x, use_reentrant=False).sum().backward()
    assert calls == []
    ref = paddle.to_tensor([0.5, -2.0], stop_gradient=False)
    paddle.tanh(ref).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), ref.grad.numpy())
