"""The public entry point, :func:`recompute`, and the trampoline Paddle's ``recompute`` runs."""

from __future__ import annotations

from .. import env
from .._compat import paddle, tracer
from . import (
    policy as _policy,
    to_static,  # noqa: F401  (registers our files with to_static's SOT)
)
from .non_reentrant import recompute_non_reentrant
from .reentrant import recompute_reentrant

__all__ = ["recompute", "DETERMINISM_CHECKS", "ENV_DETERMINISM_CHECK"]

#: values of ``determinism_check`` (and of the environment variable below)
DETERMINISM_CHECKS = ("shapes", "values", "none")
#: read at each call when ``determinism_check`` is not given (for trainers and launch)
ENV_DETERMINISM_CHECK = "PADDLE_MGRAD_DETERMINISM_CHECK"


def determinism_check_mode(value=None):
    """The determinism check to run: ``value``, else ``$PADDLE_MGRAD_DETERMINISM_CHECK``
    (through :func:`paddle_mgrad.env.get`, which validates it: an
    :class:`~paddle_mgrad.errors.EnvError` naming the variable), else ``"shapes"``; a bad
    ``value`` is a ValueError."""
    if value is None:
        return env.get(ENV_DETERMINISM_CHECK)
    mode = {"default": "shapes"}.get(str(value).strip().lower(), str(value).strip().lower())
    if mode not in DETERMINISM_CHECKS:
        raise ValueError(
            f"determinism_check={value!r}: expected one of {', '.join(DETERMINISM_CHECKS)}"
        )
    return mode


def recompute(
    function,
    *args,
    use_reentrant=True,
    preserve_rng_state=True,
    offload_indices=(),
    determinism_check=None,
    policy=None,
    **kwargs,
):
    """Run ``function(*args, **kwargs)`` without keeping its activations for backward.

    Drop-in for ``paddle.distributed.fleet.utils.recompute`` (same arguments,
    same defaults, same results), keeping parameters -- with ``main_grad`` and
    every Python attribute -- as the very objects in backward.

    * ``use_reentrant`` (default ``True``, as Paddle): ``False`` selects the
      saved-tensor-hook implementation (:mod:`.non_reentrant`), ``True`` the
      PyLayer one (:mod:`.reentrant`).
    * ``preserve_rng_state`` (default ``True``): replay the forward's random
      state (CPU, GPU, XPU, custom devices, fleet's RNG tracker, numpy, Python
      ``random``) so that dropout masks are identical in recomputation.
    * ``offload_indices`` (reentrant only): positions of arguments to keep on
      the CPU between forward and backward.
    * ``determinism_check``: ``"shapes"`` (default), ``"values"`` or ``"none"``;
      when not given, the environment variable ``PADDLE_MGRAD_DETERMINISM_CHECK``
      (read at each call), else ``"shapes"``.  See below.
    * ``policy``: what to keep from the forward instead of recomputing it
      (:mod:`.policy`): ``"full"`` (keep nothing), ``"gemm"`` (keep every fused
      linear's output), ``"save:<pattern>[,<pattern>...]"`` (do not recompute the
      sublayers whose class name or attribute path matches: ``"save:self_attn"``) or
      a callable ``policy(call) -> bool``; when not given,
      ``PADDLE_MGRAD_RECOMPUTE_POLICY`` (read at each call), else ``"full"``.
      Gradients are bit-identical under every policy.  A policy other than
      ``full`` runs on the non-reentrant engine, whatever ``use_reentrant`` says
      (unless ``offload_indices`` is given).
    * other keyword arguments go to ``function``.

    Raises :class:`~paddle_mgrad.RecomputeError` in backward if recomputation
    does not save the same tensors (count, shapes, dtypes) as the forward did
    (non-reentrant).  With ``"values"`` it also compares a fingerprint (sum, sum
    of squares, a position-weighted strided sample) of every tensor that is
    recomputed (non-reentrant: each dropped saved activation; reentrant: each
    tensor output of the block), which catches same-shaped but different values:
    data-dependent slicing, an unseeded random op, a mutated global.  A
    fingerprint, not a proof: a change smaller than ~1e-5 of the tensor's
    magnitude can pass.
    """
    check = determinism_check_mode(determinism_check)
    chosen = _policy.resolve(policy)
    if not paddle.in_dynamic_mode():
        from paddle.distributed.auto_parallel.interface import recompute as static_recompute

        return static_recompute(function)(*args, **kwargs)
    if not tracer()._has_grad:
        return function(*args, **kwargs)
    if use_reentrant:
        return recompute_reentrant(
            function, preserve_rng_state, offload_indices, args, kwargs, check, chosen
        )
    if offload_indices:
        raise ValueError("offload_indices is only supported with use_reentrant=True (as in Paddle)")
    return recompute_non_reentrant(function, preserve_rng_state, args, kwargs, check, chosen)


def _paddle_recompute_trampoline(function, *args, **kwargs):
    """Becomes the code of Paddle's ``recompute`` (registry entry ``recompute``)."""
    import paddle_mgrad.recomputation.api as _api  # runs in Paddle's module globals

    return _api.recompute(function, *args, **kwargs)
