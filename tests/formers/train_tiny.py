"""The smallest realistic PaddleFormers 1.2.0 training script (what a user runs): a tiny
LlamaForCausalLM built from its config, PaddleFormers' own Trainer and TrainingArguments,
synthetic token data, offline.  Flags go through PaddleFormers' own argument parser, e.g.

    python train_tiny.py --output_dir out --bf16 --fp16_opt_level O2 --amp_master_grad true \
        --recompute_granularity full --recompute_method uniform --recompute_num_layers 1

``--recompute_*`` land on the model config the way PaddleFormers' CLI workflows do it
(``LlmMetaConfig.set_llm_config(config, training_args)``); ``--recompute_use_reentrant`` is a
model-config field (PaddleFormers' TrainingArguments has none): ``--use_reentrant false`` here.
Nothing in it mentions paddle_mgrad: switch that on with ``PADDLE_MGRAD=all``.
"""

import dataclasses
import json
import sys
import zlib  # noqa: F401  (harmless on 3.x; Paddle 2.6 needs it before paddle)

import numpy as np
import paddle
from paddleformers.trainer import PdArgumentParser, Trainer, TrainerCallback, TrainingArguments
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
from paddleformers.transformers.configuration_utils import LlmMetaConfig

VOCAB, SEQ = 256, 32


@dataclasses.dataclass
class TinyArguments:
    layers: int = dataclasses.field(default=2)
    use_reentrant: str = dataclasses.field(
        default="true", metadata={"help": "recompute_use_reentrant"}
    )
    samples: int = dataclasses.field(default=64)
    cpu_sync_standin: str = dataclasses.field(
        default="true", metadata={"help": "see cpu_formers_standins.py"}
    )


class Tokens(paddle.io.Dataset):
    """Synthetic next-token data: a few repeating patterns, fixed by a seed."""

    def __init__(self, n):
        rng = np.random.default_rng(1234)
        base = rng.integers(0, VOCAB, size=(8, SEQ + 1))
        self.rows = [
            base[i % 8] if i % 3 else rng.integers(0, VOCAB, size=SEQ + 1) for i in range(n)
        ]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return {"input_ids": row[:-1].astype("int64"), "labels": row[1:].astype("int64")}


class LossLog(TrainerCallback):
    """Writes the logged training losses to ``<output_dir>/losses.json`` (PaddleFormers 1.2.0
    leaves ``trainer_state.json``'s log_history empty)."""

    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        with open(f"{args.output_dir}/losses.json", "w") as f:
            json.dump(self.losses, f)


def main(argv=None):
    parser = PdArgumentParser((TrainingArguments, TinyArguments))
    args, tiny = parser.parse_args_into_dataclasses(args=argv)
    paddle.seed(args.seed)
    if tiny.cpu_sync_standin.lower() in ("1", "true", "yes"):
        from cpu_formers_standins import cpu_synchronize_standin  # tests only, next to this file

        cpu_synchronize_standin()
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=tiny.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        fuse_rms_norm=False,
    )  # no CPU kernel
    LlmMetaConfig.set_llm_config(config, args)  # recompute_* from the training arguments
    config.recompute_use_reentrant = tiny.use_reentrant.lower() in ("1", "true", "yes")
    model = LlamaForCausalLM(config)
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(tiny.samples), callbacks=[LossLog()]
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    if not trainer.is_world_process_zero():  # data parallel: rank 0 writes what is compared
        return
    paddle.save(model.state_dict(), f"{args.output_dir}/params.pdparams")  # for the comparison
    with open(f"{args.output_dir}/run_info.json", "w") as f:  # what the model ran with
        json.dump(
            {
                k: getattr(config, k)
                for k in (
                    "recompute_granularity",
                    "recompute_method",
                    "recompute_num_layers",
                    "recompute_use_reentrant",
                )
            },
            f,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
