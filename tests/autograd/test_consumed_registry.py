"""The registry of nodes an ordinary backward already ran (``autograd.passes._consumed``).

Every backward of a fused linear records its node there (a weak reference to the node's guard,
no callback: a per-node callback would cost the hot path).  Entries of dead guards
are purged in bulk when the registry has doubled.  What must hold: the registry stays bounded
over a training loop, and a consumed node that is still alive (a retained graph) is still
caught after any number of purges -- by ``paddle.grad`` before Paddle copies the graph, and by
a second ``backward()`` -- instead of the segfault Paddle's released PyLayer context causes.
Run in a child process: a miss would be a crash.

Nodes are found without ``Tensor.grad_fn`` in the forward (Paddle's getter keeps the node it
wraps alive for good: the forward asking it leaked a node per fused linear per step), so the
first ``paddle.grad`` of a process finds ours by their edges: checked here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import zlib, json
import paddle, paddle_mgrad
from paddle_mgrad import FusedLinearError
from paddle_mgrad.autograd import passes
passes._PURGE_MIN = 4
passes._purge_at = 4
paddle_mgrad.enable(recompute=False, fused_linear=True)
lin = paddle.nn.Linear(4, 3)
x = paddle.randn([2, 4])
x.stop_gradient = False
y = lin(x)
y.sum().backward(retain_graph=True)  # consumed; y keeps the node alive
sizes = []
for _ in range(40):  # a training loop: each step's graph dies
    lin(paddle.randn([2, 4])).sum().backward()
    sizes.append(len(passes._consumed))
out = {"max": max(sizes), "live": len(passes._purge())}
for name, run in (("grad", lambda: paddle.grad(y.sum(), x)), ("backward", lambda: y.sum().backward())):
    try:
        run()
        out[name] = "no error"
    except FusedLinearError as e:
        out[name] = "caught" if "already ran" in str(e) else str(e)[:200]
print("RESULT " + json.dumps(out), flush=True)
"""


def _child(code, *args):
    """Run ``code`` in a fresh interpreter (paddle_mgrad from this checkout, PADDLE_MGRAD
    unset); it must not end by a signal and prints one ``RESULT <json>`` line: returned."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("PADDLE_MGRAD", None)
    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode >= 0, (f"killed by signal {-r.returncode}", r.stderr[-3000:])
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.probe
def test_registry_stays_bounded_and_a_live_consumed_node_survives_every_purge():
    out = _child(CHILD)
    assert out["max"] <= 5, out  # purged at 4 entries: the retained node and the newest
    assert out["live"] == 1, out  # the retained graph's node, nothing else
    assert out["grad"] == "caught" and out["backward"] == "caught", out


FIRST_GRAD = r"""
import zlib, sys, json
import numpy as np, paddle, paddle_mgrad
from paddle.distributed.fleet.utils import recompute
from paddle_mgrad.autograd import passes
mode = sys.argv[1]
paddle.seed(1)
lin, lin2 = paddle.nn.Linear(4, 3), paddle.nn.Linear(3, 3)
x = paddle.randn([2, 4])
x.stop_gradient = False

def f(x):
    return paddle.tanh(lin2(paddle.tanh(lin(x))))  # the linears' outputs die at once

def run():
    if mode == "plain":
        z = f(x)
    else:
        z = recompute(f, x, use_reentrant=mode == "reentrant",
                      preserve_rng_state=not paddle.__version__.startswith("2."))
    g = paddle.grad(z.sum(), [x, lin.weight, lin2.bias], allow_unused=True)
    return [None if t is None else t.numpy().tolist() for t in g]

ref = run()  # plain Paddle's (paddle_mgrad not on yet: our paddle.grad not installed)
paddle_mgrad.enable(recompute=True, fused_linear=True)
seen = passes._functional_seen
got = run()
print("RESULT " + json.dumps({"seen_before": seen, "ok": all(
    (a is None and b is None) or (a is not None and b is not None and np.allclose(a, b, atol=1e-6))
    for a, b in zip(ref, got)), "ref": ref, "got": got}), flush=True)
"""


@pytest.mark.probe
@pytest.mark.parametrize("mode", ["plain", "non_reentrant", "reentrant"])
def test_first_paddle_grad_finds_nodes_whose_outputs_died(mode):
    """The first ``paddle.grad`` of a process (so no forward recorded its node's address, see
    ``NodeGuard.ptr``) through fused linears whose outputs are gone: each node is found by its
    edges -- under recompute, where the saved input is a recomputed tensor, by its
    parameters' -- and the gradients equal plain Paddle's."""
    out = _child(FIRST_GRAD, mode)
    assert out["seen_before"] is False  # the case under test: no address recorded in forward
    assert out["ok"], out
