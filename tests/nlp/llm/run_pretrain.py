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

As PaddleNLP 2.8's script: ``--model_name_or_path DIR`` takes the model (llama, qwen, ...) and
its config from a saved model, ``--continue_training`` its weights too (split by PaddleNLP for
``--tensor_parallel_degree``, mapped onto ``AutoModelForCausalLMPipe`` for
``--pipeline_parallel_degree``); ``--sequence_parallel``, ``--pp_recompute_interval`` and
``--fuse_sequence_parallel_allreduce`` go to the model config; without a path, a tiny llama of
the sizes below.
"""

import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import paddle
from paddlenlp.trainer import PdArgumentParser, Trainer, TrainingArguments, set_seed
from paddlenlp.transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "..", "examples", "llama")
sys.path.insert(0, EXAMPLE)
from data import BlockDataset, ByteTokenizer  # noqa: E402  (the example's, no downloads)


@dataclass
class PreTrainingArguments(TrainingArguments):
    enable_linear_fused_grad_add: bool = field(
        default=False,
        metadata={
            "help": "Enable fused linear grad add strategy, which will reduce elementwise "
            "add for grad accumulation in the backward of nn.Linear ."
        },
    )


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "A saved PaddleNLP model (config, weights); none: a tiny "
            "llama of the sizes below."
        },
    )
    continue_training: bool = field(
        default=False, metadata={"help": "Pre-training from the weights of model_name_or_path."}
    )
    sequence_parallel: bool = field(
        default=False, metadata={"help": "whether to use sequence parallel"}
    )
    fuse_sequence_parallel_allreduce: bool = field(
        default=False, metadata={"help": "whether to use fuse sequence parallel allreduce"}
    )
    no_recompute_layers: Optional[List[int]] = field(
        default=None,
        metadata={"help": "Specify the full transformer layers that should not be recomputed."},
    )
    pp_recompute_interval: int = field(
        default=1,
        metadata={
            "help": "The interval for the number of layers at which recomputation "
            "occurs in pipeline parallel."
        },
    )
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
            self.train_dataset,
            batch_size=self.args.per_device_train_batch_size,
            shuffle=False,
            num_replicas=max(1, self.args.dataset_world_size),
            rank=max(0, self.args.dataset_rank),
            drop_last=self.args.dataloader_drop_last,
        )


def main():
    parser = PdArgumentParser((ModelArguments, DataArguments, PreTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    if training_args.enable_linear_fused_grad_add:
        from fused_layers import mock_layers

        mock_layers()

    set_seed(training_args.seed)
    tokenizer = ByteTokenizer()
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
        config.seq_length = data_args.max_seq_length
        if not model_args.continue_training:
            config.max_position_embeddings = max(
                config.max_position_embeddings, data_args.max_seq_length
            )
            config.vocab_size = max(
                config.vocab_size, ((tokenizer.vocab_size - 1) // 128 + 1) * 128
            )
    else:
        config = LlamaConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=model_args.hidden_size,
            intermediate_size=model_args.intermediate_size,
            num_hidden_layers=model_args.num_hidden_layers,
            num_attention_heads=model_args.num_attention_heads,
            max_position_embeddings=data_args.max_seq_length,
        )
    config.recompute_granularity = model_args.recompute_granularity
    config.recompute_use_reentrant = model_args.recompute_use_reentrant
    config.use_recompute = training_args.recompute
    config.sequence_parallel = model_args.sequence_parallel
    config.fuse_sequence_parallel_allreduce = model_args.fuse_sequence_parallel_allreduce
    config.no_recompute_layers = model_args.no_recompute_layers
    config.pp_recompute_interval = model_args.pp_recompute_interval
    config.tensor_parallel_degree = training_args.tensor_parallel_degree
    config.tensor_parallel_rank = training_args.tensor_parallel_rank

    # Built in the default dtype: Paddle's CPU build has no bf16 matmul (on a GPU PaddleNLP
    # passes dtype=bfloat16 here).
    model_class = AutoModelForCausalLM
    if training_args.pipeline_parallel_degree > 1:
        from paddlenlp.transformers import AutoModelForCausalLMPipe

        model_class = AutoModelForCausalLMPipe
    if model_args.continue_training:
        model = model_class.from_pretrained(model_args.model_name_or_path, config=config)
    elif model_args.model_name_or_path or training_args.pipeline_parallel_degree > 1:
        model = model_class.from_config(config)
    else:
        model = LlamaForCausalLM(config)

    if model_args.sequence_parallel:
        from paddlenlp.transformers import register_sequence_parallel_allreduce_hooks

        register_sequence_parallel_allreduce_hooks(
            model,
            training_args.gradient_accumulation_steps,
            model_args.fuse_sequence_parallel_allreduce,
        )

    dataset = BlockDataset(data_args.input_file, data_args.max_seq_length, tokenizer)
    trainer = PretrainingTrainer(model=model, args=training_args, train_dataset=dataset)
    result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()


if __name__ == "__main__":
    main()
