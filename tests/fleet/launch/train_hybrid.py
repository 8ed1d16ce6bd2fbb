"""A small fleet training driver for the 2-rank hybrid-parallel tests (tests/fleet/launch/test_hybrid_parallel.py).

    python tests/fleet/launch/train_hybrid.py --config ref_llama --out DIR        # 1 process, plain Paddle
    python -m paddle.distributed.launch --nproc_per_node 2 tests/fleet/launch/train_hybrid.py --config tp2 --out DIR
    ... --config tp2 --out DIR --recompute_use_reentrant true   # the reentrant recompute instead

It does in code what PaddleNLP's Trainer does with ``--amp_master_grad --bf16
--fp16_opt_level O2 --recompute --recompute_granularity full --recompute_use_reentrant false
--enable_linear_fused_grad_add`` (fleet hybrid strategy, ``MixPrecisionLayer`` +
``MixPrecisionOptimizer``, ``auto_cast`` O2 bf16 -- a no-op on CPU, the model stays fp32 --,
``config.recompute`` full non-reentrant (``--recompute_use_reentrant true``: reentrant),
``paddle_mgrad.enable(recompute=True, fused_linear=True)``)
on a tiny PaddleNLP 2.8.1 llama (``LlamaForCausalLM`` / ``LlamaForCausalLMPipe``) or a tiny
``PipelineLayer`` with ``recompute_interval=1``.

The reference configurations (``ref_llama``, ``ref_toy``) run plain Paddle (no paddle_mgrad,
no recompute) in one process on the same global batch and save initial weights, losses and
the gradients of step 0.  A distributed run loads the initial weights (TP: split with
PaddleNLP's own tensor-parallel mappings), trains, and writes ``rank<N>.json`` with its
losses, the largest difference between its fp32 ``main_grad`` after step 0 and the
reference gradient (its shard; sharding: averaged over ranks), the parameters whose
gradient was not in ``main_grad``, and paddle_mgrad's counters.
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

STEPS, ACC, GB, SEQ, VOCAB = 3, 2, 4, 16, 64
SEED = 2024
LR = {"llama": 2.0, "toy": 0.02}  # SGD: large enough that a wrong gradient moves the losses

CONFIGS = {
    # name: (model, hybrid degrees, mp_configs, sequence_parallel)
    "ref_llama": ("llama", {}, {}, False),
    "ref_toy": ("toy", {}, {}, False),
    "tp2": ("llama", {"mp_degree": 2}, {}, False),
    "tp2_sp": ("llama", {"mp_degree": 2}, {}, True),
    "tp2_async": ("llama", {"mp_degree": 2}, {"mp_async_allreduce": True}, False),
    "tp2_fused_gradadd": (
        "llama",
        {"mp_degree": 2},
        {"mp_async_allreduce": True, "mp_fused_linear_param_grad_add": True},
        False,
    ),
    # Paddle 3.x: ColumnSequenceParallelLinear runs SPInnerOverlapLinear (dx reduce-scatter
    # overlapped with dW); its fused-grad-add path needs mp_async_allreduce as well; the
    # second config also re-gathers the input in backward (recompute_allgather)
    "tp2_sp_overlap": ("llama", {"mp_degree": 2}, {"sp_async_reduce_scatter": True}, True),
    "tp2_sp_overlap_fused": (
        "llama",
        {"mp_degree": 2},
        {
            "sp_async_reduce_scatter": True,
            "mp_async_allreduce": True,
            "mp_fused_linear_param_grad_add": True,
            "recompute_allgather": True,
        },
        True,
    ),
    "sharding1": ("llama", {"sharding_degree": 2}, {}, False),
    "pp2": ("llama_pipe", {"pp_degree": 2}, {}, False),
    "pp2_interval": ("toy_pipe", {"pp_degree": 2}, {}, False),
}


def data():
    rs = np.random.RandomState(0)
    return rs.randint(0, VOCAB, size=(STEPS, ACC, GB, SEQ + 1)).astype("int64")


def llama_config(mp=1, rank=0, sp=False, recompute=True, reentrant=False):
    from paddlenlp.transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tensor_parallel_degree=mp,
        tensor_parallel_rank=rank,
        tensor_parallel_output=False,
        sequence_parallel=sp,
        use_flash_attention=False,
        use_fused_rms_norm=False,
        use_fused_rope=False,
        fuse_attention_qkv=False,
        fuse_attention_ffn=False,
        recompute=recompute,
        use_recompute=recompute,
        recompute_granularity="full",
        recompute_use_reentrant=reentrant,
        dtype="float32",
        seq_length=SEQ,
    )


# ---------------------------------------------------------------- toy pipeline model
class ToyBlock(paddle.nn.Layer):
    """Linear -> gelu -> Linear with a residual; weights depend only on ``index``."""

    def __init__(self, index, width=16):
        super().__init__()
        rs = np.random.RandomState(100 + index)
        self.index = index
        self.fc1 = paddle.nn.Linear(width, 2 * width)
        self.fc2 = paddle.nn.Linear(2 * width, width)
        for lin in (self.fc1, self.fc2):
            lin.weight.set_value(rs.normal(0, 0.3, lin.weight.shape).astype("float32"))
            lin.bias.set_value(rs.normal(0, 0.1, lin.bias.shape).astype("float32"))

    def forward(self, x):
        return x + self.fc2(paddle.nn.functional.gelu(self.fc1(x)))


class ToyEmbed(paddle.nn.Layer):
    def __init__(self, width=16):
        super().__init__()
        rs = np.random.RandomState(99)
        self.emb = paddle.nn.Embedding(VOCAB, width)
        self.emb.weight.set_value(rs.normal(0, 1, self.emb.weight.shape).astype("float32"))
        self.index = -1

    def forward(self, ids):
        return self.emb(ids)


class ToyHead(paddle.nn.Layer):
    def __init__(self, width=16):
        super().__init__()
        rs = np.random.RandomState(98)
        self.out = paddle.nn.Linear(width, VOCAB)
        self.out.weight.set_value(rs.normal(0, 0.3, self.out.weight.shape).astype("float32"))
        self.out.bias.set_value(np.zeros(VOCAB, "float32"))
        self.index = 99

    def forward(self, x):
        return self.out(x)


def toy_loss(logits, labels):
    return paddle.nn.functional.cross_entropy(
        logits.reshape([-1, VOCAB]), labels.reshape([-1, 1])
    ).mean()


N_TOY_BLOCKS = 4


def toy_layers():
    return [ToyEmbed()] + [ToyBlock(i) for i in range(N_TOY_BLOCKS)] + [ToyHead()]


def toy_names(model):
    """Stable names: '<layer index>.<param path>' whatever the container."""
    out = {}
    for layer in model.sublayers():
        if isinstance(layer, (ToyBlock, ToyEmbed, ToyHead)):
            for n, p in layer.named_parameters():
                out[p.name] = f"{layer.index}.{n}"
    return out


# ---------------------------------------------------------------- helpers
def main_grads(model, names):
    out = {}
    for p in model.parameters():
        if p.stop_gradient:
            continue
        mg = getattr(p, "main_grad", None)
        out[names[p.name]] = (
            None if mg is None else mg.numpy().copy(),
            str(mg.dtype) if mg is not None else None,
            p.grad is not None,
        )
    return out


def sp_overlap_class():
    """What ColumnSequenceParallelLinear runs with sp_async_reduce_scatter (None: Paddle 2.6)."""
    from paddle.distributed.fleet.utils import sequence_parallel_utils

    cls = getattr(sequence_parallel_utils, "SPInnerOverlapLinear", None)
    return None if cls is None else cls.__name__


def write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)


def run_reference(name, out):
    """One process, plain Paddle, no recompute, no paddle_mgrad: the ground truth."""
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    kind = CONFIGS[name][0]
    paddle.seed(SEED)
    if kind == "llama":
        from paddlenlp.transformers import LlamaForCausalLM

        model = LlamaForCausalLM(llama_config(recompute=False))
        names = {p.name: n for n, p in model.named_parameters()}
        init = {n: p.numpy() for n, p in model.named_parameters()}
        np.savez(os.path.join(out, "init.npz"), **init)
    else:
        model = paddle.nn.Sequential(*toy_layers())
        names = toy_names(model)
    MixPrecisionLayer(model, dtype="bfloat16")
    lr = LR["llama" if kind == "llama" else "toy"]
    batches = data()
    losses, grads = [], {}
    for s in range(STEPS):
        total = 0.0
        for m in range(ACC):
            ids = paddle.to_tensor(batches[s, m, :, :-1])
            labels = paddle.to_tensor(batches[s, m, :, 1:])
            if kind == "llama":
                loss = model(input_ids=ids, labels=labels)[0]
            else:
                loss = toy_loss(model(ids), labels)
            (loss / ACC).backward()
            total += float(loss) / ACC
        losses.append(total)
        if s == 0:
            grads = {k: v[0] for k, v in main_grads(model, names).items()}
        for p in model.parameters():  # the step MixPrecisionOptimizer does, by hand
            p.set_value(p - lr * p.main_grad)
            p.main_grad = None
    np.savez(os.path.join(out, "grads.npz"), **grads)
    write(os.path.join(out, "reference.json"), {"losses": losses, "params": sorted(grads)})


# ---------------------------------------------------------------- distributed run
def slow_down(model, rank, slow):
    """``slow``: ``RANK:SUBLAYER,...`` -- on this rank, every decoder layer's ``SUBLAYER``
    (``mlp``, ``input_layernorm``, ...) sleeps 20 ms in its forward: ranks then measure
    different times (a ``budget:`` plan made on each rank alone would differ)."""
    import time

    for item in filter(None, (slow or "").split(",")):
        r, sublayer = item.split(":")
        if int(r) != rank:
            continue
        for layer in model.sublayers():
            if type(layer).__name__.endswith("DecoderLayer"):
                target = getattr(layer, sublayer)
                forward = target.forward

                def slowed(*args, _forward=forward, **kwargs):
                    time.sleep(0.02)
                    return _forward(*args, **kwargs)

                target.forward = slowed


def run_distributed(name, out, ref_dir, reentrant=False, slow=None):
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils.mix_precision_utils import (
        MixPrecisionLayer,
        MixPrecisionOptimizer,
    )

    import paddle_mgrad
    from paddle_mgrad import stats
    from paddle_mgrad.diagnostics.audit import MainGradAudit

    kind, degrees, mp_configs, sp = CONFIGS[name]
    paddle.set_device("cpu")
    # --recompute_use_reentrant false --enable_linear_fused_grad_add (+ our recompute fix)
    paddle_mgrad.enable(recompute=True, fused_linear=True)

    strategy = fleet.DistributedStrategy()
    hybrid = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
    hybrid.update(degrees)
    strategy.hybrid_configs = hybrid
    for k, v in mp_configs.items():
        setattr(strategy.hybrid_configs["mp_configs"], k, v)
    if hybrid["pp_degree"] > 1:
        strategy.pipeline_configs = {"accumulate_steps": ACC, "micro_batch_size": GB}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()

    import cpu_fleet_standins

    rank = dist.get_rank()
    paddle.seed(SEED)
    ref = json.load(open(os.path.join(ref_dir, "reference.json")))
    ref_grads = dict(np.load(os.path.join(ref_dir, "grads.npz")))
    split = {}
    if kind in ("llama", "llama_pipe"):
        from paddlenlp.transformers import LlamaForCausalLM, LlamaForCausalLMPipe

        cfg = llama_config(mp, mp_rank, sp, reentrant=reentrant)
        cpu_fleet_standins.install(pipeline=kind == "llama_pipe")
        init = dict(np.load(os.path.join(ref_dir, "init.npz")))
        if kind == "llama":
            model = LlamaForCausalLM(cfg)
            if mp > 1:
                # PaddleNLP's own tensor-parallel split actions (keys without the "llama." prefix)
                actions = LlamaForCausalLM._get_tensor_parallel_mappings(cfg, is_split=True)
                for k in init:
                    short = k[len("llama.") :] if k.startswith("llama.") else k
                    if short in actions:
                        split[k] = actions[short]
            model.set_state_dict({k: (split[k](v) if k in split else v) for k, v in init.items()})
            names = {p.name: n for n, p in model.named_parameters()}
        else:
            model = LlamaForCausalLMPipe(cfg)
            model.set_state_dict(dict(init))
            pp_to_single = model._pp_to_single_mapping
            names = {p.name: pp_to_single[n] for n, p in model.named_parameters()}
    else:  # toy pipeline with recompute_interval
        from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

        cpu_fleet_standins.install(pipeline=True)
        descs = (
            [LayerDesc(ToyEmbed)]
            + [LayerDesc(ToyBlock, i) for i in range(N_TOY_BLOCKS)]
            + [LayerDesc(ToyHead)]
        )
        model = PipelineLayer(
            layers=descs,
            loss_fn=toy_loss,
            topology=hcg.topology(),
            seg_method="uniform",
            recompute_interval=1,
            recompute_ctx={
                "mp_group": hcg.get_model_parallel_group(),
                "offload": True,
                "partition": False,
            },
        )
        names = toy_names(model)

    slow_down(model, rank, slow)
    for layer in model.sublayers(include_self=True):  # what Trainer does for --recompute
        if hasattr(layer, "enable_recompute"):
            layer.enable_recompute = True
    if sp:
        from paddle.distributed.fleet.utils.sequence_parallel_utils import (
            register_sequence_parallel_allreduce_hooks,
        )

        register_sequence_parallel_allreduce_hooks(model, ACC, False)
    audit = MainGradAudit(model)
    wrapped = MixPrecisionLayer(model, dtype="bfloat16")  # --amp_master_grad
    if hybrid["pp_degree"] == 1:  # as PaddleNLP's Trainer: PP keeps the PipelineLayer itself
        model = wrapped
    lr = LR["toy" if kind == "toy_pipe" else "llama"]
    opt = MixPrecisionOptimizer(
        paddle.optimizer.SGD(learning_rate=lr, parameters=model.parameters())
    )
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    stats.reset()

    batches = data()
    sharding = hybrid["sharding_degree"] > 1
    losses, grad_diff, not_in_main_grad, grad_leaks = [], {}, [], []
    for s in range(STEPS):
        with paddle.amp.auto_cast(True, level="O2", dtype="bfloat16"):  # --bf16 O2 (no-op on CPU)
            if hybrid["pp_degree"] > 1:
                step = batches[s].reshape([ACC * GB, SEQ + 1])
                ids, labels = paddle.to_tensor(step[:, :-1]), paddle.to_tensor(step[:, 1:])
                loss = model.forward_backward_pipeline([ids, labels])
                total = float(loss.numpy().reshape([-1])[0])
            else:
                total = 0.0
                for m in range(ACC):
                    rows = batches[s, m]
                    if sharding:
                        half = GB // 2
                        rows = rows[hcg.get_sharding_parallel_rank() * half :][:half]
                    ids, labels = paddle.to_tensor(rows[:, :-1]), paddle.to_tensor(rows[:, 1:])
                    loss = model(input_ids=ids, labels=labels)[0]
                    (loss / ACC).backward()
                    total += float(loss) / ACC
                if sharding:
                    t = paddle.to_tensor([total], dtype="float64")
                    dist.all_reduce(t)
                    total = float(t.numpy()[0]) / 2
        losses.append(total)
        if s == 0:
            for p in model.parameters():
                if p.stop_gradient:
                    continue
                key = names[p.name]
                mg = getattr(p, "main_grad", None)
                if p.grad is not None:
                    grad_leaks.append(key)
                if mg is None or mg.dtype != paddle.float32:
                    not_in_main_grad.append(key)
                    continue
                g = mg.clone()
                if sharding:
                    dist.all_reduce(g)
                    g = g / 2
                want = ref_grads[key]
                if key in split:
                    want = split[key](want)
                scale = float(np.abs(want).max()) + 1e-12
                grad_diff[key] = float(np.abs(g.numpy() - want).max()) / max(scale, 1.0)
        opt.step()
        opt.clear_grad()
    snap = stats.snapshot()
    linear_layers = []
    for layer in model.sublayers():
        w = getattr(layer, "weight", None)
        if (
            w is not None
            and len(w.shape) == 2
            and type(layer).__name__
            in (
                "Linear",
                "ColumnParallelLinear",
                "RowParallelLinear",
                "ColumnSequenceParallelLinear",
                "RowSequenceParallelLinear",
            )
        ):
            linear_layers.append(names[w.name])
    fused = sorted(names[n] for n in snap["fused_params"] if n in names)
    result = {
        "config": name,
        "rank": rank,
        "paddle": paddle.__version__,
        "reentrant": reentrant,
        "losses": losses,
        "ref_losses": ref["losses"],
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
        "grad_diff": max(grad_diff.values()) if grad_diff else None,
        "n_params": len(grad_diff) + len(not_in_main_grad),
        "not_in_main_grad": not_in_main_grad,
        "grad_leaks": grad_leaks,
        "linear_weights": sorted(linear_layers),
        "fused_params": fused,
        "layer_types": sorted({type(layer).__name__ for layer in model.sublayers()}),
        "recompute": snap["recompute"],
        "linear": snap["linear"],
        "paddle_c_ops": snap["paddle_c_ops"],
        "sp_overlap_class": sp_overlap_class(),
        "policy": snap["policy"],
        "plans": snap["plans"],
        "audit": audit.summary(),
    }
    result["audit"].pop("fused_names", None)
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
    ap.add_argument(
        "--recompute_use_reentrant",
        default="false",
        choices=["true", "false"],
        help="the llama decoder layers' recompute mode (PaddleNLP's flag)",
    )
    ap.add_argument(
        "--slow",
        help="RANK:SUBLAYER,... -- slow the decoder layers' SUBLAYER down on RANK (slow_down)",
    )
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.config.startswith("ref_"):
        run_reference(a.config, a.out)
    else:
        run_distributed(
            a.config, a.out, a.ref, reentrant=a.recompute_use_reentrant == "true", slow=a.slow
        )
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo can abort at exit after a good run)


if __name__ == "__main__":
    main()
