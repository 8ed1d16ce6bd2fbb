"""The main_grad audit: did every trainable parameter get its gradient in fp32 ``main_grad``?"""

from __future__ import annotations

from .. import stats
from .._compat import paddle

__all__ = ["MainGradAudit"]


class MainGradAudit:
    """Counts, per trainable parameter and backward, where its gradient went.

    A backward hook (``_register_backward_hook``, fired after the parameter's
    gradient is accumulated) records whether ``main_grad`` is an fp32 tensor and
    ``.grad`` is None at that point.  ``report()`` summarises; linear weights
    that went through the fused op are counted separately.
    """

    def __init__(self, model):
        self.params = [p for p in model.parameters() if not p.stop_gradient]
        self.seen = {p.name: 0 for p in self.params}
        self.in_main_grad = {p.name: 0 for p in self.params}
        self.grad_leak = {p.name: 0 for p in self.params}
        self._handles = []
        for p in self.params:
            self._handles.append(p._register_backward_hook(self._hook(p)))

    def _hook(self, p):
        def hook(*_):
            self.seen[p.name] += 1
            mg = getattr(p, "main_grad", None)
            if mg is not None and mg.dtype == paddle.float32 and p.grad is None:
                self.in_main_grad[p.name] += 1
            if p.grad is not None and hasattr(p, "main_grad"):
                self.grad_leak[p.name] += 1

        return hook

    def summary(self) -> dict:
        trained = [n for n, c in self.seen.items() if c > 0]
        ok = [n for n in trained if self.in_main_grad[n] == self.seen[n]]
        fused = sorted(set(trained) & stats.fused_params)
        linear_weights = [
            p.name for p in self.params if len(p.shape) == 2 and "embed" not in p.name
        ]
        counts = [self.seen[n] for n in trained]
        return {
            "trainable": len(self.params),
            "received_grad": len(trained),
            "grads_per_param": [min(counts, default=0), max(counts, default=0)],
            "in_fp32_main_grad": len(ok),
            "grad_not_none": sum(1 for n in trained if self.grad_leak[n]),
            "fused_linear_params": len(fused),
            "fused_names": fused,
            "missing": sorted(set(trained) - set(ok)),
            "linear_weights": len(linear_weights),
        }

    def report(self) -> str:
        s = self.summary()
        return (
            f"main_grad audit: {s['in_fp32_main_grad']}/{s['received_grad']} trainable parameters "
            f"received their gradient in fp32 main_grad with .grad None "
            f"({s['trainable']} trainable; {s['fused_linear_params']} through the fused linear op)"
            + (f"; NOT in main_grad: {', '.join(s['missing'][:5])}" if s["missing"] else "")
        )

    def remove(self):
        for h in self._handles:
            if hasattr(h, "remove"):
                h.remove()
        self._handles = []
