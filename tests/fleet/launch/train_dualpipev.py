"""A small driver for the 2-rank zero-bubble pipeline test (tests/fleet/launch/test_zero_bubble_pipeline.py).

    python tests/fleet/launch/train_dualpipev.py --config ref --out DIR             # 1 process, plain Paddle
    python -m paddle.distributed.launch --nproc_per_node 2 tests/fleet/launch/train_dualpipev.py \\
        --config dualpipev --out DIR --ref DIR

Paddle 3.x's DualPipeV schedule (``hybrid_configs["pp_configs"].use_dualpipev``,
``PipelineLayer(use_dualpipev=True)``: two model chunks per rank in a V, 4 blocks on 2 ranks)
over blocks of ``zero_bubble_utils.SplitBWLinear`` -- whose weight gradients the schedule
defers to ``WeightGradStore.pop()`` in its zero-bubble phases --, ``MixPrecisionLayer`` +
``MixPrecisionOptimizer`` (fp32 main_grad), ``paddle_mgrad.enable(recompute=True,
fused_linear=True)`` (``dualpipev_paddle``: off, the control), optionally each block under
recompute.  GPU-only pieces of the schedule
are stood in for by ``cpu_dualpipev_standins.py`` (test-only).

``ref`` runs plain Paddle (no paddle_mgrad, no recompute, no pipeline) in one process on the
same global batch and saves its losses and the gradients of step 0.  A distributed run writes
``rank<N>.json``: its losses, the largest difference between its fp32 ``main_grad`` after step
0 and the reference gradient, parameters whose gradient was not in main_grad or leaked into
``.grad``, how many weight gradients the schedule deferred (``WeightGradStore.put``) and
paddle_mgrad's counters.
"""

import argparse
import json
import os
import sys
import zlib  # noqa: F401  (before paddle on 2.6)

import numpy as np
import paddle
import paddle.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))

STEPS, ACC, MB, WIDTH, N_BLOCKS = 2, 4, 2, 8, 4  # DualPipeV needs ACC >= 2 * ranks
LR = 0.5
# name -> (paddle_mgrad on, recompute's use_reentrant: None = no recompute)
CONFIGS = {
    "ref": (False, None),
    "dualpipev": (True, None),
    "dualpipev_recompute": (True, False),
    "dualpipev_recompute_reentrant": (True, True),
    "dualpipev_paddle": (False, None),
}  # control: Paddle's own grad_weight_fn


class Block(paddle.nn.Layer):
    """x + fc2(tanh(fc1(x))) with two SplitBWLinear; weights depend only on ``index``."""

    def __init__(self, index, use_reentrant=None):
        super().__init__()
        from paddle.distributed.fleet.meta_parallel.zero_bubble_utils import SplitBWLinear

        rs = np.random.RandomState(100 + index)
        self.index = index
        self.use_reentrant = use_reentrant
        self.fc1 = SplitBWLinear(WIDTH, 2 * WIDTH)
        self.fc2 = SplitBWLinear(2 * WIDTH, WIDTH)
        for lin in (self.fc1, self.fc2):
            lin.weight.set_value(rs.normal(0, 0.4, lin.weight.shape).astype("float32"))
            lin.bias.set_value(rs.normal(0, 0.1, lin.bias.shape).astype("float32"))

    def inner(self, x):
        return x + self.fc2(paddle.tanh(self.fc1(x)))

    def forward(self, x):
        if isinstance(x, (list, tuple)):  # DualPipeV hands received activations as a list
            (x,) = x
        if self.use_reentrant is None or x.stop_gradient:
            # as fleet's PipelineLayer: recompute a block whose input needs a gradient (the
            # first block reads the data; reentrant recompute would cut its parameters off)
            return self.inner(x)
        from paddle.distributed.fleet.utils import recompute

        return recompute(self.inner, x, use_reentrant=self.use_reentrant)


def loss_fn(out, label):
    if isinstance(out, (list, tuple)):
        (out,) = out
    return ((out - label) ** 2).mean()


def data():
    rs = np.random.RandomState(0)
    x = rs.standard_normal((STEPS, ACC * MB, WIDTH)).astype("float32")
    y = rs.standard_normal((STEPS, ACC * MB, WIDTH)).astype("float32")
    return x, y


def names(model):
    """Stable names '<block index>.<param path>' whatever the container."""
    return {
        p.name: f"{layer.index}.{n}"
        for layer in model.sublayers()
        if isinstance(layer, Block)
        for n, p in layer.named_parameters()
    }


def write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def run_reference(out):
    """One process, plain Paddle: the blocks in order, ACC micro-batches, SGD by hand."""
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    model = paddle.nn.Sequential(*[Block(i) for i in range(N_BLOCKS)])
    key = names(model)
    MixPrecisionLayer(model, dtype="bfloat16")
    xs, ys = data()
    losses, grads = [], {}
    for s in range(STEPS):
        total = 0.0
        for m in range(ACC):
            rows = slice(m * MB, (m + 1) * MB)
            loss = loss_fn(model(paddle.to_tensor(xs[s, rows])), paddle.to_tensor(ys[s, rows]))
            (loss / ACC).backward()
            total += float(loss) / ACC
        losses.append(total)
        if s == 0:
            grads = {key[p.name]: p.main_grad.numpy() for p in model.parameters()}
        for p in model.parameters():
            p.set_value(p - LR * p.main_grad)
            p.main_grad = None
    np.savez(os.path.join(out, "grads.npz"), **grads)
    write(os.path.join(out, "reference.json"), {"losses": losses})


def run_distributed(name, out, ref_dir):
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel import (
        LayerDesc,
        PipelineLayer,
        zero_bubble_utils as zb,
    )
    from paddle.distributed.fleet.utils.mix_precision_utils import (
        MixPrecisionLayer,
        MixPrecisionOptimizer,
    )

    import paddle_mgrad
    from paddle_mgrad import stats

    paddle.set_device("cpu")
    on, use_reentrant = CONFIGS[name]
    if on:
        paddle_mgrad.enable(recompute=True, fused_linear=True)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": 1,
        "mp_degree": 1,
        "pp_degree": 2,
        "sharding_degree": 1,
        "pp_configs": {"use_dualpipev": True},
    }
    strategy.pipeline_configs = {"accumulate_steps": ACC, "micro_batch_size": MB}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()

    import cpu_dualpipev_standins

    cpu_dualpipev_standins.install()
    rank = dist.get_rank()
    ref = json.load(open(os.path.join(ref_dir, "reference.json")))
    ref_grads = dict(np.load(os.path.join(ref_dir, "grads.npz")))

    deferred = []  # weight gradients the schedule put on the store (computed later, at pop)
    paddle_put = zb.WeightGradStore.put.__func__

    def put(cls, func):
        deferred.append(func.args[1].name)
        paddle_put(cls, func)

    zb.WeightGradStore.put = classmethod(put)

    model = PipelineLayer(
        layers=[LayerDesc(Block, i, use_reentrant) for i in range(N_BLOCKS)],
        loss_fn=loss_fn,
        topology=hcg.topology(),
        use_dualpipev=True,
    )
    key = names(model)
    MixPrecisionLayer(model, dtype="bfloat16")  # --amp_master_grad (PP keeps the PipelineLayer)
    opt = MixPrecisionOptimizer(
        paddle.optimizer.SGD(learning_rate=LR, parameters=model.parameters())
    )
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    stats.reset()

    xs, ys = data()
    losses, grad_diff, not_in_main_grad, grad_leaks = [], {}, [], []
    for s in range(STEPS):
        # what DualPipeVParallel.train_batch does, with a look at main_grad before the step
        batch = model._prepare_training(
            [paddle.to_tensor(xs[s]), paddle.to_tensor(ys[s])], opt, None
        )
        loss = model.forward_backward_pipeline(batch, None)
        losses.append(float(loss.numpy().reshape([-1])[0]))
        if s == 0:
            for p in model.parameters():
                mg = getattr(p, "main_grad", None)
                if p.grad is not None:
                    grad_leaks.append(key[p.name])
                if mg is None or mg.dtype != paddle.float32:
                    not_in_main_grad.append(key[p.name])
                    continue
                want = ref_grads[key[p.name]]
                grad_diff[key[p.name]] = float(np.abs(mg.numpy() - want).max())
        model._optimizer_step()
    snap = stats.snapshot()
    weights = sorted(key[p.name] for p in model.parameters() if len(p.shape) == 2)
    result = {
        "config": name,
        "rank": rank,
        "paddle": paddle.__version__,
        "model": type(model).__name__,
        "losses": losses,
        "ref_losses": ref["losses"],
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
        "grad_diff": max(grad_diff.values()) if grad_diff else None,
        "n_params": len(grad_diff) + len(not_in_main_grad),
        "blocks": sorted({k.split(".")[0] for k in grad_diff}),
        "not_in_main_grad": not_in_main_grad,
        "grad_leaks": grad_leaks,
        "weights": weights,
        "fused_params": sorted(key[n] for n in snap["fused_params"] if n in key),
        "deferred": len(deferred),
        "recompute": snap["recompute"],
        "linear": snap["linear"],
    }
    write(os.path.join(out, f"rank{rank}.json"), result)
    print(
        "RESULT", json.dumps({k: result[k] for k in ("config", "rank", "loss_diff", "grad_diff")})
    )
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref", help="directory of the reference run")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.config == "ref":
        run_reference(a.out)
    else:
        run_distributed(a.config, a.out, a.ref)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo can abort at exit after a good run)


if __name__ == "__main__":
    main()
