"""Exceptions raised by paddle_mgrad."""


class RecomputeError(RuntimeError):
    """Recomputation in backward did not reproduce the forward pass.

    Raised when the function given to :func:`paddle_mgrad.recompute` saves a
    different number of tensors for backward, or a tensor of a different shape
    or dtype, when it is re-run during backward.  Gradients computed from such
    a recomputation would be silently wrong, so we stop instead.  Usual causes:
    data-dependent control flow, randomness not driven by Paddle's generators
    (pass ``preserve_rng_state=True``), or state mutated between forward and
    backward (e.g. a layer's attribute changed after the forward).
    """


class FusedLinearError(ValueError):
    """Bad input to the fused weight-gradient op or the fused linear layer."""


class FlagError(ValueError):
    """A trainer flag combination that cannot work; the message is one actionable line."""


class EnvError(FlagError):
    """A ``PADDLE_MGRAD*`` environment variable holds a value it does not accept; the message
    names the variable and the accepted values (:mod:`paddle_mgrad.env`)."""
