"""``enable()`` / ``disable()`` / ``enabled()``: switch paddle_mgrad's features on and off.

Everything they change inside Paddle is listed in :mod:`paddle_mgrad.registry`.
"""

from __future__ import annotations

# Re-exported: the parser lives with the variable it reads (env.py, a bottom module), so that
# env does not import back up into the switch.
from .env import ACTIVATION_VALUES, parse_activation

__all__ = ["enable", "disable", "enabled", "parse_activation", "ACTIVATION_VALUES"]


def enable(recompute: bool = True, fused_linear: bool = False):
    """Install paddle_mgrad's fixes into Paddle (idempotent).

    ``recompute=True``: Paddle's ``recompute`` (every alias of it, including
    ``paddle.distributed.fleet.utils.recompute`` and names bound by
    ``from ... import recompute`` before this call) runs
    :func:`paddle_mgrad.recompute`.

    ``fused_linear=True``: ``paddle.nn.functional.linear`` (hence
    ``paddle.nn.Linear`` and fleet's parallel linears) and
    ``paddle.incubate.nn.functional.fused_linear`` run
    :func:`paddle_mgrad.fused_linear`, whose weight/bias gradients accumulate
    in place into fp32 ``main_grad``.

    A feature passed as ``False`` is switched off if it was on.  With either
    feature on, ``ctx.save_for_backward`` of any ``PyLayer`` also takes
    non-tensor objects (bool, int, None, strings, ...) while saved-tensor hooks
    are active (registry entry ``PyLayerContext.save_for_backward``).
    """
    from . import registry  # local: importing the switch imports nothing of Paddle

    for feature, on in (("recompute", recompute), ("fused_linear", fused_linear)):
        if on:
            registry.install(feature)
        else:
            registry.uninstall(feature)
    if recompute or fused_linear:
        from .recomputation.saved_hooks import install_save_shim

        install_save_shim()


def disable():
    """Restore every object paddle_mgrad replaced in Paddle, exactly (identity).

    Also removes what the first :func:`paddle_mgrad.recompute` call installed
    (the backward error translation; on Paddle 2.6 the ``save_for_backward``
    None shim), so call it between runs, not while a graph awaits backward.
    """
    from . import registry

    registry.uninstall(None)
    from .recomputation.saved_hooks import release

    release()  # the saved-tensor hook slot, if threads kept our dispatcher in it


def enabled() -> dict:
    """``{"recompute": bool, "fused_linear": bool}``."""
    from . import registry

    return {
        "recompute": registry.is_installed("recompute"),
        "fused_linear": registry.is_installed("linear"),
    }
