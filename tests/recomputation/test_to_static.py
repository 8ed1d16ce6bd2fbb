"""``paddle.jit.to_static`` of a model that calls recompute.

Paddle 2.6.2's default translator (SOT), left to simulate paddle_mgrad's recompute, fails on the
first training call (``AttributeError: type object 'module' has no attribute 'get_state'``
from ``rng.capture``; with the fused linear on, a ``TypeError`` from a registry install), where
plain Paddle trains.  So recompute runs as dygraph under SOT, as Paddle's does
(``recomputation/to_static.py``).  Each run is its own process (SOT caches translations per
process): plain Paddle and paddle_mgrad (``enable(recompute=True, fused_linear=True)``),
non-reentrant and reentrant, SOT and ``full_graph=True``, 3 SGD steps; every configuration
is compared with plain eager training without recompute (the same arithmetic) and with plain
Paddle's to_static run where Paddle's runs.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from helpers import PADDLE2, ROOT

# heavy (two trainings); one worker runs them all: the module-scoped ``runs`` once, not per worker
pytestmark = [pytest.mark.heavy, pytest.mark.probe, pytest.mark.xdist_group("to_static_runs")]

SCRIPT = """
import json, sys, traceback
import numpy as np
import paddle
impl = sys.argv[1]
if impl == "ours":
    import paddle_mgrad
    paddle_mgrad.enable(recompute=True, fused_linear=True)
from paddle.distributed.fleet.utils import recompute
paddle.set_device("cpu")

rs = np.random.RandomState(0)
DATA = [rs.standard_normal([4, 8]).astype("float32") for _ in range(3)]


def train(mode, translator):
    paddle.seed(1)

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.a = paddle.nn.Linear(8, 16)
            self.b = paddle.nn.Linear(16, 8)

        def forward(self, h):
            return self.b(paddle.tanh(self.a(h)))

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.pre = paddle.nn.Linear(8, 8)
            self.blk = Block()
            self.head = paddle.nn.Linear(8, 1)

        def forward(self, x):
            h = self.pre(x)
            if mode == "none":
                h = self.blk(h)
            else:
                extra = {}
                if impl == "plain" and mode == "non_reentrant":
                    # Paddle 2.6 refuses to preserve the CPU RNG state; no random op here
                    extra["preserve_rng_state"] = False
                fn = recompute
                if impl == "ours" and translator == "sot_direct":  # paddle_mgrad.recompute
                    fn = paddle_mgrad.recompute
                h = fn(self.blk, h, use_reentrant=(mode == "reentrant"), **extra)
            return self.head(paddle.tanh(h))

    model = Model()
    run = model
    if translator != "eager":
        run = paddle.jit.to_static(model, full_graph=(translator == "full"))
    before = dict(paddle_mgrad.stats.linear) if impl == "ours" else {}
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    losses = []
    for x in DATA:
        loss = (run(paddle.to_tensor(x)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    params = np.concatenate([p.numpy().ravel() for p in model.parameters()])
    # our fused linear's backward ran for the block's linears (dygraph), not only the others
    fused = (paddle_mgrad.stats.linear["backward"] - before["backward"]) if impl == "ours" else 0
    return {"losses": losses, "params": params.tolist(), "fused_backward": fused}


out = {}
configs = [("none", "eager")] + [(m, t) for m in ("non_reentrant", "reentrant")
                                 for t in ("sot", "full")]
if impl == "ours":
    configs += [(m, "sot_direct") for m in ("non_reentrant", "reentrant")]
for mode, translator in configs:
    key = mode + "/" + translator
    try:
        out[key] = train(mode, translator)
    except Exception as e:
        out[key] = {"error": type(e).__name__ + ": " + str(e).splitlines()[0][:300]}
if impl == "ours":
    out["recomputations"] = paddle_mgrad.stats.recompute["recomputations"]
print("RESULT " + json.dumps(out))
"""


def _run(impl, script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_MGRAD")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    if os.environ.get("PADDLE_MGRAD_CACHE"):
        env["PADDLE_MGRAD_CACHE"] = os.environ["PADDLE_MGRAD_CACHE"]
    r = subprocess.run(
        [sys.executable, str(script), impl],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    script = tmp_path_factory.mktemp("to_static") / "train.py"  # full_graph reads the source
    script.write_text(textwrap.dedent(SCRIPT))
    return {"plain": _run("plain", script), "ours": _run("ours", script)}


CONFIGS = [f"{m}/{t}" for m in ("non_reentrant", "reentrant") for t in ("sot", "full")]
DIRECT = [f"{m}/sot_direct" for m in ("non_reentrant", "reentrant")]


def _close(a, b):
    for field in ("losses", "params"):
        np.testing.assert_allclose(a[field], b[field], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", CONFIGS + DIRECT)
def test_trains_as_eager_training_without_recompute(runs, config):
    ours = runs["ours"][config]
    assert "error" not in ours, ours
    _close(ours, runs["plain"]["none/eager"])
    if "sot" in config:  # the recomputed block ran as dygraph: its 2 linears are ours
        assert ours["fused_backward"] >= 3 * 2, ours["fused_backward"]


@pytest.mark.parametrize("config", CONFIGS)
def test_equal_to_plain_paddle_where_plain_paddle_runs(runs, config):
    plain = runs["plain"][config]
    if "error" in plain:
        # Paddle 2.6.2's own recompute under full_graph=True fails ('NoneType' object has no
        # attribute '_has_grad'); asserted so that a Paddle fix shows here
        assert PADDLE2 and config.endswith("/full"), plain
        return
    _close(runs["ours"][config], plain)


def test_sot_runs_our_recompute_as_dygraph(runs):
    """Under SOT the recompute really ran (ours, as dygraph): 3 steps x 1 recomputation for
    non-reentrant, and 3 for reentrant (its input needs grad); full_graph=True hands the
    block to Paddle's static recompute (no dygraph recomputation)."""
    assert runs["ours"]["recomputations"] == 12  # + the two paddle_mgrad.recompute runs
