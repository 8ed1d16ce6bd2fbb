"""A PaddleNLP ``TrainerCallback`` that logs tokens/s (this example's own measurement)."""

import time


def tokens_per_second_callback(tokens_per_step: int):
    from paddlenlp.trainer import TrainerCallback

    class TokensPerSecond(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.history = []

        def on_step_begin(self, args, state, control, **kwargs):
            if self.t0 is None:
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.history.append(tokens_per_step / max(now - self.t0, 1e-9))
            self.t0 = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is not None and self.history:
                logs["tokens_per_second"] = round(self.history[-1], 1)

    return TokensPerSecond()
