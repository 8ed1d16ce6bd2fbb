"""Llama pretraining with PaddleNLP's Trainer, fp32 master gradients, full recompute and the
fused weight-gradient linear -- the combination users reported broken -- fixed by paddle_mgrad.

    python examples/llama/run_pretrain.py examples/llama/pretrain_cpu.json [--flag value ...]
    python examples/llama/run_pretrain.py --model_config examples/llama/tiny_llama.json \\
        --output_dir output/llama --amp_master_grad --bf16 --fp16_opt_level O2 --recompute \\
        --recompute_granularity full --recompute_use_reentrant false \\
        --enable_linear_fused_grad_add --max_steps 20 --per_device_train_batch_size 4 \\
        --gradient_accumulation_steps 2 --learning_rate 3e-3

A JSON file given first supplies defaults; flags after it override them.  Data
parallel: ``python -m paddle.distributed.launch --nproc_per_node 2
examples/llama/run_pretrain.py ...``.  Resume: ``--resume_from_checkpoint
output/llama_cpu/checkpoint-20``.  On CPU, AMP is a no-op (Paddle has no CPU
bf16 matmul) but the main_grad path is active; on a GPU it trains in bf16.
"""

import json
import os
import sys
import zlib  # noqa: F401  (before paddle: Paddle 2.6 clashes with zlib)
from dataclasses import dataclass, field

import paddle

import paddle_mgrad
from paddle_mgrad import stats
from paddle_mgrad.diagnostics.audit import MainGradAudit
from paddle_mgrad.errors import FlagError
from paddle_mgrad.trainer import MgradArguments, apply

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from data import BlockDataset, ByteTokenizer  # noqa: E402
from tokens_per_second import tokens_per_second_callback  # noqa: E402


@dataclass
class ModelArguments:
    model_config: str = field(
        default=os.path.join(HERE, "tiny_llama.json"), metadata={"help": "LlamaConfig JSON file"}
    )
    recompute_granularity: str = field(
        default="full", metadata={"help": "full | full_attn | core_attn"}
    )
    recompute_use_reentrant: bool = field(default=False, metadata={"help": "reentrant recompute"})


@dataclass
class DataArguments:
    data_file: str = field(default=os.path.join(HERE, "data", "corpus.txt"))
    seq_length: int = field(default=128)


def _json_to_argv(path):
    with open(path) as f:
        cfg = json.load(f)
    argv = []
    for k, v in cfg.items():
        argv += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return argv


def parse(argv):
    from paddlenlp.trainer import PdArgumentParser, TrainingArguments

    if argv and argv[0].endswith(".json"):
        argv = _json_to_argv(argv[0]) + argv[1:]
    if not any(a == "--report_to" or a.startswith("--report_to=") for a in argv):
        # PaddleNLP's default (visualdl) crashes on Paddle 3.3.1 when it logs our bool flags
        # as hparams ("HparamInfo.int_value: Expected an int, got a boolean").
        argv = ["--report_to", "none"] + list(argv)
    parser = PdArgumentParser((ModelArguments, DataArguments, TrainingArguments, MgradArguments))
    return parser.parse_args_into_dataclasses(args=argv) + (argv,)


def make_trainer_class():
    from paddle.io import DistributedBatchSampler
    from paddlenlp.trainer import Trainer

    class PretrainTrainer(Trainer):
        """Reads blocks in order, as pretraining does: rank r of n takes the r-th slice of
        each global batch, so n processes see exactly the batches one process would."""

        def _get_train_sampler(self):
            return DistributedBatchSampler(
                self.train_dataset,
                batch_size=self.args.per_device_train_batch_size,
                shuffle=False,
                num_replicas=max(1, self.args.dataset_world_size),
                rank=max(0, self.args.dataset_rank),
                drop_last=self.args.dataloader_drop_last,
            )

    return PretrainTrainer


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    model_args, data_args, training_args, mgrad_args, argv = parse(argv)
    try:
        enabled = apply(training_args, mgrad_args, argv=argv)  # before the model is built
    except FlagError as e:
        print(f"run_pretrain.py: error: {e}", file=sys.stderr)
        return 2

    from paddlenlp.trainer import set_seed
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    set_seed(training_args.seed)
    with open(model_args.model_config) as f:
        config = LlamaConfig(**json.load(f))
    tokenizer = ByteTokenizer()
    config.vocab_size = tokenizer.vocab_size
    config.recompute_granularity = model_args.recompute_granularity
    config.recompute_use_reentrant = model_args.recompute_use_reentrant
    config.use_recompute = training_args.recompute
    model = LlamaForCausalLM(config)

    dataset = BlockDataset(data_args.data_file, data_args.seq_length, tokenizer)
    tokens_per_step = (
        data_args.seq_length
        * training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * max(1, training_args.world_size)
    )
    speed = tokens_per_second_callback(tokens_per_step)
    trainer = make_trainer_class()(
        model=model, args=training_args, train_dataset=dataset, callbacks=[speed]
    )
    audit = MainGradAudit(model) if mgrad_args.mgrad_audit else None

    before = dict(stats.recompute)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tps = speed.history[1:] or speed.history
    summary = {
        "paddle": paddle.__version__,
        "paddle_mgrad": paddle_mgrad.__version__,
        "enabled": enabled,
        "world_size": training_args.world_size,
        "global_step": trainer.state.global_step,
        "train_loss": result.training_loss,
        "logged_losses": losses,
        "tokens_per_second": round(sum(tps) / max(len(tps), 1), 1),
        "recompute_calls": {k: stats.recompute[k] - before[k] for k in before},
        "amp_master_grad": training_args.amp_master_grad,
    }
    if audit is not None:
        summary["audit"] = audit.summary()
        if training_args.process_index == 0:
            print(audit.report())
    if training_args.process_index == 0:
        print(
            f"tokens/s: {summary['tokens_per_second']} "
            f"(seq {data_args.seq_length} x batch {training_args.per_device_train_batch_size} x "
            f"accum {training_args.gradient_accumulation_steps} x world {training_args.world_size})"
        )
        with open(os.path.join(training_args.output_dir, "mgrad_summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
        print(
            "summary:", json.dumps({k: v for k, v in summary.items() if k != "audit"}, default=str)
        )
    if training_args.world_size > 1:
        # Everything is saved and printed.  Leave together and skip interpreter teardown:
        # Paddle's CPU (gloo) process group intermittently aborts while being destroyed
        # after a successful run (seen in CI as exit code 250 = SIGABRT).
        paddle.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
