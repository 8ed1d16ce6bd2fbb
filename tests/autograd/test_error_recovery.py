"""An error never corrupts the next step.

Whatever raises -- user code in a block's forward or in its recomputation, Paddle's in-place
check inside a recomputation, our determinism check, our op's own input check in a fused
linear's backward, a fused linear's forward check -- the process afterwards is as it was:
grad mode on, no saved-tensor hooks of ours left active, this thread not "recomputing", no
pass left on the backward-pass stack, the RNG state a recomputation replayed put back; and the
next (clean) step's outputs, input gradient and every ``main_grad`` are bit-identical to those
of the same step in a fresh process.  A trainer that skips a failed batch, a notebook, a sweep
all go on in the same process.

Plain Paddle leaves grad mode off after an error raised inside its backward engine (an unpack
hook's recomputation, a PyLayer's backward): every later step then records no graph and trains
nothing, silently (test_plain_paddle_leaves_grad_mode_off_after_a_failed_replay says so, and
fails if Paddle fixes it).
"""

import json
import subprocess
import sys

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils import recompute as native_recompute
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from paddle_mgrad import FusedLinearError, RecomputeError
from paddle_mgrad.autograd import backward_errors, recomputing
from paddle_mgrad.recomputation import saved_hooks

D = 4
MODES = ("none", "reentrant", "non_reentrant")

# The clean step, as a script: run here in-process after an error, and in a fresh process for
# the reference.  ``fail`` injects an error (see FAILURES); "" is the clean step.
STEP = r'''
import zlib, json, sys
import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer
import paddle_mgrad

D = 4


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(D, D)
        self.lin2 = paddle.nn.Linear(D, D)
        self.calls = 0
        self.fail = ""

    def block(self, h):
        self.calls += 1
        replay = self.calls == 2
        if self.fail == "user_forward":
            raise ValueError("user error in the forward")
        if self.fail == "user_replay" and replay:
            raise ValueError("user error in the recomputation")
        if self.fail == "inplace_replay" and replay:
            leaf = paddle.ones([D])
            leaf.stop_gradient = False
            leaf.add_(paddle.ones([D]))  # Paddle refuses: a leaf that needs a gradient
        y = self.lin(h)
        y = F.dropout(y, 0.3, training=True)
        if self.fail == "determinism" and replay:
            y = y[:1]  # the recomputation saves another shape
        y.add_(paddle.full_like(y, 0.5))
        return self.lin2(paddle.tanh(y))


def clean_step(mode, fused):
    """Train one step from seed 11; every result as lists."""
    paddle_mgrad.disable()
    paddle_mgrad.enable(recompute=True, fused_linear=fused)
    paddle.seed(11)
    net = Net()
    MixPrecisionLayer(net, dtype="float16")
    x = paddle.to_tensor(np.arange(3 * D, dtype="float32").reshape([3, D]) / 7.0)
    x.stop_gradient = False
    out = net.block(x) if mode == "none" else paddle_mgrad.recompute(
        net.block, x, use_reentrant=mode == "reentrant")
    out.sum().backward()
    result = {"out": out.numpy().tolist(), "x.grad": x.grad.numpy().tolist()}
    for name, p in net.named_parameters():
        result[name] = p.main_grad.numpy().tolist()
        assert p.grad is None
    paddle_mgrad.disable()
    return result


if __name__ == "__main__":
    print(json.dumps({f"{m}-{f}": clean_step(m, f == "fused")
                      for m in ("none", "reentrant", "non_reentrant")
                      for f in ("fused", "unfused")}))
'''
_ns: dict = {}
exec(compile(STEP, "<error-recovery step>", "exec"), _ns)
Net, clean_step = _ns["Net"], _ns["clean_step"]


@pytest.fixture(scope="module")
def fresh_process():
    """The clean step's results in a new interpreter, per ``mode-fused``."""
    done = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def failing_step(mode, fail, fused=True):
    """One step that raises; returns the exception."""
    paddle_mgrad.disable()
    paddle_mgrad.enable(recompute=True, fused_linear=fused)
    paddle.seed(11)
    net = Net()
    net.fail = fail
    MixPrecisionLayer(net, dtype="float16")
    x = paddle.randn([3, D])
    x.stop_gradient = False
    with pytest.raises(Exception) as info:
        out = (
            net.block(x)
            if mode == "none"
            else paddle_mgrad.recompute(net.block, x, use_reentrant=mode == "reentrant")
        )
        if fail == "op_check":  # main_grad swapped for one of another shape after the forward
            net.lin.weight.main_grad = paddle.zeros([D + 1, D])
        elif fail == "linear_forward":  # not reached: the forward refused
            raise AssertionError("the forward did not raise")
        out.sum().backward()
    return info.value


def assert_state_clean():
    assert paddle.is_grad_enabled()
    assert saved_hooks._stack() == []
    assert getattr(recomputing.state, "pack", None) is None
    assert getattr(backward_errors._state, "depth", 0) == 0
    assert backward_errors.current_pass() is None
    assert getattr(backward_errors._state, "error", None) is None


#: error kind -> (modes it applies to, the exception type, a fragment of its text)
FAILURES = {
    "user_forward": (MODES, ValueError, "user error in the forward"),
    "user_replay": (MODES[1:], (OSError, ValueError), "user error in the recomputation"),
    "inplace_replay": (MODES[1:], OSError, "can't use inplace strategy"),
    "determinism": (MODES[1:], RecomputeError, "not deterministic"),
    "op_check": (MODES, FusedLinearError, "dweight must be [K, N] = [4, 4]"),
}
#: (error kind, recompute mode, fused linear on): our op's check needs our op
CASES = [
    (fail, mode, fused)
    for fail, (modes, _, _) in sorted(FAILURES.items())
    for mode in modes
    for fused in (True, False)
    if fused or fail != "op_check"
]


@pytest.mark.probe
@pytest.mark.parametrize("fail,mode,fused", CASES)
def test_next_step_equals_a_fresh_process(fail, mode, fused, fresh_process):
    _, kind, text = FAILURES[fail]
    rng_before = paddle.get_rng_state()
    error = failing_step(mode, fail, fused)
    assert isinstance(error, kind) and text in str(error), repr(error)
    assert_state_clean()
    got = clean_step(mode, fused)
    want = fresh_process[f"{mode}-{'fused' if fused else 'unfused'}"]
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(np.array(got[key]), np.array(want[key]), err_msg=key)
    paddle.set_rng_state(rng_before)


@pytest.mark.parametrize("mode", MODES[1:])
def test_a_failed_recomputation_puts_the_rng_state_back(mode):
    """The recomputation replays the forward's RNG state; when it fails, the state it found is
    put back (the next draws are those a backward without error would have left)."""
    paddle_mgrad.disable()
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    paddle.seed(11)
    net = Net()
    net.fail = "user_replay"
    x = paddle.randn([3, D])
    x.stop_gradient = False
    out = paddle_mgrad.recompute(net.block, x, use_reentrant=mode == "reentrant")
    state = paddle.get_rng_state()
    expected = paddle.rand([16]).numpy()
    paddle.set_rng_state(state)
    with pytest.raises((OSError, ValueError)):
        out.sum().backward()
    np.testing.assert_array_equal(paddle.rand([16]).numpy(), expected)
    assert_state_clean()


def test_linear_forward_check_leaves_no_state():
    """A fused linear's forward refuses a main_grad of the wrong dtype (in the reentrant mode
    that forward runs in backward: the block's forward runs without grad): nothing is left
    behind, inside or outside a recompute."""
    for mode in MODES:
        paddle_mgrad.disable()
        paddle_mgrad.enable(recompute=True, fused_linear=True)
        lin = paddle.nn.Linear(D, D)
        lin.weight.main_grad = paddle.zeros([D, D], dtype="float16")
        x = paddle.randn([2, D])
        x.stop_gradient = False
        with pytest.raises(FusedLinearError, match="main_grad is"):
            if mode == "none":
                out = lin(x)
            else:
                out = paddle_mgrad.recompute(lin, x, use_reentrant=mode == "reentrant")
            out.sum().backward()
        assert_state_clean()
    paddle_mgrad.disable()


def test_plain_paddle_leaves_grad_mode_off_after_a_failed_replay():
    """What the tests above protect against (if Paddle fixes it, this fails and says so)."""
    paddle_mgrad.disable()
    net = Net()
    net.fail = "user_replay"
    x = paddle.randn([3, D])
    x.stop_gradient = False
    out = native_recompute(net.block, x, use_reentrant=False, preserve_rng_state=False)
    try:
        with pytest.raises(OSError, match="user error in the recomputation"):
            out.sum().backward()
        assert not paddle.is_grad_enabled()
    finally:
        paddle.set_grad_enabled(True)
