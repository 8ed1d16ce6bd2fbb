"""Paddle's large-model paths routed into our op: fleet's overlap linears (:mod:`.overlap_linear`,
:mod:`.sp_overlap_linear`, :mod:`.collective_overlap`), the zero-bubble deferred weight gradient
(:mod:`.zero_bubble`) and ``paddle._C_ops.fused_linear_param_grad_add`` under Paddle's name
(:mod:`.c_ops`)."""
