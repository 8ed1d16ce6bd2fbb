"""PaddleNLP 2.7.x's CPU gap that tests/nlp stands in for (cpu_nlp_standins.py), asserted here so
that the stand-in is known to be needed -- and a PaddleNLP fix shows.  On PaddleNLP 2.8.1 the
same code runs on CPU and no stand-in is used."""

import cpu_nlp_standins
import paddle
import pytest

import paddle_mgrad

NEEDS = cpu_nlp_standins.needs_cpu_sync_standin()
CPU_GAP = "device should be gpu, xpu"


@pytest.mark.parametrize("with_paddle_mgrad", [False, True], ids=["plain", "paddle_mgrad"])
def test_trainer_timer_synchronizes_on_cpu(with_paddle_mgrad):
    """The Trainer's RuntimeTimer: TypeError on CPU in PaddleNLP 2.7.x, with or without us."""
    from paddlenlp.trainer.plugins.timer import RuntimeTimer

    if with_paddle_mgrad:
        paddle_mgrad.enable(recompute=True, fused_linear=True)
    timer = RuntimeTimer("pmg-test")
    if NEEDS:
        with pytest.raises(TypeError, match=CPU_GAP):
            timer.start("checkpoint loading time")
        saved = paddle.device.synchronize
        try:  # the stand-in is what makes it run
            cpu_nlp_standins.paddlenlp27_cpu_synchronize_standin()
            timer.start("checkpoint loading time")
            timer.stop()
        finally:
            paddle.device.synchronize = saved
    else:
        timer.start("checkpoint loading time")
        timer.stop()


def test_example_dies_on_cpu_without_the_standin(example, tmp_path):
    """End to end: the llama example's first trainer.train() dies in the timer without the
    stand-in, with paddle_mgrad's flags and without them (PaddleNLP 2.7.x only)."""
    if not NEEDS:
        assert (
            cpu_nlp_standins.paddlenlp_version()
            and not cpu_nlp_standins.paddlenlp_version().startswith("2.7.")
        )
        return
    for name, flags in (
        ("ours", []),
        (
            "plain",
            [
                "--recompute",
                "false",
                "--enable_linear_fused_grad_add",
                "false",
                "--mgrad_fix_recompute",
                "false",
            ],
        ),
    ):
        rc, out, _ = example(tmp_path / name, "--max_steps", "1", *flags, cpu_sync_standin=False)
        assert rc != 0 and f"TypeError: {CPU_GAP}" in out and "synchronize" in out, out[-3000:]
