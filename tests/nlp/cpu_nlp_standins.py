"""Stand-in for what PaddleNLP 2.7.x lacks on CPU, for tests/nlp only (never part of the
package).  tests/nlp/test_paddlenlp_cpu_gap.py asserts the failure without it, so a fix upstream
shows; the 2.8.1 legs never use it.

PaddleNLP 2.7.2's ``Trainer`` times itself with ``paddlenlp.trainer.plugins.timer.RuntimeTimer``,
whose ``start``/``stop`` call ``paddle.device.synchronize()``; on a CPU place Paddle 2.6.2 raises
``TypeError: device should be gpu, xpu, ...`` (at the first ``trainer.train()``, with or without
paddle_mgrad).  PaddleNLP 2.7.1 and 2.8.1 do not call it there.

Switched on for a subprocess by ``PMG_TEST_PADDLENLP_CPU_SYNC_STANDIN=1`` with tests/nlp/evidence
on ``PYTHONPATH`` (its sitecustomize applies it when PaddleNLP's trainer module is imported).
"""

import os

ENV = "PMG_TEST_PADDLENLP_CPU_SYNC_STANDIN"


def paddlenlp_version():
    from importlib import metadata

    try:
        return metadata.version("paddlenlp")
    except metadata.PackageNotFoundError:
        return None


def needs_cpu_sync_standin() -> bool:
    """PaddleNLP 2.7.x: its Trainer cannot run on CPU without the stand-in."""
    return (paddlenlp_version() or "").startswith("2.7.")


def paddlenlp27_cpu_synchronize_standin():
    """``paddle.device.synchronize()`` with no device on a CPU place returns (nothing to wait for
    on a CPU) instead of raising; every other call goes to Paddle's."""
    import paddle

    synchronize = paddle.device.synchronize
    if getattr(synchronize, "pmg_test_standin", False):
        return

    def cpu_ok(device=None):
        if device is None and isinstance(
            paddle.framework._current_expected_place(), paddle.CPUPlace
        ):
            return None
        return synchronize(device)

    cpu_ok.pmg_test_standin = True
    paddle.device.synchronize = cpu_ok


def request(env, evidence_dir):
    """Ask a subprocess (environment ``env``) for the stand-in: the flag and the evidence
    sitecustomize on its PYTHONPATH."""
    env[ENV] = "1"
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(evidence_dir) not in parts:
        parts.insert(0, str(evidence_dir))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env
