"""What a recompute policy buys: PaddleNLP's LlamaForCausalLM, step time and peak host memory
under no recompute, full recompute and each policy given, interleaved in one process.

    python benchmarks/bench_recompute_policy.py [--model small|wide] [--rounds 6] [--steps 3]
        [--policies gemm save:self_attn save:mlp budget:0.5] [--granularities full_attn core_attn]
        [--plot time-memory.png]

paddle_mgrad on (``enable(recompute=True, fused_linear=True)``), fp32 master gradients through
``MixPrecisionLayer`` kept across steps, recompute as PaddleNLP runs it (``recompute_granularity
full``, ``recompute_use_reentrant False``: Paddle's ``recompute``, ours), the policy switched by
``PADDLE_MGRAD_RECOMPUTE_POLICY`` alone (no model edits). ``nlp:<granularity>`` modes are
PaddleNLP's own ``recompute_granularity`` (``full_attn``: the attention sublayer recomputed,
``core_attn``: only the attention's core), for comparison (paddle_mgrad on, policy full). Each
round runs every mode once, in a rotating order; a mode's figure is its minimum over rounds of
the median step in the round (these machines are noisy: the minimum is the least disturbed).
Memory: the peak of Paddle's host allocator during a step above what was allocated before it
(Paddle 3.x; on 2.6 the column says n/a). Per mode also: the straight line between none and full
at the mode's peak (what trading memory for time uniformly would cost), how much less than the
line the mode pays for recompute (``(line - time) / (line - 1)``), and whether it is on the
Pareto front (no other mode both faster and lighter); ``--plot`` draws time against peak
(matplotlib). Also per mode: the spread of its round medians (max ÷ min - 1: how much the
machine moved it between rounds) and the step's process CPU time ÷ none's with the same line
drawn in CPU time (CPU time leaves out what a VM's host took from this one: at one thread it is
the work the step did). Exits 1 unless every mode's losses and gradients (every ``main_grad``,
zeroed before the mode's steps, hashed after them) are bit-identical to no recompute's. Needs
PaddleNLP (``pip install .[nlp]``). Name the CPU with every figure.

Models (4 decoder layers, seq 512): small -- hidden 256, ffn 688, 8 heads, batch 2; wide --
hidden 1024, ffn 2752, 16 heads, batch 1.
"""

import argparse
import hashlib
import os
import statistics
import sys
import time
import zlib  # noqa: F401  (before paddle on 2.6)

from machine import cpu_name  # benchmarks/machine.py

MODELS = {
    "small": dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, batch=2),
    "wide": dict(hidden_size=1024, intermediate_size=2752, num_attention_heads=16, batch=1),
}
POLICIES = ("gemm", "save:self_attn", "save:mlp", "budget:0.5")
ENV = "PADDLE_MGRAD_RECOMPUTE_POLICY"
NLP = "nlp:"  # a mode's prefix: PaddleNLP's own recompute_granularity


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        help="PADDLE_MGRAD_RECOMPUTE_POLICY values to compare with none and full",
    )
    ap.add_argument(
        "--granularities",
        nargs="*",
        default=["full_attn", "core_attn"],
        help="PaddleNLP recompute_granularity values to compare (modes nlp:<value>)",
    )
    ap.add_argument("--plot", help="a PNG of time against peak memory (needs matplotlib)")
    args = ap.parse_args()
    modes = ("none", "full", *(NLP + g for g in args.granularities), *args.policies)

    import paddle
    from paddle.base import core
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    import paddle_mgrad
    from paddle_mgrad import stats
    from paddle_mgrad._compat import HOST_MEMORY_RESET_PEAK

    paddle_mgrad.enable(recompute=True, fused_linear=True)
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(MODELS[args.model])
    batch = spec.pop("batch")
    config = LlamaConfig(
        vocab_size=2048,
        num_hidden_layers=args.layers,
        num_key_value_heads=spec["num_attention_heads"],
        max_position_embeddings=args.seq,
        seq_length=args.seq,
        use_flash_attention=False,
        use_fused_rms_norm=False,
        use_fused_rope=False,
        recompute=True,
        recompute_granularity="full",
        recompute_use_reentrant=False,
        dtype="float32",
        **spec,
    )
    paddle.seed(0)
    model = LlamaForCausalLM(config)
    MixPrecisionLayer(model, dtype="bfloat16")  # fp32 params, fp32 main_grad kept across steps
    ids = paddle.randint(0, config.vocab_size, [batch, args.seq + 1])
    inputs, labels = ids[:, :-1], ids[:, 1:]
    mem = HOST_MEMORY_RESET_PEAK is not None

    def step():
        base = core.host_memory_stat_current_value("Allocated", 0) if mem else 0
        if mem:
            HOST_MEMORY_RESET_PEAK("Allocated", 0)
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(input_ids=inputs, labels=labels, use_cache=False)
        loss = out[0] if isinstance(out, (tuple, list)) else out.loss
        loss.backward()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak = core.host_memory_stat_peak_value("Allocated", 0) - base if mem else None
        return seconds, cpu, peak, float(loss)

    def run(mode):
        granularity = mode[len(NLP) :] if mode.startswith(NLP) else "full"
        for layer in model.sublayers(include_self=True):  # (the model, its layers, attention)
            if hasattr(layer, "recompute_granularity"):
                layer.recompute_granularity = granularity
            if hasattr(layer, "enable_recompute"):
                layer.enable_recompute = mode != "none"
        if mode not in ("none", "full") and not mode.startswith(NLP):
            os.environ[ENV] = mode
        for p in params:  # (in place, outside the timed steps: the buffers stay allocated)
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.zero_()
        try:
            results = [step() for _ in range(args.steps)]
        finally:
            os.environ.pop(ENV, None)
        return results, _digest(params)

    params = [p for p in model.parameters() if not p.stop_gradient]
    for mode in modes:  # warm-up: op build, allocator
        run(mode)
    times = {m: [] for m in modes}
    cpus = {m: [] for m in modes}
    peaks = {m: [] for m in modes}
    losses = {m: None for m in modes}
    grads = {m: None for m in modes}  # a digest of every main_grad after the mode's steps
    stats.reset()
    for r in range(args.rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            results, grads[mode] = run(mode)
            times[mode].append(statistics.median(r[0] for r in results))
            cpus[mode].append(statistics.median(r[1] for r in results))
            peaks[mode].append(max(r[2] for r in results) if mem else None)
            losses[mode] = [r[3] for r in results]
    counters = stats.snapshot()["policy"]
    threads = os.environ.get("OMP_NUM_THREADS", "?")
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={threads}, Paddle "
        f"{paddle.__version__}; llama {args.model}: {args.layers} layers, hidden "
        f"{config.hidden_size}, ffn {config.intermediate_size}, {config.num_attention_heads} "
        f"heads, batch {batch}, seq {args.seq}; min over {args.rounds} rounds of the median "
        f"of {args.steps} steps"
    )
    base_p = max(peaks["none"]) if mem else None
    rel = {
        m: (min(times[m]) / min(times["none"]), max(peaks[m]) / base_p if mem else None)
        for m in modes
    }
    cpu = {m: min(cpus[m]) / min(cpus["none"]) for m in modes}
    width = max(len(m) for m in modes)
    print(
        f"{'mode':{width}s} {'step ms':>9s} {'time/none':>10s} {'peak MiB':>9s} {'peak/none':>10s}"
        f" {'line':>6s} {'below line':>10s} pareto {'spread':>7s} {'cpu/none':>9s} {'cpu below':>9s}"
    )
    for mode in modes:
        t, p = rel[mode]
        cells = f"{'n/a':>9s} {'n/a':>10s} {'':6s} {'':10s}   "
        below = cpu_below = ""
        if mem:
            cells = f"{max(peaks[mode]) / 2**20:9.1f} {p:10.3f}"
            line = _line(rel["full"], p)
            cpu_line = _line((cpu["full"], rel["full"][1]), p)
            if mode not in ("none", "full") and line > 1:
                below = f"{(line - t) / (line - 1):.0%}"
                cpu_below = f"{(cpu_line - cpu[mode]) / (cpu_line - 1):.0%}"
                cells += f" {line:6.3f} {below:>10s}"
            else:
                cells += f" {'':6s} {'':10s}"
            cells += "   *  " if _pareto(rel, mode) else "      "
        spread = max(times[mode]) / min(times[mode]) - 1
        print(
            f"{mode:{width}s} {min(times[mode]) * 1e3:9.1f} {t:10.3f} "
            + cells
            + f" {spread:7.1%} {cpu[mode]:9.3f} {cpu_below:>9s}"
        )
    if args.plot and mem:
        _plot(args.plot, rel, f"llama {args.model}, {cpu_name()}, Paddle {paddle.__version__}")
    differ = [m for m in modes if (losses[m], grads[m]) != (losses["none"], grads["none"])]
    same = not differ
    print(
        "losses and main_grad of the last round bit-identical in all modes: "
        + ("True" if same else f"False (differ from none: {', '.join(differ)})")
    )
    for name in args.policies:
        c = counters.get(name, {})
        print(
            f"  {name}: over {c.get('calls', 0)} block calls {c.get('kept_bytes', 0) / 2**20:.1f}"
            f" MiB kept; {c.get('gemms_not_recomputed', 0)} GEMMs "
            f"({c.get('gemm_flops_not_recomputed', 0) / 1e9:.2f} GFLOP) and "
            f"{c.get('sublayers_not_recomputed', 0)} sublayer calls and "
            f"{c.get('blocks_kept_whole', 0)} last blocks not recomputed"
        )
        for kind, plan in stats.snapshot()["plans"].get(name, {}).items():
            print(
                f"    plan for {kind}: keep {plan['chosen']}"
                + (
                    f" and the step's last block whole (+{plan['last_block_bytes'] / 2**20:.1f}"
                    f" MiB, its forward {plan['block_seconds'] * 1e3:.0f} ms)"
                    if plan.get("last_block")
                    else ""
                )
                + " within "
                f"{plan['budget_bytes'] / 2**20:.1f} MiB per call (activations "
                f"{plan['block_bytes'] / 2**20:.1f} MiB, inputs {plan['input_bytes'] / 2**20:.1f}"
                f" MiB, {plan['live_blocks']} blocks alive at once, outside them "
                f"{plan['outside_bytes'] / 2**20:.1f} MiB); "
                "measured ms / MiB: "
                + ", ".join(
                    f"{n} {m['seconds'] * 1e3:.2f} / {m['bytes'] / 2**20:.2f}"
                    for n, m in plan["measured"].items()
                )
            )
    return 0 if same else 1


def _digest(params):
    """One hash of every parameter's ``main_grad`` (bits, in the parameters' order): the
    gradients of a mode's steps, to compare across modes (a forward's loss alone would not see
    a wrong gradient: no optimizer step runs)."""
    h = hashlib.sha256()
    for p in params:
        g = getattr(p, "main_grad", None)
        h.update(b"none" if g is None else g.numpy().tobytes())
    return h.hexdigest()


def _line(full, peak):
    """The time on the straight line from none (1, 1) to full at ``peak`` (both ÷ none)."""
    full_t, full_p = full
    return 1 + (full_t - 1) * (1 - peak) / (1 - full_p)


def _pareto(rel, mode):
    """Whether no other mode is at least as fast and as light, and better in one."""
    t, p = rel[mode]
    return not any(
        (ot <= t and op <= p) and (ot < t or op < p) for m, (ot, op) in rel.items() if m != mode
    )


def _plot(path, rel, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    full_t, full_p = rel["full"]
    ax.plot([full_p, 1], [full_t, 1], "--", color="grey", label="none–full line")
    for mode, (t, p) in rel.items():
        ax.plot(p, t, "o" if _pareto(rel, mode) else "x", color="black")
        ax.annotate(mode, (p, t), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("peak host memory of a step ÷ no recompute")
    ax.set_ylabel("step time ÷ no recompute")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path} (o: on the Pareto front)")


if __name__ == "__main__":
    sys.exit(main())
