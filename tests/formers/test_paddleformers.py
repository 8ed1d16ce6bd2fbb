"""PaddleFormers 1.2.0 (PaddleNLP's successor, what Paddle 3.x users train with): its own
``Trainer`` and ``TrainingArguments`` and a tiny ``LlamaForCausalLM`` built from its config
(tests/formers/train_tiny.py, nothing in it mentions paddle_mgrad), 2 steps x 2 accumulation
on CPU with every master-grad/recompute flag PaddleFormers has, in one process and on 2 gloo
ranks (PaddleFormers' default multi-rank setup, sharding stage1).  ``PADDLE_MGRAD=all`` alone
switches paddle_mgrad on; losses and parameters equal a plain run (no flags, no paddle_mgrad);
every trainable parameter's gradient lands in fp32 ``main_grad`` exactly once per micro-step,
every ``nn.Linear`` weight through our op, every recompute PaddleFormers does through ours.

What PaddleFormers 1.2.0 does with the flags (read from its installed sources):
* ``amp_master_grad`` (TrainingArguments, default True; needs bf16/fp16): one process ->
  ``MixPrecisionLayer`` + ``MixPrecisionOptimizer``; at each optimizer step the Trainer scales
  ``main_grad`` by 1/accumulation.
* ``recompute_granularity/method/num_layers`` (TrainingArguments, copied onto the model config by
  ``LlmMetaConfig.set_llm_config`` as its CLI workflows do): llama/qwen2 call fleet's
  ``recompute`` (imported by name at import time) per decoder layer, and the criterion
  (``nn/criterion/sft_loss.py``) recomputes the loss too.  Neither passes ``use_reentrant``: the
  config's ``recompute_use_reentrant`` is ignored there (honoured by the pipeline model only).
* ``enable_linear_fused_grad_add``: not a TrainingArguments field.  It exists in the CLI's
  ``FinetuningArguments``, which the sft/pt workflows never read; the deepseek_v3 and
  auto_parallel workflows import ``mock_layers`` from ``utils.fused_layers`` /
  ``llm.utils.fused_layers``, modules not in the wheel.  So the Trainer path has no fused
  weight-gradient linear of its own: with paddle_mgrad, ``F.linear`` (every ``nn.Linear``) is ours.
* ``tensor_parallel_config enable_mp_fused_linear_param_grad_add``: fleet's mp_configs, used
  by fleet's ColumnParallelLinear only with tensor parallel > 1 (covered by tests/fleet).

CPU gap (PaddleFormers/Paddle, not ours): the Trainer calls ``paddle.device.synchronize()`` when
gradient_accumulation_steps > 1, which raises on a CPU place; cpu_formers_standins.py stands in for it
(test_cpu_gap_* asserts the failure without the stand-in, so a fix shows).
"""

import json
import os
import re
import zlib  # noqa: F401  (before paddle)

import numpy as np
import paddle
import paddleformers  # without it, tests/conftest.py skips this module
import pytest

from script_runs import launch, script_env, switch_on, trainer_args, with_evidence  # tests/

# trainings (heavy: dealt first under xdist); one worker runs the module, so that the
# module-scoped plain run happens once
pytestmark = [pytest.mark.heavy, pytest.mark.xdist_group("formers_plain_run")]

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "train_tiny.py")
EVIDENCE = os.path.join(HERE, "evidence")

MAX_STEPS, ACCUM, LAYERS, LINEARS_PER_LAYER = 2, 2, 2, 7  # q, k, v, o, gate, up, down
MICRO = MAX_STEPS * ACCUM
STEPS = trainer_args(MAX_STEPS, ACCUM, per_device_train_batch_size=2, layers=LAYERS)
ALL_FLAGS = [
    "--bf16",
    "--fp16_opt_level",
    "O2",
    "--amp_master_grad",
    "true",
    "--recompute_granularity",
    "full",
    "--recompute_method",
    "uniform",
    "--recompute_num_layers",
    "1",
    "--use_reentrant",
    "false",
]
NO_FLAGS = ["--amp_master_grad", "false"]  # its default is True, refused without bf16/fp16
SYNC_ERROR = "TypeError: device should be gpu, xpu"
# With 2 ranks PaddleFormers defaults to sharding stage1 with split_param (Paddle's
# DygraphShardingOptimizerV2, whose tensor-fusion buffers assert a gpu/npu/xpu device:
# "tensor fusion helper now only support dict_keys(['gpu', 'npu', 'xpu'])" on CPU).  Stage1
# without split_param (Paddle's DygraphShardingOptimizer) runs on gloo.
ZERO1_CPU = ["--sharding", "stage1", "--split_param", "false"]
# Adam's epsilon 1e-6 (default 1e-8) for the 2-rank comparison: with 1e-8 one element of 8192 in
# up_proj, whose gradient is near zero, moved 1.55e-5 apart (Adam divides by sqrt(v): rounding-
# level gradient differences, fused GEMM vs matmul + add and the ranks' reduction order, become
# an lr-sized update there); with 1e-6 the largest parameter difference is 2.5e-7.
SMOOTH_ADAM = ["--adam_epsilon", "1e-6"]


def run_script(tmp_path, name, flags, mode, nproc=1, timeout=600, extra_env=None):
    """mode: "mgrad" (PADDLE_MGRAD=all + evidence), "audit" (evidence only, paddle_mgrad off),
    "plain" (no paddle_mgrad); nproc > 1: data parallel through paddle.distributed.launch (gloo).
    ``extra_env``: more environment variables for the script.
    Returns (returncode, output with the workers' logs, out_dir)."""
    out_dir = tmp_path / name
    env = script_env()
    env.pop("PYTHONPATH", None)
    env.update(extra_env or {})
    if mode in ("mgrad", "audit"):
        with_evidence(env, out_dir / "audit", EVIDENCE)
    if mode == "mgrad":
        switch_on(env, tmp_path)
    rc, out = launch(
        [SCRIPT, "--output_dir", str(out_dir), *STEPS, *flags],
        out_dir,
        nproc,
        env,
        timeout,
        tmp_path,
    )
    return rc, out, out_dir


def losses(out_dir):
    with open(out_dir / "losses.json") as f:
        return json.load(f)


def audit(out_dir, rank=0):
    with open(out_dir / "audit" / f"audit.{rank}.json") as f:
        return json.load(f)


def recompute_config(out_dir):
    with open(out_dir / "run_info.json") as f:
        return json.load(f)


FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
    "recompute_use_reentrant": False,
}


def params(out_dir):
    return {k: v.numpy() for k, v in paddle.load(str(out_dir / "params.pdparams")).items()}


def compare(on, off, label):
    """Losses to 1e-5; parameters to rtol/atol 1e-5 (1% of one AdamW step at lr 1e-3: Adam
    divides by sqrt(v), so a rounding-level gradient difference — fused GEMM vs matmul + add —
    can move a near-zero-gradient update by ~1e-6).  Prints the measured differences."""
    a, b = params(on), params(off)
    assert sorted(a) == sorted(b)
    dl = float(np.max(np.abs(np.subtract(losses(on), losses(off)))))
    dp = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    print(
        f"\nMEASURED {label} paddle {paddle.__version__} paddleformers {paddleformers.__version__}: "
        f"losses {losses(on)} vs {losses(off)}; max |loss diff| {dl:.3g}, max |param diff| {dp:.3g}"
    )
    assert len(losses(on)) == MAX_STEPS
    np.testing.assert_allclose(losses(on), losses(off), rtol=0, atol=1e-5)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5, err_msg=k)


def check_main_grad(a):
    s = a["audit"]
    assert s["trainable"] == s["received_grad"] == s["in_fp32_main_grad"] > 0, s
    assert s["grads_per_param"] == [MICRO, MICRO], s  # exactly once per micro-step
    assert s["grad_not_none"] == 0 and s["missing"] == [], s
    assert a["main_grad_dtypes"] == ["paddle.float32"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The reference: plain Paddle, no flags, no paddle_mgrad (shared by the tests below)."""
    tmp = tmp_path_factory.mktemp("plain")
    rc, out, off = run_script(tmp, "off", NO_FLAGS, "plain")
    assert rc == 0, out[-5000:]
    return off


def test_trainer_every_flag_with_paddle_mgrad_matches_plain(tmp_path, plain_run):
    rc, out, on = run_script(tmp_path, "on", ALL_FLAGS, "mgrad")
    assert rc == 0, out[-5000:]
    lines = [ln for ln in out.splitlines() if re.match(r"(\[rank \d+\] )?paddle_mgrad: ", ln)]
    assert len(lines) == 1 and "recompute, fused_linear on (op: cpp-" in lines[0], lines
    compare(on, plain_run, "PaddleFormers Trainer, every flag, PADDLE_MGRAD=all vs plain")
    assert recompute_config(on) == FULL_RECOMPUTE
    a = audit(on)
    check_main_grad(a)
    s = a["audit"]
    # every nn.Linear weight (q, k, v, o, gate, up, down per layer) through our op into main_grad
    assert s["fused_linear_params"] == s["linear_weights"] == LAYERS * LINEARS_PER_LAYER, s
    linears = MICRO * LAYERS * LINEARS_PER_LAYER
    assert a["linear"]["backward"] == a["linear"]["into_main_grad"] == linears, a["linear"]
    assert a["paddle_c_ops"] == {"ours": 0, "paddle": 0}  # no PyLayer of PaddleFormers' own
    # every recompute PaddleFormers does is ours: each decoder layer and the loss, each micro-step,
    # recomputed once.  Reentrant although recompute_use_reentrant=False: PaddleFormers 1.2.0's
    # llama (and its criterion) call recompute without use_reentrant (a fix there shows here).
    assert a["recompute"]["reentrant"] == a["recompute"]["recomputations"] == MICRO * (LAYERS + 1)
    assert a["recompute"]["non_reentrant"] == 0
    assert "recompute" in a["installed"] and "linear" in a["installed"]


# (budget: 2 decoder layers per micro-step hold about half of no recompute's bytes under full
# recompute already; 0.75 leaves room to keep)
@pytest.mark.parametrize("policy", ["gemm", "budget:0.75"])
def test_trainer_under_a_recompute_policy_matches_plain(tmp_path, plain_run, policy):
    """Every flag and ``PADDLE_MGRAD_RECOMPUTE_POLICY`` in the environment, nothing else
    changed: PaddleFormers' reentrant calls run on the non-reentrant engine (a policy needs
    it; same results), the losses and parameters are the plain run's, every gradient lands
    once in fp32 ``main_grad``, and GEMMs (``gemm``) or sublayers (``budget:``) are spared."""
    env = {"PADDLE_MGRAD_RECOMPUTE_POLICY": policy}
    rc, out, on = run_script(tmp_path, "on", ALL_FLAGS, "mgrad", extra_env=env)
    assert rc == 0, out[-5000:]
    compare(on, plain_run, f"PaddleFormers Trainer, every flag, {policy} policy vs plain")
    a = audit(on)
    check_main_grad(a)
    blocks = MICRO * (LAYERS + 1)  # each decoder layer and the loss, each micro-step
    rc_ = a["recompute"]
    assert rc_["reentrant"] == rc_["reentrant_as_non_reentrant"] == blocks, rc_
    g = a["policy"].get(policy, {})
    whole = g.get("blocks_kept_whole", 0)  # (the loss block, each micro-step's last, kept whole)
    assert rc_["recomputations"] == blocks - whole, rc_
    assert g.get("calls") == blocks and g.get("replays") == blocks - whole, a["policy"]
    if policy == "gemm":
        assert g.get("gemms_not_recomputed", 0) > 0 and whole == 0, a["policy"]
    else:
        plans = a["plans"][policy]  # the decoder layers' (the loss block's may keep nothing)
        assert plans["LlamaDecoderLayer"]["chosen"], plans
        assert not plans["LlamaDecoderLayer"]["last_block"], plans  # (the loss block ends)
        spared = g.get("sublayers_not_recomputed", 0) + g.get("gemms_not_recomputed", 0)
        assert spared > 0, (g, plans)


def test_trainer_two_ranks_data_parallel(tmp_path):
    """Two gloo ranks with PaddleFormers' default multi-rank setup, sharding stage1 (ZeRO-1:
    the sharding optimizer reduces main_grad): PADDLE_MGRAD=all with every flag equals plain
    Paddle with the same flags; on each rank every gradient lands in fp32 main_grad once per
    micro-step, through our op and our recompute."""
    rc, out, on = run_script(tmp_path, "on", ALL_FLAGS + ZERO1_CPU + SMOOTH_ADAM, "mgrad", nproc=2)
    assert rc == 0, out[-8000:]
    # the reference: plain Paddle with the same flags (equal to no flags in one process, see
    # test_trainer_every_flag_plain_paddle; with --amp_master_grad false, PaddleFormers 1.2.0's
    # sharding stage1 dies: "'AdamW' object has no attribute '_inner_opt'")
    rc, out_plain, off = run_script(
        tmp_path, "off", ALL_FLAGS + ZERO1_CPU + SMOOTH_ADAM, "plain", nproc=2
    )
    assert rc == 0, out_plain[-8000:]
    for rank in (0, 1):  # each rank switched on and said so
        assert f"[rank {rank}] paddle_mgrad: recompute, fused_linear on (op: cpp-" in out, out[
            -8000:
        ]
    compare(on, off, "PaddleFormers Trainer, 2 ranks, every flag, PADDLE_MGRAD=all vs plain")
    for rank in (0, 1):
        a = audit(on, rank)
        check_main_grad(a)
        linears = MICRO * LAYERS * LINEARS_PER_LAYER
        assert a["linear"]["backward"] == a["linear"]["into_main_grad"] == linears, a["linear"]
        assert a["recompute"]["reentrant"] == MICRO * (LAYERS + 1), a["recompute"]


def test_trainer_every_flag_plain_paddle(tmp_path, plain_run):
    """Plain Paddle 3.3.1 with every flag PaddleFormers' Trainer offers runs on CPU and lands every
    gradient in main_grad by MixPrecisionLayer's hook: no fused weight-gradient linear is on
    this path, so the seed's failure (a fused-grad-add PyLayer under recompute) is unreachable
    here.  paddle_mgrad stays off (its counters stay zero)."""
    rc, out, flags = run_script(tmp_path, "flags", ALL_FLAGS, "audit")
    assert rc == 0, out[-5000:]
    assert "paddle_mgrad: " not in out
    compare(flags, plain_run, "PaddleFormers Trainer, every flag, plain Paddle vs plain")
    assert recompute_config(flags) == FULL_RECOMPUTE  # what makes llama call fleet's recompute
    a = audit(flags)
    check_main_grad(a)
    assert a["audit"]["fused_linear_params"] == 0
    assert a["installed"] == [] and a["F_linear_is_paddle_function"] is True
    assert a["linear"]["backward"] == 0 and a["recompute"]["reentrant"] == 0


def test_cpu_gap_trainer_synchronize_fails_on_cpu(tmp_path):
    """Without the stand-in (cpu_formers_standins.py), PaddleFormers' Trainer (accumulation 2)
    dies on CPU in ``paddle.device.synchronize()`` — with or without paddle_mgrad; plain run
    shown."""
    rc, out, _ = run_script(tmp_path, "nosync", [*NO_FLAGS, "--cpu_sync_standin", "false"], "plain")
    assert rc != 0
    assert SYNC_ERROR in out, out[-3000:]
    assert "paddle.device.synchronize()" in out, out[-3000:]


def test_enable_linear_fused_grad_add_is_not_a_trainer_argument():
    """A user's ``--enable_linear_fused_grad_add`` is refused by PaddleFormers' TrainingArguments
    parser; the CLI's FinetuningArguments has the field (read by none of the sft/pt workflows)."""
    import dataclasses

    from paddleformers.trainer import PdArgumentParser, TrainingArguments

    assert "enable_linear_fused_grad_add" not in {
        f.name for f in dataclasses.fields(TrainingArguments)
    }
    assert "amp_master_grad" in {f.name for f in dataclasses.fields(TrainingArguments)}
    with pytest.raises(
        ValueError, match="not used by the PdArgumentParser: \\['--enable_linear_fused"
    ):
        PdArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            args=[
                "--output_dir",
                "unused",
                "--amp_master_grad",
                "false",
                "--enable_linear_fused_grad_add",
                "true",
            ]
        )
    from paddleformers.cli.hparams.finetuning_args import FinetuningArguments

    assert "enable_linear_fused_grad_add" in {
        f.name for f in dataclasses.fields(FinetuningArguments)
    }
