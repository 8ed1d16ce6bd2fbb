"""paddle_mgrad.trainer without PaddleNLP: flag validation, enable, the main_grad audit."""

from types import SimpleNamespace

import paddle
import pytest
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import cpu_backend, expected_cpu_backend
from paddle_mgrad import trainer as T
from paddle_mgrad.diagnostics.audit import MainGradAudit


def targs(**kw):
    base = dict(recompute=True, bf16=True, fp16=False, amp_master_grad=True, fp16_opt_level="O2")
    base.update(kw)
    return SimpleNamespace(**base)


def test_apply_enables_by_default_when_recompute_is_on():
    info = T.apply(targs(), T.MgradArguments(enable_linear_fused_grad_add=True), argv=[])
    assert info["recompute"] and info["fused_linear"]
    assert cpu_backend(info["op_backend"]) == expected_cpu_backend(), info["op_backend"]
    assert paddle_mgrad.enabled() == {"recompute": True, "fused_linear": True}


def test_expected_backend_follows_paddle_and_the_variables():
    """The suite's expectation of the op backend (tests/helpers.py), for the tests that check
    what a training process reports."""
    onednn = paddle.base.core.is_compiled_with_mkldnn()
    assert expected_cpu_backend({}) == ("cpp-onednn" if onednn else "cpp-portable")
    assert expected_cpu_backend({"PADDLE_MGRAD_NO_ONEDNN": "1"}) == "cpp-portable"
    assert expected_cpu_backend({"PADDLE_MGRAD_NO_ONEDNN": "0"}) == expected_cpu_backend({})
    assert expected_cpu_backend({"PADDLE_MGRAD_OPS": "python"}) == "python"
    assert [
        cpu_backend(b)
        for b in ("cpp-onednn", "cpp-onednn+cuda", "cpp-portable;gpu=python", "python;gpu=python")
    ] == ["cpp-onednn", "cpp-onednn", "cpp-portable", "python"]


def test_apply_respects_switches():
    info = T.apply(targs(recompute=False), T.MgradArguments(), argv=[])
    assert info == {"recompute": False, "fused_linear": False}
    assert (
        T.apply(targs(), T.MgradArguments(mgrad_fix_recompute=False), argv=[])["recompute"] is False
    )
    assert (
        T.apply(targs(recompute=False), T.MgradArguments(mgrad_fix_recompute=True), argv=[])[
            "recompute"
        ]
        is True
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--amp_master_grad"],
        ["--amp_master_grad", "true"],
        ["--amp_master_grad=1"],
        ["--amp_master_grad", "false", "--amp_master_grad", "true"],
    ],
)
def test_amp_master_grad_without_amp_is_refused(argv):
    with pytest.raises(paddle_mgrad.FlagError) as e:
        T.apply(targs(bf16=False, amp_master_grad=False), T.MgradArguments(), argv=argv)
    assert "\n" not in str(e.value) and "--bf16" in str(e.value)


def test_amp_master_grad_false_last_is_fine():
    T.apply(
        targs(bf16=False, amp_master_grad=False),
        T.MgradArguments(),
        argv=["--amp_master_grad", "true", "--amp_master_grad", "false"],
    )


def test_amp_master_grad_needs_o2():
    with pytest.raises(paddle_mgrad.FlagError, match="O2"):
        T.apply(targs(fp16_opt_level="O1"), T.MgradArguments(), argv=[])


def test_fused_linear_on_gpu_without_cuda_build_is_refused(monkeypatch):
    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")
    with pytest.raises(paddle_mgrad.FlagError) as e:
        T.apply(targs(), T.MgradArguments(enable_linear_fused_grad_add=True), argv=[])
    assert "CUDA" in str(e.value) and "\n" not in str(e.value)
    assert not paddle_mgrad.enabled()["fused_linear"]  # nothing half-enabled


def test_gpu_with_paddles_fused_op_is_accepted_and_logged(monkeypatch, capsys):
    """A CUDA Paddle without our CUDA build still has Paddle's own fused op for GPU tensors:
    the flag is accepted, and apply() says in one line what runs."""
    from paddle_mgrad import ops

    monkeypatch.setattr(paddle, "get_device", lambda: "gpu:0")
    with ops.loader.settled(gpu="paddle-fused"):
        info = T.apply(targs(), T.MgradArguments(enable_linear_fused_grad_add=True), argv=[])
    assert info["fused_linear"] and paddle_mgrad.enabled()["fused_linear"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("paddle_mgrad: ") and "fused_linear on (op: cpp-" in err[-1]
    assert err[-1].endswith("via trainer flags")


def test_audit_counts_main_grad_and_fused_params():
    T.apply(targs(), T.MgradArguments(enable_linear_fused_grad_add=True), argv=[])
    net = paddle.nn.Sequential(
        paddle.nn.Embedding(10, 8), paddle.nn.Linear(8, 8), paddle.nn.LayerNorm(8)
    )
    MixPrecisionLayer(net, dtype="bfloat16")
    audit = MainGradAudit(net)
    for _ in range(2):
        x = paddle.to_tensor([[1, 2, 3]])
        paddle_mgrad.recompute(net, x, use_reentrant=False).sum().backward()
    s = audit.summary()
    assert s["trainable"] == 5 and s["received_grad"] == 5 and s["in_fp32_main_grad"] == 5
    assert s["fused_linear_params"] == 2 and s["missing"] == [] and s["grad_not_none"] == 0
    assert "5/5" in audit.report()
    audit.remove()


def test_audit_reports_params_outside_main_grad():
    net = paddle.nn.Linear(4, 2)  # no MixPrecisionLayer: gradients land in .grad
    audit = MainGradAudit(net)
    net(paddle.randn([3, 4])).sum().backward()
    s = audit.summary()
    assert s["in_fp32_main_grad"] == 0 and len(s["missing"]) == 2
    assert "NOT in main_grad" in audit.report()


def test_apply_takes_the_fused_flag_from_whichever_args_object_has_it():
    """PaddleNLP's llm/run_pretrain.py defines --enable_linear_fused_grad_add on its own
    PreTrainingArguments: the flag counts wherever it is."""
    import dataclasses

    unrelated = dataclasses.make_dataclass("Unrelated", [("seq_length", int, 128)])
    assert T.mgrad_arguments_for(unrelated) is T.MgradArguments
    info = T.apply(targs(enable_linear_fused_grad_add=True), T.MgradArguments(), argv=[])
    assert info["fused_linear"] is True and paddle_mgrad.enabled()["fused_linear"]
    paddle_mgrad.disable()
    other = SimpleNamespace(enable_linear_fused_grad_add=True)
    assert T.apply(targs(), T.MgradArguments(), other, argv=[])["fused_linear"] is True
    paddle_mgrad.disable()
    assert (
        T.apply(targs(enable_linear_fused_grad_add=False), T.MgradArguments(), argv=[])[
            "fused_linear"
        ]
        is False
    )


def test_mgrad_arguments_for_drops_the_fields_others_define():
    import dataclasses

    @dataclasses.dataclass
    class PreTrainingArguments:
        enable_linear_fused_grad_add: bool = False

    cls = T.mgrad_arguments_for(PreTrainingArguments)
    names = [f.name for f in dataclasses.fields(cls)]
    assert names == ["mgrad_fix_recompute", "recompute_policy", "mgrad_audit"]
    args = cls()
    assert args.mgrad_fix_recompute is None and args.mgrad_audit is True
    info = T.apply(targs(), args, argv=[])  # no enable_linear_fused_grad_add anywhere: off
    assert info == {"recompute": True, "fused_linear": False}
    pre = PreTrainingArguments(enable_linear_fused_grad_add=True)
    assert T.apply(targs(), args, pre, argv=[])["fused_linear"] is True


def test_recompute_policy_flag_reaches_every_recompute_call(monkeypatch, capsys):
    """``--recompute_policy gemm`` sets the variable every recompute call reads (Paddle's own
    included), says so, and is checked: a bad name or no recompute is a one-line FlagError."""
    from paddle.distributed.fleet.utils import recompute

    from paddle_mgrad import stats

    # apply() sets the variable for the process: put back as it was after the test (setenv
    # records the original state, absent included, and delenv then clears it for the test)
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", "full")
    monkeypatch.delenv("PADDLE_MGRAD_RECOMPUTE_POLICY")
    with pytest.raises(
        T.FlagError,
        match=r"--recompute_policy: unknown recompute policy; "
        r"accepted: full, gemm",
    ):
        T.apply(targs(), T.MgradArguments(recompute_policy="gemms"), argv=[])
    with pytest.raises(T.FlagError, match="needs paddle_mgrad's recompute"):
        T.apply(targs(recompute=False), T.MgradArguments(recompute_policy="gemm"), argv=[])
    assert "PADDLE_MGRAD_RECOMPUTE_POLICY" not in __import__("os").environ
    info = T.apply(
        targs(),
        T.MgradArguments(enable_linear_fused_grad_add=True, recompute_policy="GEMM"),
        argv=[],
    )
    assert info["recompute_policy"] == "gemm"
    assert "(recompute policy: gemm)" in capsys.readouterr().err
    stats.reset()
    lin = paddle.nn.Linear(4, 4)
    x = paddle.randn([2, 4])
    x.stop_gradient = False
    # (a block whose linear's input is recomputed: tanh's output)
    recompute(lambda t: lin(paddle.tanh(t)), x, use_reentrant=False).sum().backward()
    assert stats.snapshot()["policy"]["gemm"]["gemms_not_recomputed"] == 1
    paddle_mgrad.disable()
