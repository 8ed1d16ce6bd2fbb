"""PaddleNLP-style trainer integration: one flag, one call.

Add :class:`MgradArguments` to your ``PdArgumentParser`` and call :func:`apply`
before the model is built::

    parser = PdArgumentParser((ModelArguments, DataArguments, TrainingArguments, MgradArguments))
    model_args, data_args, training_args, mgrad_args = parser.parse_args_into_dataclasses()
    paddle_mgrad.trainer.apply(training_args, mgrad_args)   # before LlamaForCausalLM(config)

Flags (spelled as PaddleNLP's ``llm/`` scripts spell them):

* ``--enable_linear_fused_grad_add``: ``paddle.nn.functional.linear`` (hence
  ``nn.Linear`` and the llama projections) accumulates weight/bias gradients in
  place into fp32 ``main_grad`` through our op.
* ``--mgrad_fix_recompute`` (default: on whenever ``--recompute`` is on):
  Paddle's ``recompute`` -- also the name PaddleNLP's modeling files imported at
  import time -- becomes :func:`paddle_mgrad.recompute`.
* ``--recompute_policy full|gemm|save:<pattern>|budget:<fraction>``: what every recompute
  call keeps from the forward instead of recomputing it
  (:mod:`paddle_mgrad.recomputation.policy`); sets
  ``PADDLE_MGRAD_RECOMPUTE_POLICY`` for this process and the ones it starts.

When another arguments dataclass of the parser already defines
``enable_linear_fused_grad_add`` (PaddleNLP's own ``PreTrainingArguments`` in
``llm/run_pretrain.py`` does), use ``mgrad_arguments_for(PreTrainingArguments, ...)``
instead of :class:`MgradArguments` -- the same fields minus the taken ones, so
argparse sees no conflicting option -- and pass every arguments object to
:func:`apply`: it reads the flag from whichever one has it.

Without any code: ``PADDLE_MGRAD=all`` (see :mod:`paddle_mgrad.autoload`).

Nothing here imports PaddleNLP.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Optional

from ._compat import paddle
from .env import RECOMPUTE_POLICY, parse_recompute_policy
from .errors import FlagError
from .switch import enable

__all__ = ["MgradArguments", "mgrad_arguments_for", "FlagError", "apply"]


@dataclass
class MgradArguments:
    enable_linear_fused_grad_add: bool = field(
        default=False,
        metadata={
            "help": "Accumulate linear weight/bias gradients in place into fp32 main_grad "
            "with paddle_mgrad's fused op (PaddleNLP llm/ flag name)."
        },
    )
    mgrad_fix_recompute: Optional[bool] = field(
        default=None,
        metadata={
            "help": "Route Paddle's recompute through paddle_mgrad.recompute (keeps main_grad "
            "and parameter attributes, CPU RNG on Paddle 2.6, determinism check). "
            "Default: on when --recompute is on."
        },
    )
    recompute_policy: Optional[str] = field(
        default=None,
        metadata={
            "help": "What recompute keeps from the forward instead of recomputing it, for "
            "every recompute call (Paddle's own included): full (keep nothing), "
            "gemm (keep every linear's output: no GEMM is recomputed) or "
            "save:<pattern>[,<pattern>...] (sublayers whose class name or "
            "attribute path matches, e.g. save:self_attn, are not recomputed) or "
            "budget:<fraction> (the sublayers and linears that spare the most replay time, measured, "
            "so that the blocks hold that fraction of the bytes they hold without recompute). "
            "Default: $PADDLE_MGRAD_RECOMPUTE_POLICY, else full."
        },
    )
    mgrad_audit: bool = field(
        default=True, metadata={"help": "Report which parameters got their gradient in main_grad."}
    )


def mgrad_arguments_for(*dataclasses_):
    """:class:`MgradArguments` without the fields the given dataclasses already define.

    ``PdArgumentParser((PreTrainingArguments, ..., mgrad_arguments_for(PreTrainingArguments)))``
    parses ``--enable_linear_fused_grad_add`` once, into ``PreTrainingArguments``;
    :func:`apply` finds it there.  Returns :class:`MgradArguments` itself when
    nothing clashes.
    """
    taken = {f.name for dc in dataclasses_ for f in dataclasses.fields(dc)}
    own = dataclasses.fields(MgradArguments)
    if not taken & {f.name for f in own}:
        return MgradArguments
    hints = typing.get_type_hints(MgradArguments)
    kept = [
        (f.name, hints[f.name], field(default=f.default, metadata=f.metadata))
        for f in own
        if f.name not in taken
    ]
    cls = dataclasses.make_dataclass("MgradArguments", kept)
    cls.__module__ = __name__
    cls.__doc__ = f"MgradArguments without {', '.join(sorted(taken & {f.name for f in own}))}."
    return cls


def _flag_requested(name, argv) -> bool:
    """Whether ``--name`` was last given as true (``--name``, ``--name true``, ``--name=true``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    value = False
    for i, a in enumerate(argv):
        if a == f"--{name}":
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            value = nxt.lower() not in ("false", "0", "no")
        elif a.startswith(f"--{name}="):
            value = a.split("=", 1)[1].lower() not in ("false", "0", "no")
    return value


def apply(
    training_args=None, mgrad_args: Optional[MgradArguments] = None, *other_args, argv=None
) -> dict:
    """Validate the flags and switch paddle_mgrad on; call before building the model.

    ``--enable_linear_fused_grad_add`` is read from whichever of ``mgrad_args``,
    ``training_args`` and ``other_args`` has it (true in any of them: on).

    Returns what was enabled, e.g. ``{"recompute": True, "fused_linear": True,
    "op_backend": "cpp-onednn"}``.  Raises :class:`FlagError` (one line) for
    combinations that cannot work.
    """
    mgrad_args = mgrad_args or MgradArguments()
    fused = any(
        bool(getattr(a, "enable_linear_fused_grad_add", False))
        for a in (mgrad_args, training_args, *other_args)
        if a is not None
    )
    recompute_on = bool(getattr(training_args, "recompute", False))
    fix = getattr(mgrad_args, "mgrad_fix_recompute", None)
    fix_recompute = recompute_on if fix is None else fix
    amp_on = bool(getattr(training_args, "bf16", False) or getattr(training_args, "fp16", False))

    if training_args is not None and _flag_requested("amp_master_grad", argv) and not amp_on:
        raise FlagError(
            "--amp_master_grad needs AMP (PaddleNLP silently turns it off without it): "
            "add --bf16 true --fp16_opt_level O2 (or --fp16 true)."
        )
    if (
        training_args is not None
        and getattr(training_args, "amp_master_grad", False)
        and getattr(training_args, "fp16_opt_level", "O2") != "O2"
    ):
        raise FlagError(
            "--amp_master_grad keeps fp32 master gradients for O2 AMP only: "
            "use --fp16_opt_level O2."
        )
    info = {"recompute": bool(fix_recompute), "fused_linear": fused}
    policy = getattr(mgrad_args, "recompute_policy", None)
    if policy is not None:
        try:
            info["recompute_policy"] = parse_recompute_policy(policy, "--recompute_policy")
        except ValueError as e:
            raise FlagError(str(e)) from None
        if not info["recompute"]:
            raise FlagError(
                f"--recompute_policy {policy} needs paddle_mgrad's recompute: add "
                "--recompute true (or --mgrad_fix_recompute true)."
            )
        # read at each recompute call (Paddle's own too): the whole process and its children
        os.environ[RECOMPUTE_POLICY] = info["recompute_policy"]
    if fused:
        from . import ops

        info["op_backend"] = ops.backend()
        gpu_tier = ops.backends()["gpu"]
        if paddle.get_device().startswith("gpu") and gpu_tier in (None, "python"):
            # Without our CUDA op or Paddle's own fused op, GPU tensors would take the slow
            # pure-Paddle path: refuse rather than train slowly without saying so.
            raise FlagError(
                "--enable_linear_fused_grad_add on GPU needs paddle_mgrad's CUDA op or Paddle's "
                f"fused_linear_param_grad_add kernel (now: {info['op_backend']}; "
                f"{ops.cuda_fallback_reason() or ops.fallback_reason() or 'Paddle without CUDA'}); "
                "install paddlepaddle-gpu and a CUDA toolkit (nvcc, cuBLASLt), or drop the flag."
            )
    enable(recompute=info["recompute"], fused_linear=info["fused_linear"])
    on = ", ".join(k for k in ("recompute", "fused_linear") if info[k]) or "nothing"
    op = f" (op: {info['op_backend']})" if fused else ""
    if "recompute_policy" in info:
        op += f" (recompute policy: {info['recompute_policy']})"
    print(f"paddle_mgrad: {on} on{op} via trainer flags", file=sys.stderr, flush=True)
    return info
