"""``enable()`` / ``disable()`` / ``enabled()``: switch paddle_mgrad's features on and off.

Everything they change inside Paddle is listed in :mod:`paddle_mgrad.registry`.
"""
from __future__ import annotations

from .errors import FlagError

__all__ = ["enable", "disable", "enabled", "parse_activation", "ACTIVATION_VALUES"]

#: what ``PADDLE_MGRAD`` accepts (comma-separated features, ``all``; ``0``/empty = off)
ACTIVATION_VALUES = ("recompute", "fused_linear", "all", "0")


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
    from . import registry  # local: parse_activation must not import Paddle (env, doctor)

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

    return {"recompute": registry.is_installed("recompute"),
            "fused_linear": registry.is_installed("linear")}


def parse_activation(value) -> dict:
    """Parse a ``PADDLE_MGRAD`` value into ``{"recompute": bool, "fused_linear": bool}``.

    ``recompute``, ``fused_linear``, both comma-separated (spaces and case
    ignored), ``all`` (both); ``None``, empty or ``0``: nothing.  Anything else
    raises :class:`~paddle_mgrad.FlagError` with a one-line message.
    """
    out = {"recompute": False, "fused_linear": False}
    text = (value or "").strip().lower()
    if text in ("", "0"):
        return out
    for item in (part.strip() for part in text.split(",")):
        if item == "all":
            out.update(recompute=True, fused_linear=True)
        elif item in out:
            out[item] = True
        else:
            raise FlagError(
                f"PADDLE_MGRAD={value!r}: unknown value {item!r}; allowed: recompute, fused_linear "
                "(comma-separated), all, or 0/empty for off")
    return out
