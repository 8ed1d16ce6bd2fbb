"""A PaddleNLP-style ``llm/run_pretrain.py`` with PaddleNLP's own fused layers (tests/nlp/llm/,
written in the form of PaddleNLP 2.8's llm/ and the seed report), run UNMODIFIED: paddle_mgrad is
switched on by ``PADDLE_MGRAD=all`` alone.  One process and two gloo ranks, every flag users
combine; losses and parameters equal a plain run (no flags, no paddle_mgrad); every trainable
parameter's gradient lands in fp32 ``main_grad`` exactly once per micro-step; the counters prove
our recompute and our op (under Paddle's ``_C_ops`` name) ran.  Without paddle_mgrad the script
fails on CPU.

Evidence from inside the unmodified script comes from tests/nlp/evidence/sitecustomize.py.
"""

import dataclasses
import importlib.util
import json
import os
import re
import zlib  # noqa: F401  (before paddle)

import cpu_nlp_standins
import numpy as np
import paddle
import pytest

import paddle_mgrad
from paddle_mgrad import stats
from paddle_mgrad._compat import IS_PADDLE_2
from script_runs import launch, script_env, switch_on, trainer_args, with_evidence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLM = os.path.join(ROOT, "tests", "nlp", "llm")
SCRIPT = os.path.join(LLM, "run_pretrain.py")
EVIDENCE = os.path.join(ROOT, "tests", "nlp", "evidence")

ALL_FLAGS = [
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
MAX_STEPS, ACCUM, LAYERS, LINEARS_PER_LAYER = 2, 2, 2, 7  # q, k, v, o, gate, up, down
STEPS = trainer_args(MAX_STEPS, ACCUM, per_device_train_batch_size=2)
ZLIB_FIRST = """import zlib, os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


def run_script(tmp_path, name, flags, mode, nproc=1, timeout=900, extra_env=None):
    """mode: "mgrad" (PADDLE_MGRAD=all + evidence), "plain" (no paddle_mgrad; zlib imported first
    by a wrapper so that Paddle 2.6 gets as far as training), "bare" (no paddle_mgrad at all).
    ``extra_env``: more environment variables for the script.
    Returns (returncode, output, out_dir)."""
    out_dir = tmp_path / name
    env = script_env()
    env.update(extra_env or {})
    script = [SCRIPT]
    if mode == "mgrad":
        with_evidence(env, out_dir / "audit", EVIDENCE)
        switch_on(env, tmp_path)
    else:
        env.pop("PYTHONPATH", None)
        if mode == "plain":
            wrapper = tmp_path / "zlib_first.py"
            wrapper.write_text(ZLIB_FIRST)
            script = [str(wrapper), SCRIPT]
    if mode != "bare" and cpu_nlp_standins.needs_cpu_sync_standin():  # PaddleNLP 2.7.x on CPU
        cpu_nlp_standins.request(env, EVIDENCE)
    rc, out = launch(
        [*script, "--output_dir", str(out_dir), *STEPS, *flags],
        out_dir,
        nproc,
        env,
        timeout,
        tmp_path,
    )
    return rc, out, out_dir


def losses(out_dir):
    with open(out_dir / "trainer_state.json") as f:
        return [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]


def audits(out_dir, nproc):
    return [json.load(open(out_dir / "audit" / f"audit.{r}.json")) for r in range(nproc)]


def check_main_grads(a):
    """Every trainable parameter's gradient landed in fp32 ``main_grad``, once per micro-step."""
    micro = MAX_STEPS * ACCUM
    s = a["audit"]
    assert s["trainable"] == s["received_grad"] == s["in_fp32_main_grad"] > 0, s
    assert s["grads_per_param"] == [micro, micro], s  # exactly once per micro-step
    assert s["grad_not_none"] == 0 and s["missing"] == []
    assert a["main_grad_dtypes"] == ["paddle.float32"]


def check_evidence(a):
    micro = MAX_STEPS * ACCUM
    check_main_grads(a)
    # every decoder layer through our recompute, and recomputed once
    assert a["recompute"]["non_reentrant"] == micro * LAYERS
    assert a["recompute"]["recomputations"] == micro * LAYERS
    # PaddleNLP's own FusedLinearWithGradAdd is bound (mock_layers ran) and its backward
    # called paddle._C_ops.fused_linear_param_grad_add = our op, once per linear and micro-step
    assert a["F_linear_is_paddle_function"] is False
    assert a["paddle_c_ops"] == {"ours": micro * LAYERS * LINEARS_PER_LAYER, "paddle": 0}
    assert a["linear"]["backward"] == 0  # ours ran inside PaddleNLP's forward without grad
    assert "_C_ops.fused_linear_param_grad_add" in a["installed"] and "recompute" in a["installed"]


def report_diffs(label, on, off):
    """Print the measured differences (visible with pytest -s; quoted in the README)."""
    a = paddle.load(str(on / "model_state.pdparams"))
    b = paddle.load(str(off / "model_state.pdparams"))
    dl = float(np.max(np.abs(np.subtract(losses(on), losses(off)))))
    dp = max(float(np.max(np.abs(a[k].numpy() - b[k].numpy()))) for k in a)
    print(
        f"\nMEASURED {label} paddle {paddle.__version__}: losses {losses(on)} vs {losses(off)}; "
        f"max |loss diff| {dl:.3g}, max |param diff| {dp:.3g}"
    )


def compare_params(a_dir, b_dir):
    """Parameters after training.  atol 1e-5 = 1% of one AdamW step at lr 1e-3: Adam divides by
    sqrt(v), so for a near-zero gradient a rounding-level difference (fused GEMM vs matmul +
    add summation order) moves an update by up to ~1e-6 (seen: 1.05e-6 with 2 ranks)."""
    a = paddle.load(str(a_dir / "model_state.pdparams"))
    b = paddle.load(str(b_dir / "model_state.pdparams"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.fixture(scope="module")
def plain_single_process(tmp_path_factory):
    """The plain run (no flags, no paddle_mgrad) in one process: the reference, run once."""
    rc, out_plain, off = run_script(tmp_path_factory.mktemp("plain"), "off", [], "plain")
    assert rc == 0, out_plain[-5000:]
    return off


def test_unmodified_script_single_process(tmp_path, plain_single_process):
    rc, out, on = run_script(tmp_path, "on", ALL_FLAGS, "mgrad")
    assert rc == 0, out[-5000:]
    off = plain_single_process
    lines = [
        ln for ln in out.splitlines() if re.match(r"(\[rank \d+\] )?paddle_mgrad: ", ln)
    ]  # not the build log
    assert len(lines) == 1 and "recompute, fused_linear on (op: cpp-" in lines[0], lines
    assert len(losses(on)) == MAX_STEPS
    report_diffs("1 process", on, off)
    np.testing.assert_allclose(losses(on), losses(off), rtol=0, atol=1e-5)
    compare_params(on, off)
    check_evidence(audits(on, 1)[0])


# (budget: 2 decoder layers per micro-step hold about half of no recompute's bytes under full
# recompute already; 0.75 leaves room to keep)
@pytest.mark.parametrize("policy", ["gemm", "budget:0.75"])
def test_unmodified_script_under_a_recompute_policy(tmp_path, plain_single_process, policy):
    """Every flag users combine (PaddleNLP's own fused linear with
    ``--enable_linear_fused_grad_add`` included) and ``PADDLE_MGRAD_RECOMPUTE_POLICY`` in the
    environment, nothing else changed: the same losses and parameters as the plain run, every
    gradient once in fp32 ``main_grad``, and GEMMs (``gemm``) or sublayers (``budget:``)
    spared in the recomputations."""
    env = {"PADDLE_MGRAD_RECOMPUTE_POLICY": policy}
    rc, out, on = run_script(tmp_path, "on", ALL_FLAGS, "mgrad", extra_env=env)
    assert rc == 0, out[-5000:]
    off = plain_single_process
    report_diffs(f"1 process, {policy} policy", on, off)
    np.testing.assert_allclose(losses(on), losses(off), rtol=0, atol=1e-5)
    compare_params(on, off)
    (a,) = audits(on, 1)
    check_main_grads(a)
    blocks = MAX_STEPS * ACCUM * LAYERS
    g = a["policy"].get(policy, {})
    whole = g.get("blocks_kept_whole", 0)  # (a step's last block kept whole: not recomputed)
    assert g.get("calls") == blocks and g.get("replays") == blocks - whole, a["policy"]
    if policy == "gemm":
        assert g.get("gemms_not_recomputed", 0) > 0 and whole == 0, a["policy"]
    else:
        (plan,) = a["plans"][policy].values()
        assert plan["chosen"] or plan["last_block"], plan
        # measured: budget.MEASURED_CALLS calls (the first micro-step's 2, its backward seen,
        # then one more), for the 2 decoder layers of a micro-step alive at once; the plan is
        # made at the second micro-step's last call: from there on each micro-step's last
        # block is kept whole where the plan says so (the first micro-step's is, measuring
        # what that costs)
        assert (plan["measured_calls"], plan["live_blocks"]) == (3, LAYERS), plan
        planned_whole = MAX_STEPS * ACCUM - 1 if plan["last_block"] else 0
        assert whole == 1 + planned_whole, (g, plan)
        replayed = blocks - 3 - planned_whole  # (planned calls recomputed)
        gemms = sum(n.startswith("gemm:") for n in plan["chosen"])  # (one linear per weight)
        assert g.get("sublayers_not_recomputed") == replayed * (len(plan["chosen"]) - gemms), (
            g,
            plan,
        )
        assert g.get("gemms_not_recomputed") == replayed * gemms, (g, plan)


def test_unmodified_script_two_ranks(tmp_path):
    rc, out, on = run_script(tmp_path, "on", ALL_FLAGS, "mgrad", nproc=2)
    assert rc == 0, out[-8000:]
    rc, out_plain, off = run_script(tmp_path, "off", [], "plain", nproc=2)
    assert rc == 0, out_plain[-8000:]
    for rank in (0, 1):  # each rank switched on and said so
        assert f"[rank {rank}] paddle_mgrad: recompute, fused_linear on (op: cpp-" in out, out[
            -8000:
        ]
    report_diffs("2 ranks", on, off)
    np.testing.assert_allclose(losses(on), losses(off), rtol=0, atol=1e-5)
    compare_params(on, off)
    for a in audits(on, 2):
        check_evidence(a)


def test_script_fails_without_paddle_mgrad(tmp_path):
    """The real problem: unmodified, on CPU, the script dies (2.6: zlib at import; 3.x: no CPU
    kernel for PaddleNLP's fused op); with zlib imported first, 2.6 dies in Paddle's
    recompute (CPU RNG) or the seed's save_for_backward(x, weight, None)."""
    rc, out, _ = run_script(tmp_path, "bare", ALL_FLAGS, "bare")
    assert rc != 0
    if IS_PADDLE_2:
        assert "zlib" in out or "SIGSEGV" in out, out[-3000:]
    else:
        assert "fused_linear_param_grad_add` is not registered" in out, out[-3000:]
    rc, out, _ = run_script(tmp_path, "zlib_first", ALL_FLAGS, "plain")
    assert rc != 0
    assert (
        "fused_linear_param_grad_add` is not registered" in out
        or "not support current device: cpu" in out
        or "save_for_backward only support" in out
    ), out[-3000:]


# --- in process: whichever linear ends up bound, each gradient lands once -------------------


def _fused_layers():
    spec = importlib.util.spec_from_file_location(
        "pmg_test_fused_layers", os.path.join(LLM, "fused_layers.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.up = paddle.nn.Linear(8, 16)  # with bias
        self.down = paddle.nn.Linear(16, 4, bias_attr=False)  # bias None: the seed's ValueError

    def forward(self, x):
        return self.down(paddle.tanh(self.up(x)))


def _train(net, xs, recompute):
    for x in xs:
        if recompute:
            from paddle.distributed.fleet.utils import recompute as fleet_recompute

            y = fleet_recompute(net, x, use_reentrant=False)
        else:
            y = net(x)
        (y * y).mean().backward()


@pytest.mark.parametrize("order", ["ours_only", "enable_then_mock", "mock_then_enable"])
def test_each_gradient_lands_once_whichever_linear_is_bound(order):
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    from paddle_mgrad.diagnostics.audit import MainGradAudit

    fused_layers = _fused_layers()
    paddle.seed(7)
    net, ref = Block(), Block()
    ref.set_state_dict(net.state_dict())
    xs = [paddle.randn([3, 5, 8]) for _ in range(2)]
    for x in xs:
        x.stop_gradient = False
    _train(ref, xs, recompute=False)  # plain autograd reference, .grad accumulated

    saved_linear = paddle.nn.functional.linear
    try:
        if order == "enable_then_mock":
            paddle_mgrad.enable(recompute=True, fused_linear=True)
            fused_layers.mock_layers()
        elif order == "mock_then_enable":
            fused_layers.mock_layers()
            paddle_mgrad.enable(recompute=True, fused_linear=True)
        else:
            paddle_mgrad.enable(recompute=True, fused_linear=True)
        MixPrecisionLayer(net, dtype="bfloat16")
        audit = MainGradAudit(net)
        stats.reset()
        _train(net, xs[:1], recompute=True)
        ptrs = {p.name: p.main_grad.data_ptr() for p in net.parameters()}
        _train(net, xs[1:], recompute=True)
    finally:
        paddle.nn.functional.linear = saved_linear
        paddle_mgrad.disable()

    s = audit.summary()
    assert s["trainable"] == s["in_fp32_main_grad"] == 3 and s["grads_per_param"] == [2, 2], s
    for p, q in zip(net.parameters(), ref.parameters()):
        assert p.grad is None
        assert p.main_grad.dtype == paddle.float32
        assert p.main_grad.data_ptr() == ptrs[p.name]  # second micro-step accumulated in place
        np.testing.assert_allclose(
            p.main_grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=p.name
        )
    assert stats.recompute["non_reentrant"] == 2
    if order == "ours_only":  # our PyLayer, our op called directly
        assert stats.linear["backward"] == 4 and stats.paddle_c_ops["ours"] == 0
    else:  # PaddleNLP's PyLayer, our op through paddle._C_ops
        assert stats.linear["backward"] == 0 and stats.paddle_c_ops["ours"] == 4


# --- trainer route: PaddleNLP's own PreTrainingArguments -------------------------------------


def test_mgrad_arguments_never_clash_with_pretraining_arguments():
    import argparse

    from paddlenlp.trainer import PdArgumentParser, TrainingArguments

    from paddle_mgrad.trainer import MgradArguments, apply, mgrad_arguments_for

    spec = importlib.util.spec_from_file_location("pmg_test_run_pretrain", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    Pre = script.PreTrainingArguments
    assert issubclass(Pre, TrainingArguments)
    with pytest.raises(argparse.ArgumentError, match="conflicting option"):
        PdArgumentParser((Pre, MgradArguments))  # the clash users hit

    Mgrad = mgrad_arguments_for(Pre)
    assert "enable_linear_fused_grad_add" not in {f.name for f in dataclasses.fields(Mgrad)}
    parser = PdArgumentParser((Pre, Mgrad))
    pre, mgrad = parser.parse_args_into_dataclasses(
        args=[
            "--output_dir",
            "unused",
            "--report_to",
            "none",
            "--recompute",
            "--enable_linear_fused_grad_add",
            "--mgrad_audit",
            "false",
        ]
    )
    assert pre.enable_linear_fused_grad_add is True and mgrad.mgrad_audit is False
    info = apply(pre, mgrad, argv=[])
    assert info["recompute"] and info["fused_linear"]
    assert paddle_mgrad.enabled() == {"recompute": True, "fused_linear": True}
