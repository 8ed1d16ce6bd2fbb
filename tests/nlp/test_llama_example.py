"""The llama example on PaddleNLP 2.8.1 as the real client (run by `nox -s nlp`)."""

import os

import numpy as np
import paddle

import paddle_mgrad
from helpers import cpu_backend, expected_cpu_backend
from paddle_mgrad._compat import IS_PADDLE_2

STEPS = [
    "--max_steps",
    "4",
    "--per_device_train_batch_size",
    "2",
    "--gradient_accumulation_steps",
    "2",
]
OFF = ["--recompute", "false", "--enable_linear_fused_grad_add", "false"]


def _params(out_dir):
    return paddle.load(os.path.join(str(out_dir), "model_state.pdparams"))


def test_all_flags_match_plain_run_and_audit(example, tmp_path):
    rc, out, on = example(tmp_path / "on", *STEPS)
    assert rc == 0, out[-4000:]
    rc, out, off = example(tmp_path / "off", *STEPS, *OFF)
    assert rc == 0, out[-4000:]
    assert on["global_step"] == off["global_step"] == 4
    np.testing.assert_allclose(on["logged_losses"], off["logged_losses"], rtol=1e-5, atol=1e-5)
    assert len(on["logged_losses"]) == 4
    # every flag really was on, and only in the first run
    enabled = dict(on["enabled"])
    backend = enabled.pop("op_backend")
    assert enabled == {"recompute": True, "fused_linear": True}
    # the example's process ran the op backend this Paddle and environment imply, derived apart
    # from the op (helpers.expected_cpu_backend); on a CPU Paddle that tier is the whole
    # backend, a CUDA Paddle's adds its GPU tier
    assert cpu_backend(backend) == expected_cpu_backend(), backend
    assert backend == expected_cpu_backend() or paddle.is_compiled_with_cuda(), backend
    assert on["amp_master_grad"] is True
    audit = on["audit"]
    assert audit["in_fp32_main_grad"] == audit["received_grad"] == audit["trainable"] > 0
    assert audit["grad_not_none"] == 0
    # every trainable linear weight of the decoder went through the fused op
    n_layers, linears_per_layer = 2, 7  # q, k, v, o, gate, up, down
    assert audit["fused_linear_params"] == n_layers * linears_per_layer
    assert off["audit"]["fused_linear_params"] == 0
    a, b = _params(tmp_path / "on"), _params(tmp_path / "off")
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_modeling_code_goes_through_fixed_recompute(example, tmp_path):
    rc, out, s = example(tmp_path / "rc", *STEPS)
    assert rc == 0, out[-4000:]
    # 4 steps x 2 micro-batches x 2 decoder layers, all through paddle_mgrad.recompute
    assert s["recompute_calls"]["non_reentrant"] == 16
    assert s["recompute_calls"]["recomputations"] == 16


def test_in_process_alias_is_patched():
    """PaddleNLP's llama module bound `recompute` at import; enable() reaches that alias."""
    from paddlenlp.transformers.llama import modeling

    from paddle_mgrad import stats

    def call():
        x = paddle.randn([3])
        x.stop_gradient = False
        before = stats.recompute["non_reentrant"]
        modeling.recompute(
            paddle.tanh, x, use_reentrant=False, preserve_rng_state=False
        ).sum().backward()
        return stats.recompute["non_reentrant"] - before

    assert call() == 0  # Paddle's own
    paddle_mgrad.enable(recompute=True)
    try:
        assert call() == 1
    finally:
        paddle_mgrad.disable()
    assert call() == 0


def test_native_recompute_without_the_fix(example, tmp_path):
    """Paddle 2.6's own non-reentrant recompute dies on CPU RNG; 3.x's runs (its main_grad
    bugs need a user PyLayer to show, see tests/recomputation/test_recomputation.py)."""
    rc, out, s = example(
        tmp_path / "nofix",
        *STEPS,
        "--mgrad_fix_recompute",
        "false",
        "--enable_linear_fused_grad_add",
        "false",
    )
    if IS_PADDLE_2:
        assert rc != 0
        assert "not support current device: cpu" in out
    else:
        assert rc == 0, out[-4000:]
        assert s["recompute_calls"]["non_reentrant"] == 0  # really Paddle's own


def test_data_parallel_matches_single_process(example, tmp_path):
    flags = ["--max_steps", "3", "--gradient_accumulation_steps", "1"]
    rc, out, dp = example(tmp_path / "dp", *flags, "--per_device_train_batch_size", "2", nproc=2)
    assert rc == 0, out[-6000:]
    rc, out, sp = example(tmp_path / "sp", *flags, "--per_device_train_batch_size", "4")
    assert rc == 0, out[-4000:]
    assert dp["world_size"] == 2 and sp["world_size"] == 1
    assert dp["audit"]["in_fp32_main_grad"] == dp["audit"]["trainable"]
    a, b = _params(tmp_path / "dp"), _params(tmp_path / "sp")
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


RESUME = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1"]


def _resume(example, out_dir, *extra):
    """Train 2 steps saving checkpoint-2, then resume from it to step 4 (same output dir)."""
    base = [*RESUME, *extra]
    rc, out, first = example(out_dir, *base, "--max_steps", "2", "--save_steps", "2")
    assert rc == 0, out[-4000:]
    ckpt = out_dir / "checkpoint-2"
    assert (ckpt / "model_state.pdparams").exists() and (ckpt / "optimizer.pdopt").exists()
    rc, out, second = example(
        out_dir, *base, "--max_steps", "4", "--resume_from_checkpoint", str(ckpt)
    )
    assert rc == 0, out[-4000:]
    return first, second


def _load(path):
    return paddle.load(str(path))


def test_resume_from_checkpoint(example, tmp_path):
    """Resume with every flag on, checked against an *uninterrupted* run (separate
    processes, same seed) and against PaddleNLP's own resume without paddle_mgrad.

    What holds (asserted): the first 2 steps and checkpoint-2 equal the uninterrupted
    run's; the first step after resuming logs the uninterrupted run's step-3 loss (a
    forward of the checkpoint's parameters on the 3rd batch); with and without
    paddle_mgrad the resumed runs agree (losses and final parameters).  What does not
    hold in PaddleNLP 2.8.1 on CPU, with or without paddle_mgrad (measured, asserted
    equal for both): the parameters after resume+2 steps equal the uninterrupted run's
    only to a loose tolerance, and the 2nd step after resuming logs another loss."""
    rc, out, whole = example(tmp_path / "whole", *RESUME, "--max_steps", "4", "--save_steps", "2")
    assert rc == 0, out[-4000:]
    first, second = _resume(example, tmp_path / "on")
    _, plain = _resume(
        example, tmp_path / "off", *OFF, "--amp_master_grad", "false", "--bf16", "false"
    )
    assert second["global_step"] == 4 and second["audit"]["in_fp32_main_grad"] > 0
    assert second["recompute_calls"]["non_reentrant"] > 0  # the resumed run went through ours
    # 1. before the interruption: identical to the uninterrupted run
    np.testing.assert_array_equal(first["logged_losses"], whole["logged_losses"][:2])
    ck, ck_whole = (
        _load(d / "checkpoint-2" / "model_state.pdparams")
        for d in (tmp_path / "on", tmp_path / "whole")
    )
    assert sorted(ck) == sorted(ck_whole)
    for k in ck:
        np.testing.assert_array_equal(ck[k].numpy(), ck_whole[k].numpy(), err_msg=k)
    # 2. the first step after resuming starts from exactly the checkpoint
    new = second["logged_losses"][2:]
    assert len(new) == 2
    np.testing.assert_allclose(new[0], whole["logged_losses"][2], rtol=1e-6, atol=1e-6)
    # 3. paddle_mgrad resumes as PaddleNLP does without it
    np.testing.assert_allclose(new, plain["logged_losses"][2:], rtol=1e-5, atol=1e-5)
    fin_on, fin_off, fin_whole = (
        _load(d / "model_state.pdparams")
        for d in (tmp_path / "on", tmp_path / "off", tmp_path / "whole")
    )
    gap_on, gap_off = 0.0, 0.0
    for k in fin_on:
        np.testing.assert_allclose(
            fin_on[k].numpy(), fin_off[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k
        )
        gap_on = max(gap_on, float(np.abs(fin_on[k].numpy() - fin_whole[k].numpy()).max()))
        gap_off = max(gap_off, float(np.abs(fin_off[k].numpy() - fin_whole[k].numpy()).max()))
    # 4. PaddleNLP 2.8.1 is not continuous from the 2nd step after resuming (measured here:
    # step-4 loss 5.300 resumed vs 5.035 uninterrupted, final parameters 4.9e-3 apart), the
    # same with and without paddle_mgrad.  Asserted, so that a PaddleNLP fix shows.
    assert abs(new[1] - whole["logged_losses"][3]) > 1e-3
    assert abs(plain["logged_losses"][3] - whole["logged_losses"][3]) > 1e-3
    print(
        f"max |resumed - uninterrupted| after 4 steps: ours {gap_on:.3g}, PaddleNLP {gap_off:.3g}"
    )
    assert 0 < gap_on < 5e-2 and 0 < gap_off < 5e-2
    np.testing.assert_allclose(gap_on, gap_off, rtol=0.05, atol=1e-6)


def test_amp_master_grad_without_amp_is_a_one_line_error(example, tmp_path):
    rc, out, _ = example(
        tmp_path / "bad", "--max_steps", "1", "--bf16", "false", "--amp_master_grad", "true"
    )
    assert rc == 2
    err = [line for line in out.splitlines() if "run_pretrain.py: error:" in line]
    assert len(err) == 1 and "--bf16" in err[0]


def test_flags_only_no_json(tmp_path):
    """PaddleNLP's default --report_to (visualdl) crashed the example on Paddle 3.3.1 when run
    with flags only; the example defaults it to none."""
    import json
    import subprocess
    import sys

    import cpu_nlp_standins
    from llama_example_runs import EVIDENCE, EXAMPLE, ROOT

    out_dir = tmp_path / "flags"
    cmd = [
        sys.executable,
        EXAMPLE,
        "--output_dir",
        str(out_dir),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--logging_steps",
        "1",
        "--save_steps",
        "1000",
        "--amp_master_grad",
        "--bf16",
        "--fp16_opt_level",
        "O2",
        "--recompute",
        "--recompute_granularity",
        "full",
        "--recompute_use_reentrant",
        "false",
        "--enable_linear_fused_grad_add",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if cpu_nlp_standins.needs_cpu_sync_standin():  # PaddleNLP 2.7.x on CPU
        cpu_nlp_standins.request(env, EVIDENCE)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    s = json.load(open(out_dir / "mgrad_summary.json"))
    assert s["global_step"] == 2 and s["enabled"]["fused_linear"] and s["enabled"]["recompute"]
    assert s["audit"]["in_fp32_main_grad"] == s["audit"]["trainable"]
    assert not (out_dir / "runs").exists() and "visualdl" not in r.stdout + r.stderr
