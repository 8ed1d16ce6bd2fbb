"""paddle_mgrad: fp32 master gradients (``main_grad``) that survive recompute,
and a fused linear whose weight gradient accumulates in place into them.

Quick start::

    import paddle_mgrad
    paddle_mgrad.enable(recompute=True, fused_linear=True)   # before building the model

``python -m paddle_mgrad doctor`` says what runs where and whether it works.
"""

from ._cli import command_line_process as _command_line_process

# `python -m paddle_mgrad doctor` (or the paddle-mgrad script): import nothing of Paddle, check
# nothing, switch nothing on here -- the doctor probes all of it in subprocesses (see _cli.py),
# so that it can report an invalid variable instead of dying of it.
_AS_COMMAND_LINE = _command_line_process()


def _check_env():
    """Every PADDLE_MGRAD* variable, validated once: a typo stops here with one message naming
    the variable and the accepted values (EnvError) instead of being ignored deep inside a run.
    Under the PADDLE_MGRAD start-up hook (activation pending) that is its one line, exit 2."""
    import sys

    from . import env as _env

    try:
        _env.check()
    except _env.EnvError as e:
        hook = sys.modules.get("paddle_mgrad_autoload")
        if hook is not None and getattr(hook, "pending", False):
            hook.fail(e)
        raise


if not _AS_COMMAND_LINE:
    from . import _compat  # noqa: F401  (imports zlib before paddle on 2.6)

    _check_env()
    from . import stats
    from .errors import EnvError, FlagError, FusedLinearError, RecomputeError
    from .linear import FusedLinearWithGradAdd, fused_linear
    from .recomputation import recompute
    from .switch import disable, enable, enabled

__version__ = "0.1.0"


def _activate_if_pending():
    """PADDLE_MGRAD set and ``import paddle_mgrad`` came before ``import paddle``: the
    start-up hook saw Paddle imported from here and left activation to this point."""
    import sys

    hook = sys.modules.get("paddle_mgrad_autoload")
    if hook is not None and getattr(hook, "pending", False):
        hook.pending = False
        from .autoload import _activate_from_hook

        _activate_from_hook()


if not _AS_COMMAND_LINE:
    _activate_if_pending()

__all__ = [
    "__version__",
    "enable",
    "disable",
    "enabled",
    "recompute",
    "RecomputeError",
    "FusedLinearError",
    "FlagError",
    "EnvError",
    "fused_linear",
    "FusedLinearWithGradAdd",
    "stats",
]
