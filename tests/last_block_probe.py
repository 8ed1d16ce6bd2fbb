"""Probe for tests/recomputation/test_last_block.py: what keeping a step's last recompute block
whole costs, read from the host allocator as a ``budget:`` plan reads it, in a fresh process
(where the allocator's peak is this run's own: in the test process an earlier test's peak
hides a step's).  ``python last_block_probe.py HEAD FRACTION``: four MLP blocks, each a
non-reentrant recompute block under ``budget:FRACTION``, then a loss head -- ``light`` (a sum:
the blocks' forward holds the step's peak) or ``heavy`` (a wide projection whose output and
gradient outweigh a block's activations).  Prints one ``RESULT {json}`` line: the plan's
report, the planner's reading, the policy's counters, and whether every result equals the
run without recompute bit for bit."""

import json
import sys
import zlib  # noqa: F401  (before paddle on 2.6)

import numpy as np
import paddle

import paddle_mgrad
from paddle_mgrad import stats
from paddle_mgrad.recomputation import policy as policy_mod

LAYERS, STEPS, ROWS, D, F = 4, 3, 256, 64, 512


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = paddle.nn.LayerNorm(D)
        self.up = paddle.nn.Linear(D, F)
        self.down = paddle.nn.Linear(F, D)

    def forward(self, h):
        return h + self.down(paddle.nn.functional.gelu(self.up(self.norm(h))))


def run(head, policy):
    paddle.seed(3)
    layers = paddle.nn.LayerList([Block() for _ in range(LAYERS)])
    wide = paddle.randn([D, 64 * F]) * 0.01 if head == "heavy" else None
    x = paddle.randn([ROWS, D])
    out = []
    for _ in range(STEPS):
        h = x * 1.0
        for layer in layers:
            if policy is None:
                h = layer(h)
            else:
                h = paddle_mgrad.recompute(layer, h, use_reentrant=False, policy=policy)
        loss = h.sum() if head == "light" else (h @ wide).square().sum()
        loss.backward()
        out.append(loss.numpy())
    grads = [p.grad.numpy() for p in layers.parameters()]
    return out + grads


def main(head, fraction):
    name = f"budget:{fraction}"
    got = run(head, name)  # (first: no earlier peak hides its steps')
    ref = run(head, None)
    policy = policy_mod.resolve(name)
    (plan,) = stats.snapshot()["plans"][policy.name].values()
    result = {
        "identical": all(np.array_equal(a, b) for a, b in zip(got, ref)),
        "head_raise": policy.planner.head_raise,
        "plan": {k: plan[k] for k in ("last_block", "last_block_bytes", "block_bytes")},
        "counters": stats.snapshot()["policy"][policy.name],
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
