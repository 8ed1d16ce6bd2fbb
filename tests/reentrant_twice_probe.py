"""Crash probe for tests/recomputation/test_recomputation.py: a second ordinary backward through the same
reentrant ``recompute`` (``backward(retain_graph=True)`` then ``backward()``, or ``backward()``
twice).  Paddle's reentrant recompute is a PyLayer; Paddle releases a PyLayer node's context
after its first backward, so a second run dereferences it: plain Paddle (``fleet.utils
.recompute(..., use_reentrant=True)``) dies of SIGSEGV on 3.3.1 and 2.6.2.  paddle_mgrad's
node guard raises ``RecomputeError`` first.  ``python reentrant_twice_probe.py ours`` prints one
``RESULT {json}`` line (mode -> what happened); ``native MODE`` runs Paddle's own recompute (for
the record: it crashes)."""

import json
import sys
import zlib  # noqa: F401  (before paddle on 2.6)

import numpy as np
import paddle

MODES = ("retain_then_backward", "backward_twice", "multi_output", "retain_then_grad")


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(4, 6)
        self.fc2 = paddle.nn.Linear(6, 3)

    def forward(self, x):
        h = paddle.tanh(self.fc1(x))
        return self.fc2(h), h


def grads(model, x):
    return [
        None if t.grad is None else t.grad.numpy().copy() for t in [x] + list(model.parameters())
    ]


def first_loss(mode, y, h):
    return y.sum() + h.sum() if mode == "multi_output" else y.sum()


def scenario(mode, recompute):
    paddle.seed(7)
    model = Block()
    x = paddle.randn([5, 4])
    x.stop_gradient = False
    # the reference: the same first backward without recompute
    first_loss(mode, *model(x)).backward()
    ref = grads(model, x)
    model.clear_gradients()
    x.clear_gradient()
    out = {}
    y, h = recompute(model, x, use_reentrant=True)
    try:
        first_loss(mode, y, h).backward(retain_graph=mode != "backward_twice")
        out["first_ok"] = all(
            np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref, grads(model, x))
        )
        if mode == "multi_output":
            h.sum().backward()  # through the other output only
        elif mode == "retain_then_grad":
            paddle.grad(y.sum(), x)
        else:
            y.sum().backward()
        out["error"] = None
    except Exception as e:  # noqa: BLE001
        out["error"] = type(e).__name__
        out["message"] = str(e)[:600]
    # the process is sound afterwards: grad mode on, a fresh recompute forward/backward is right
    out["grad_enabled_after"] = paddle.is_grad_enabled()
    model.clear_gradients()
    x.clear_gradient()
    first_loss(mode, *recompute(model, x, use_reentrant=True)).backward()
    out["fresh_ok"] = all(
        np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref, grads(model, x))
    )
    return out


if __name__ == "__main__":
    if sys.argv[1] == "native":
        from paddle.distributed.fleet.utils import recompute

        print("RESULT " + json.dumps({sys.argv[2]: scenario(sys.argv[2], recompute)}), flush=True)
    else:
        import paddle_mgrad

        paddle_mgrad.enable()  # recompute + fused_linear: Block's linears are our PyLayers
        print(
            "RESULT " + json.dumps({m: scenario(m, paddle_mgrad.recompute) for m in MODES}),
            flush=True,
        )
