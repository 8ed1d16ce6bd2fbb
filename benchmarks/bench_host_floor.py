"""What the fused linear's host cost is made of, measured inside a model's step (one process).

    python benchmarks/bench_host_floor.py [--rounds 10 --steps 40 --layers 8 --width 64 --rows 8]

The no-recompute column of ``bench_host_overhead.py`` (its model: ``--layers`` blocks of
``nn.Linear(width, width)`` + ReLU under ``MixPrecisionLayer``, fp32 ``main_grad``), with
``paddle.nn.functional.linear`` replaced by stand-ins that do part of our linear's work, so that
the difference between two rows is what that part costs *in context*: a question to Paddle
costs several times more there than in a loop of its own, where Paddle's code stays in the
CPU's caches.  Rows, each against Paddle's own step in the same run:

* ``bare``: a ``PyLayer`` -- forward ``_C_ops.linear``, ``save_for_backward(x)``; backward our
  op into ``main_grad`` through Paddle's custom-op dispatch and ``_C_ops.matmul`` for ``dx``;
* ``bare, entry``: the same backward as one call of the op library's fast entry
  (``linear_bwd``: no custom-op dispatch);
* ``bare, no dx``: the entry without an input gradient (``wgrad_add``: what ``dx`` costs);
* ``+ guard``: ``bare, entry`` as a ``GuardedPyLayer`` with the second-backward guard;
* ``ours``: ``paddle_mgrad.enable(fused_linear=True)`` -- routing, checks, counters, guard.

The stand-ins skip every check (they are not correct outside this model); the rows interleave
round by round; each figure is the 10th percentile [median] of per-step process CPU times.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_host_overhead as host  # noqa: E402  (zlib before paddle there)
import paddle  # noqa: E402
from paddle import _C_ops  # noqa: E402

import paddle_mgrad  # noqa: E402
from paddle_mgrad import ops  # noqa: E402
from paddle_mgrad.autograd import passes  # noqa: E402


def stand_ins(run, entry):
    class Bare(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(x)
            ctx.w, ctx.b = w, b
            return _C_ops.linear(x, w, b)

        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensor()
            w, b = ctx.w, ctx.b
            run("pmg_fused_wgrad_add", x, dy, w.main_grad, b.main_grad, True, True)
            return _C_ops.matmul(dy, w, False, True), None, None

    class Entry(Bare):
        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensor()
            dx, _, _ = entry.linear_bwd(x, dy, ctx.w, ctx.w.main_grad, ctx.b.main_grad, True)
            return dx, None, None

    class NoDx(Bare):
        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensor()
            entry.wgrad_add(x, dy, ctx.w.main_grad, ctx.b.main_grad, True, True)
            return dy, None, None  # (dy has x's shape in this model: a stand-in, no GEMM)

    class Guarded(passes.GuardedPyLayer):
        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(x)
            ctx.w, ctx.b = w, b
            passes.stash_guard(ctx)
            return _C_ops.linear(x, w, b)

        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensor()
            dx, _, _ = entry.linear_bwd(x, dy, ctx.w, ctx.w.main_grad, ctx.b.main_grad, True)
            passes.ran(ctx)
            return dx, None, None

    return {"bare": Bare, "bare, entry": Entry, "bare, no dx": NoDx, "+ guard": Guarded}


def main():
    ap = argparse.ArgumentParser()
    host.add_arguments(ap, rounds=10)
    args = ap.parse_args()
    blocks, _model, x0 = host.build(args)
    host.run_cell(blocks, x0, "fused", "none", 2)  # builds/loads the op, allocates main_grad
    run, entry = ops.cpu_runner("float32"), ops.cpu_entry("float32")
    if run is None or entry is None:
        raise SystemExit(
            "the C++ op (with its fast entry) did not load: " + str(ops.fallback_reason())
        )
    functional = paddle.nn.functional
    linear = functional.linear  # the function object (enable() swaps its code, not it)
    rows = {"paddle": None, **stand_ins(run, entry), "ours": "ours"}
    step = host.make_step(blocks, x0, "none")
    samples = {r: [] for r in rows}
    try:
        for _ in range(args.rounds):
            for r, cls in rows.items():
                if cls == "ours":
                    paddle_mgrad.enable(recompute=False, fused_linear=True)
                else:
                    paddle_mgrad.disable()
                if cls not in (None, "ours"):
                    functional.linear = lambda x, weight, bias=None, name=None, c=cls: c.apply(
                        x, weight, bias
                    )
                try:
                    step()  # warm
                    samples[r] += host.time_steps(step, args.steps)
                finally:
                    functional.linear = linear
    finally:
        paddle_mgrad.disable()
    p10 = {r: host.percentile(v, 0.1) for r, v in samples.items()}
    p50 = {r: host.percentile(v, 0.5) for r, v in samples.items()}
    print(
        f"paddle {paddle.__version__}, {host.cpu_name()}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS')}, {args.layers} x Linear({args.width}, "
        f"{args.width}) + ReLU, {args.rows} rows, no recompute; per-step process CPU time, "
        f"10th percentile [median] of {args.rounds} rounds x {args.steps} steps"
    )
    for r in rows:
        print(
            f"{r:16s} {p10[r] * 1e6:8.0f} us [{p50[r] * 1e6:6.0f}]   "
            f"{p10[r] / p10['paddle']:5.3f}x [{p50[r] / p50['paddle']:5.3f}x]"
        )
    print("ratios: row / Paddle's own step at the 10th percentile [at the median]")


if __name__ == "__main__":
    main()
