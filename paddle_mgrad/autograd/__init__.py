"""The PyLayer machinery that the fused linear and the recompute share so that they behave as
plain Paddle: which kind of backward pass runs (:mod:`.passes`: ``GuardedPyLayer``, ``paddle.grad``),
our errors through Paddle's backward entry points (:mod:`.backward_errors`), user gradient hooks
(:mod:`.param_hooks`)."""
