"""Step time and memory: no recompute vs Paddle's recompute vs paddle_mgrad.recompute.

A stack of MLP blocks (Linear d->4d, GELU, Linear 4d->d, residual).  Each
configuration runs in its own subprocess (clean allocator statistics), several
rounds interleaved, so machine noise hits all of them alike; medians are
printed as ratios against Paddle's own recompute in the same run.

    python benchmarks/bench_recompute.py [--blocks 8 --hidden 512 --tokens 2048]

``fused_*``: ``paddle_mgrad.enable(fused_linear=True)``, then no recompute, full recompute or
the ``gemm`` recompute policy (the linears' outputs kept from the forward, nothing multiplied
in the replay), non-reentrant; printed as time and peak against ``fused_none``.

``ours_*_values`` run paddle_mgrad's recompute with ``determinism_check="values"``
(fingerprints of the recomputed activations); their last column is the step time
against the same mode with the default shape check, in the same run.
``cpu/shapes`` is the same ratio in process CPU time (less sensitive to other
load on a shared machine); ``fingerprint`` is the share of the step's wall time spent
computing fingerprints, timed inside the step (the cost of "values" without the noise
of comparing two runs).  ``--threads`` sets OMP_NUM_THREADS for every child (default: the number of CPUs).

Memory is Paddle's host allocator statistics: ``peak`` is the peak allocated
during a training step, ``saved`` what stays allocated between the end of the
forward and the start of backward (what recompute is for).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

MODES = [
    "none",
    "paddle_non_reentrant",
    "ours_non_reentrant",
    "ours_non_reentrant_values",
    "paddle_reentrant",
    "ours_reentrant",
    "ours_reentrant_values",
    "fused_none",
    "fused_full",
    "fused_gemm",
]
#: paddle_mgrad switched on (fused linear + recompute), no recompute / full / the gemm policy
#: (non-reentrant): their time and peak are printed against fused_none's
POLICY_MODES = {"fused_none": None, "fused_full": "full", "fused_gemm": "gemm"}


def child(args):
    import time
    import zlib  # noqa: F401

    import paddle
    from paddle.base import core
    from paddle.distributed.fleet.utils import recompute as paddle_recompute

    import paddle_mgrad
    from paddle_mgrad._compat import HOST_MEMORY_RESET_PEAK, IS_PADDLE_2

    paddle.seed(0)
    d, blocks = args.hidden, args.blocks

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.up = paddle.nn.Linear(d, 4 * d)
            self.down = paddle.nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(paddle.nn.functional.gelu(self.up(x)))

    net = paddle.nn.LayerList([Block() for _ in range(blocks)])
    mode = args.child
    fp_time = [0.0]
    run_block = None
    if mode in POLICY_MODES:
        paddle_mgrad.enable(recompute=True, fused_linear=True)
        if POLICY_MODES[mode] is not None:

            def run_block(f, x, policy=POLICY_MODES[mode]):
                return paddle_mgrad.recompute(f, x, use_reentrant=False, policy=policy)
    elif mode != "none":
        impl = paddle_recompute if mode.startswith("paddle") else paddle_mgrad.recompute
        reentrant = "_reentrant" in mode and "non_reentrant" not in mode
        preserve = not (mode == "paddle_non_reentrant" and IS_PADDLE_2)
        extra = {"determinism_check": "values"} if mode.endswith("_values") else {}
        if extra:  # time spent fingerprinting, measured inside the step (CPU: synchronous)
            from paddle_mgrad.recomputation import non_reentrant, reentrant

            def timed(fp):
                def f(t):
                    t0 = time.perf_counter()
                    try:
                        return fp(t)
                    finally:
                        fp_time[0] += time.perf_counter() - t0

                return f

            non_reentrant.fingerprint = timed(non_reentrant.fingerprint)
            reentrant.fingerprint = timed(reentrant.fingerprint)

        def _recompute_block(f, x):
            return impl(f, x, use_reentrant=reentrant, preserve_rng_state=preserve, **extra)

        run_block = _recompute_block

    x0 = paddle.randn([args.tokens, d])
    times, cpu, peaks, saved, fps = [], [], [], [], []
    for step in range(args.warmup + args.steps):
        x = x0.detach()
        x.stop_gradient = False
        base = core.host_memory_stat_current_value("Allocated", 0)
        if HOST_MEMORY_RESET_PEAK is not None:
            HOST_MEMORY_RESET_PEAK("Allocated", 0)
        fp_time[0] = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        h = x
        for b in net:
            h = b(h) if run_block is None else run_block(b, h)
        loss = h.mean()
        after_fwd = core.host_memory_stat_current_value("Allocated", 0)
        loss.backward()
        for p in net.parameters():
            p.clear_gradient()
        t1, c1 = time.perf_counter(), time.process_time()
        del h, loss, x  # so the next step's baseline holds only parameters and x0
        if step >= args.warmup:
            times.append(t1 - t0)
            cpu.append(c1 - c0)
            fps.append(fp_time[0] / (t1 - t0))
            peaks.append(core.host_memory_stat_peak_value("Allocated", 0) - base)
            saved.append(after_fwd - base)
    print(
        json.dumps(
            {
                "mode": mode,
                "time": statistics.median(times),
                "cpu": statistics.median(cpu),
                "fp_share": statistics.median(fps),
                "peak": max(peaks),
                "saved": max(saved),
            }
        )
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES)
    )
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        return child(args)

    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}")
    res = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            cmd = [sys.executable, __file__, "--child", m] + [
                f"--{k}={getattr(args, k)}"
                for k in ("blocks", "hidden", "tokens", "steps", "warmup")
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                res[m].append(None)
                print(f"{m}: failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                continue
            res[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
    import paddle  # only for the version line

    print(
        f"paddle {paddle.__version__}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, "
        f"{args.blocks} blocks, hidden {args.hidden}, tokens {args.tokens}, "
        f"median of {args.rounds} rounds x {args.steps} steps"
    )
    summary = {}
    for m in modes:
        ok = [r for r in res[m] if r]
        if ok:
            summary[m] = {
                "time": statistics.median(r["time"] for r in ok),
                "cpu": statistics.median(r["cpu"] for r in ok),
                "fp_share": statistics.median(r["fp_share"] for r in ok),
                "peak": max(r["peak"] for r in ok),
                "saved": max(r["saved"] for r in ok),
            }
    print(
        "(time/base, peak/base: against Paddle's recompute of the same kind; fused_*: against "
        "fused_none)"
    )
    print(
        f"{'mode':26s} {'step ms':>9s} {'peak MiB':>9s} {'saved MiB':>10s} {'time/base':>12s} "
        f"{'peak/base':>12s} {'time/shapes':>12s} {'cpu/shapes':>11s} {'fingerprint':>11s}"
    )
    for m in modes:
        if m not in summary:
            print(f"{m:26s} {'failed':>9s}")
            continue
        s = summary[m]
        base = None
        if m in POLICY_MODES:
            base = summary.get("fused_none") if m != "fused_none" else None
        elif m != "none":
            base = summary.get(
                "paddle_reentrant" if "non_reentrant" not in m else "paddle_non_reentrant"
            )
        rt = f"{s['time'] / base['time']:.3f}" if base else "-"
        rp = f"{s['peak'] / base['peak']:.3f}" if base else "-"
        shapes = summary.get(m[: -len("_values")]) if m.endswith("_values") else None
        rv = f"{s['time'] / shapes['time']:.3f}" if shapes else "-"
        rc = f"{s['cpu'] / shapes['cpu']:.3f}" if shapes else "-"
        rf = f"{s['fp_share'] * 100:.1f}%" if m.endswith("_values") else "-"
        print(
            f"{m:26s} {s['time'] * 1e3:9.1f} {s['peak'] / 2**20:9.1f} {s['saved'] / 2**20:10.1f} "
            f"{rt:>12s} {rp:>12s} {rv:>12s} {rc:>11s} {rf:>11s}"
        )


if __name__ == "__main__":
    main()
