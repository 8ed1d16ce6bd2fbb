"""A PaddleNLP-style ``llm/run_pretrain.py`` (written for this test, following PaddleNLP 2.8's
llm/ layout): its own ``PreTrainingArguments`` defines ``--enable_linear_fused_grad_add`` and,
when set, ``mock_layers()`` from ``fused_layers.py`` replaces Paddle's linear.  PaddleNLP's
Trainer, a tiny ``LlamaForCausalLM``, the llama example's byte tokenizer and corpus.

It knows nothing about paddle_mgrad: the tests run it unmodified, switching paddle_mgrad on
with ``PADDLE_MGRAD=all`` only.  Usage (flags as PaddleNLP's)::

    python tests/nlp/llm/run_pretrain.py --output_dir out --max_steps 4 \\
        --amp_master_grad --bf16 --fp16_opt_level O2 --recompute \\
        --recompute_granularity full --recompute_use_reentrant false \\
        --enable_linear_fused_grad_add
"""
import os
import sys
from dataclasses import dataclass, field

import paddle
from paddlenlp.trainer import PdArgumentParser, Trainer, TrainingArguments, set_seed
from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "..", "examples", "llama")
sys.path.insert(0, EXAMPLE)
from data import BlockDataset, ByteTokenizer  # noqa: E402  (the example's, no downloads)


@dataclass
class PreTrainingArguments(TrainingArguments):
    enable_linear_fused_grad_add: bool = field(
        default=False,
        metadata={"help": "Enable fused linear grad add strategy, which will reduce elementwise "
                          "add for grad accumulation in the backward of nn.Linear ."})


@dataclass
class ModelArguments:
    hidden_size: int = field(default=64)
    intermediate_size: int = field(default=128)
    num_hidden_layers: int = field(default=2)
    num_attention_heads: int = field(default=4)
    recompute_granularity: str = field(default="full")
    recompute_use_reentrant: bool = field(default=False)


@dataclass
class DataArguments:
    input_file: str = field(default=os.path.join(EXAMPLE, "data", "corpus.txt"))
    max_seq_length: int = field(default=64)


class PretrainingTrainer(Trainer):
    """Sequential batches, as pretraining reads its data: rank r takes slice r of each batch."""

    def _get_train_sampler(self):
        return paddle.io.DistributedBatchSampler(
            self.train_dataset, batch_size=self.args.per_device_train_batch_size, shuffle=False,
            num_replicas=max(1, self.args.dataset_world_size), rank=max(0, self.args.dataset_rank),
            drop_last=self.args.dataloader_drop_last)


def main():
    parser = PdArgumentParser((ModelArguments, DataArguments, PreTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    if training_args.enable_linear_fused_grad_add:
        from fused_layers import mock_layers

        mock_layers()

    set_seed(training_args.seed)
    tokenizer = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=model_args.hidden_size,
        intermediate_size=model_args.intermediate_size,
        num_hidden_layers=model_args.num_hidden_layers,
        num_attention_heads=model_args.num_attention_heads,
        max_position_embeddings=data_args.max_seq_length)
    config.recompute_granularity = model_args.recompute_granularity
    config.recompute_use_reentrant = model_args.recompute_use_reentrant
    config.use_recompute = training_args.recompute
    # Built in the default dtype: Paddle's CPU build has no bf16 matmul (on a GPU PaddleNLP
    # passes dtype=bfloat16 here).
    model = LlamaForCausalLM(config)

    dataset = BlockDataset(data_args.input_file, data_args.max_seq_length, tokenizer)
    trainer = PretrainingTrainer(model=model, args=training_args, train_dataset=dataset)
    result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()


if __name__ == "__main__":
    main()
