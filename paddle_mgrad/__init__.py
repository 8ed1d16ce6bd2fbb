"""paddle_mgrad: fp32 master gradients (``main_grad``) that survive recompute,
and a fused linear whose weight gradient accumulates in place into them.

Quick start::

    import paddle_mgrad
    paddle_mgrad.enable(recompute=True, fused_linear=True)   # before building the model
"""
from . import _compat  # noqa: F401  (imports zlib before paddle on 2.6)
from .errors import FusedLinearError, RecomputeError
from .patching import disable, enable, enabled
from .recomputation import recompute

__version__ = "0.1.0"

__all__ = [
    "__version__", "enable", "disable", "enabled", "recompute", "RecomputeError",
    "FusedLinearError", "fused_linear", "FusedLinearWithGradAdd",
]


def __getattr__(name):  # lazy: the fused linear may build a C++ op
    if name in ("fused_linear", "FusedLinearWithGradAdd"):
        from . import linear as _fl

        return getattr(_fl, name)
    if name == "ops":
        import importlib

        return importlib.import_module(".ops", __name__)
    raise AttributeError(name)
