"""Stand-ins for what PaddleFormers 1.2.0 / Paddle 3.3.1 lack on CPU, for tests/formers only
(never part of the package).  Each names the limitation it stands in for; test_paddleformers.py
asserts the failure without it, so a fix upstream shows."""

import paddle


def cpu_synchronize_standin():
    """PaddleFormers 1.2.0's Trainer calls ``paddle.device.synchronize()`` before every optimizer
    step when gradient_accumulation_steps > 1; on a CPU place Paddle 3.3.1 raises
    ``TypeError: device should be gpu, xpu, `` (a PaddleFormers/Paddle CPU gap, with or without
    paddle_mgrad).  Stand-in for this CPU test only: nothing to wait for on a CPU place."""
    synchronize = paddle.device.synchronize

    def cpu_ok(device=None):
        if device is None and isinstance(
            paddle.framework._current_expected_place_(), paddle.CPUPlace
        ):
            return None
        return synchronize(device)

    paddle.device.synchronize = cpu_ok
