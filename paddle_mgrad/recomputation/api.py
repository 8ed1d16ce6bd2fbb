"""The public entry point, :func:`recompute`, and the trampoline Paddle's ``recompute`` runs."""
from __future__ import annotations

from .._compat import paddle, tracer
from .non_reentrant import recompute_non_reentrant
from .reentrant import recompute_reentrant

__all__ = ["recompute"]


def recompute(function, *args, use_reentrant=True, preserve_rng_state=True, offload_indices=(),
              **kwargs):
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
    * other keyword arguments go to ``function``.

    Raises :class:`~paddle_mgrad.RecomputeError` in backward if recomputation
    does not save the same tensors (count, shapes, dtypes) as the forward did.
    """
    if not paddle.in_dynamic_mode():
        from paddle.distributed.auto_parallel.interface import recompute as static_recompute

        return static_recompute(function)(*args, **kwargs)
    if not tracer()._has_grad:
        return function(*args, **kwargs)
    if use_reentrant:
        return recompute_reentrant(function, preserve_rng_state, offload_indices, args, kwargs)
    if offload_indices:
        raise ValueError("offload_indices is only supported with use_reentrant=True (as in Paddle)")
    return recompute_non_reentrant(function, preserve_rng_state, args, kwargs)


def _paddle_recompute_trampoline(function, *args, **kwargs):
    """Becomes the code of Paddle's ``recompute`` (registry entry ``recompute``)."""
    import paddle_mgrad.recomputation.api as _api  # runs in Paddle's module globals

    return _api.recompute(function, *args, **kwargs)
