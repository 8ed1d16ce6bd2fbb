"""Host cost of paddle_mgrad's fused linear and recompute vs Paddle's own path (one process).

    python benchmarks/bench_host_overhead.py [--rounds 15 --steps 40 --layers 8 --width 64 --rows 8]
        [--policies gemm budget:0.5]

A model small enough that the GEMMs are negligible -- ``--layers`` blocks of
``nn.Linear(width, width)`` + ReLU on a ``rows``-row batch under ``MixPrecisionLayer`` (fp32
``main_grad``) -- runs forward + backward.  What is left is what the host spends dispatching:
the cost users pay per layer on a GPU (asynchronous GEMMs) and on a CPU with a fast GEMM.

Three columns, the recompute mode: none, non-reentrant, reentrant (each block under
``paddle.distributed.fleet.utils.recompute``, called by that name in every row as a user
would; after ``paddle_mgrad.enable(recompute=True)`` the name runs ours).  Four rows:

* ``paddle``: ``paddle_mgrad.disable()`` -- Paddle's own linear and recompute, the baseline;
* ``fused linear``: ``enable(recompute=True, fused_linear=True)``;
* ``recompute only``: ``enable(recompute=True, fused_linear=False)``;
* ``paddle again (A/A)``: the baseline once more, timed as the rows of ours are: its ratio to
  the baseline is what the method reads where nothing differs (a cell within it of 1.0 is no
  measured difference);
* with ``--policies``, one row per recompute policy: as ``fused linear``, with
  ``PADDLE_MGRAD_RECOMPUTE_POLICY`` set to it (recompute columns only), its ratio to the
  ``fused linear`` row (full recompute) beside the one to Paddle's: what the policy's bookkeeping
  costs the host where the GEMMs it spares cost nearly nothing.

All twelve cells run in ONE process, interleaved round by round (each cell starts from
``disable()`` and enables its row's configuration; each round starts one cell later than the
round before), so machine noise hits them alike.  Every step is timed on its own
in process CPU time (``time.process_time``); a cell's figure is the 10th percentile of its
``--rounds`` x ``--steps`` step times, with the median beside it.  These machines are shared
VMs whose speed swings by 2x from second to second: the minimum over a few rounds of many steps
(this script's first method) moved by +-0.2 between runs, the low percentile of single steps
by a few hundredths.  Printed: per-step CPU time of each cell (us) and the ratio ours / Paddle's
own per column, at the 10th percentile and at the median.

Every fused-linear round asserts that the fused path ran for every linear: the
``into_main_grad`` counter (:mod:`paddle_mgrad.stats`) grows by exactly 2 (weight and bias) per
linear per step.  ``--profile MODE`` runs cProfile on one cell instead and prints the top
functions (MODE like ``fused:none``, ``paddle:reentrant``).  ``--split`` times the forward
(up to the loss) and the backward of each step apart, without recompute, for the fused linear
and Paddle's own: where the host cost of the first column goes.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import zlib  # noqa: F401,E402  (before paddle: Paddle 2.6)

import paddle  # noqa: E402
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py; bench_host_floor reads it here)
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer  # noqa: E402

import paddle_mgrad  # noqa: E402
from paddle_mgrad import stats  # noqa: E402
from paddle_mgrad._compat import IS_PADDLE_2  # noqa: E402

RECOMPUTE = ("none", "non_reentrant", "reentrant")
ROWS = {
    "paddle": None,
    "fused": dict(recompute=True, fused_linear=True),
    "recompute": dict(recompute=True, fused_linear=False),
    # Paddle's own path again, timed as a row of ours: its ratio is the method's own error
    "again": None,
}
LABEL = {
    "paddle": "paddle (baseline)",
    "fused": "fused linear",
    "recompute": "recompute only",
    "again": "paddle again (A/A)",
}
POLICY_ENV = "PADDLE_MGRAD_RECOMPUTE_POLICY"
POLICY_ROW = "policy:"  # a row's key: POLICY_ROW + the policy (fused linear, that policy)


class Block(paddle.nn.Layer):
    def __init__(self, width):
        super().__init__()
        self.lin = paddle.nn.Linear(width, width)

    def forward(self, x):
        return paddle.nn.functional.relu(self.lin(x))


def build(args):
    paddle.seed(0)
    blocks = paddle.nn.LayerList([Block(args.width) for _ in range(args.layers)])
    # dtype only names the half type; the parameters stay fp32, main_grad is fp32
    model = MixPrecisionLayer(blocks, dtype="bfloat16")
    x0 = paddle.randn([args.rows, args.width])
    return blocks, model, x0


def switch(row):
    """Switch to ``row``'s configuration (a policy row: the fused linear, the policy set), from
    ``disable()``: a cell has what a process of its configuration installs (the backward
    wrappers a fused linear's or a recompute's first call installs), nothing another row left."""
    os.environ.pop(POLICY_ENV, None)
    if row.startswith(POLICY_ROW):
        os.environ[POLICY_ENV] = row[len(POLICY_ROW) :]
        row = "fused"
    paddle_mgrad.disable()
    if ROWS[row] is not None:
        paddle_mgrad.enable(**ROWS[row])


def make_step(blocks, x0, rmode):
    # looked up per call, as user code does: enable() re-points this name to ours
    import paddle.distributed.fleet.utils as fu

    # Paddle 2.6's own non-reentrant recompute cannot preserve the RNG state on a CPU; both
    # sides run with the same setting
    preserve = not IS_PADDLE_2

    def step():
        x = x0.detach()
        x.stop_gradient = False
        h = x
        for b in blocks:
            if rmode == "none":
                h = b(h)
            else:
                h = fu.recompute(
                    b, h, use_reentrant=(rmode == "reentrant"), preserve_rng_state=preserve
                )
        h.sum().backward()

    return step


def make_split_step(blocks, x0):
    """A step without recompute that returns the process CPU time of its forward and of its
    backward."""
    clock = time.process_time

    def step():
        x = x0.detach()
        x.stop_gradient = False
        t0 = clock()
        h = x
        for b in blocks:
            h = b(h)
        loss = h.sum()
        t1 = clock()
        loss.backward()
        return t1 - t0, clock() - t1

    return step


def split(blocks, x0, rounds, steps):
    """``--split``: forward and backward apart, fused linear against Paddle's own, interleaved
    round by round; prints the 10th percentile [median] of each and the ratios."""
    samples = {r: ([], []) for r in ("paddle", "fused")}
    for _ in range(rounds):
        for r in samples:
            switch(r)
            step = make_split_step(blocks, x0)
            step()  # warm
            for _ in range(steps):
                fwd, bwd = step()
                samples[r][0].append(fwd)
                samples[r][1].append(bwd)
    paddle_mgrad.disable()
    print(f"paddle {paddle.__version__}, {cpu_name()}, no recompute, forward and backward apart")
    for i, part in enumerate(("forward", "backward")):
        base = [percentile(samples["paddle"][i], q) for q in (0.1, 0.5)]
        ours = [percentile(samples["fused"][i], q) for q in (0.1, 0.5)]
        print(
            f"{part:9s} paddle {base[0] * 1e6:7.0f} us [{base[1] * 1e6:6.0f}]  fused linear "
            f"{ours[0] * 1e6:7.0f} us [{ours[1] * 1e6:6.0f}]  {ours[0] / base[0]:5.3f}x "
            f"[{ours[1] / base[1]:5.3f}x]"
        )


def time_steps(step, steps):
    """Process CPU time of each of ``steps`` calls of ``step`` (warmed by the caller)."""
    clock = time.process_time
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        times.append(clock() - t0)
    return times


def run_cell(blocks, x0, row, rmode, steps):
    switch(row)
    step = make_step(blocks, x0, rmode)
    step()  # warm: first micro-step allocations, lazy installs
    before = stats.snapshot()["linear"]["into_main_grad"]
    times = time_steps(step, steps)
    got = stats.snapshot()["linear"]["into_main_grad"] - before
    want = 2 * len(blocks) * steps if row == "fused" or row.startswith(POLICY_ROW) else 0
    if got != want:
        raise SystemExit(
            f"{row}/{rmode}: into_main_grad grew by {got}, expected {want} "
            "(the fused path was not taken for every linear)"
        )
    return times


def percentile(samples, q):
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))]


def add_arguments(ap, rounds):
    """The rounds and steps to time and the model of :func:`build` (also bench_host_floor's)."""
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)


def main():
    ap = argparse.ArgumentParser()
    add_arguments(ap, rounds=15)
    ap.add_argument("--profile", default=None, help="ROW:RECOMPUTE, e.g. fused:none")
    ap.add_argument("--split", action="store_true", help="forward and backward apart")
    ap.add_argument("--policies", nargs="*", default=[], help="recompute policies, a row each")
    args = ap.parse_args()
    blocks, model, x0 = build(args)
    if args.split:
        split(blocks, x0, args.rounds, args.steps)
        return
    if args.profile:
        import cProfile
        import pstats

        row, rmode = args.profile.split(":")
        run_cell(blocks, x0, row, rmode, 5)
        switch(row)
        step = make_step(blocks, x0, rmode)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(35)
        paddle_mgrad.disable()
        return

    rows = [*ROWS, *(POLICY_ROW + p for p in args.policies)]
    cells = [(r, m) for m in RECOMPUTE for r in rows]
    cells = [(r, m) for r, m in cells if not (r.startswith(POLICY_ROW) and m == "none")]
    samples = {c: [] for c in cells}
    for i in range(args.rounds):
        # each round starts one cell later: no cell always runs right after the same other one
        # (what a cell leaves in the caches and the allocator falls on different cells)
        k = i % len(cells)
        for r, m in cells[k:] + cells[:k]:
            samples[r, m] += run_cell(blocks, x0, r, m, args.steps)
    paddle_mgrad.disable()
    p10 = {c: percentile(v, 0.1) for c, v in samples.items()}
    p50 = {c: percentile(v, 0.5) for c, v in samples.items()}

    print(
        f"paddle {paddle.__version__}, {cpu_name()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"{args.layers} x Linear({args.width}, {args.width}) + ReLU, {args.rows} rows, "
        f"MixPrecisionLayer fp32 main_grad; process CPU time per fwd+bwd step, 10th "
        f"percentile [median] of {args.rounds} rounds x {args.steps} steps; fused path "
        f"verified (into_main_grad)"
    )
    print(f"{'':22s}" + "".join(f"{m:>28s}" for m in RECOMPUTE))
    for r in rows:
        cells = []
        for m in RECOMPUTE:
            if (r, m) not in p10:
                cells.append("-")
                continue
            us = p10[r, m] * 1e6
            if r.startswith(POLICY_ROW):
                cells.append(
                    f"{us:9.0f} us {p10[r, m] / p10['paddle', m]:5.3f}x "
                    f"full {p10[r, m] / p10['fused', m]:5.3f}x"
                )
            elif r == "paddle":
                cells.append(f"{us:9.0f} us [{p50[r, m] * 1e6:5.0f}]")
            else:
                cells.append(
                    f"{us:9.0f} us {p10[r, m] / p10['paddle', m]:5.3f}x "
                    f"[{p50[r, m] / p50['paddle', m]:5.3f}x]"
                )
        print(f"{LABEL.get(r, r):22s}" + "".join(f"{c:>28s}" for c in cells))
    print(
        "ratios: ours / Paddle's own in the same column at the 10th percentile [at the median] "
        "(< 1: ours costs the host less); a policy row: also / the fused linear row (full)"
    )


if __name__ == "__main__":
    main()
