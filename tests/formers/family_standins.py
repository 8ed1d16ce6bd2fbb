"""Stand-ins for two packages PaddleFormers 1.2.0's modeling modules import that are not on
the package index, for tests/formers/train_family.py only (never part of the package).
test_families.py asserts the import failures without them, so a fix upstream shows.

* ``paddleformers.transformers.gpt_provider`` raises ``ImportError: paddlefleet is required``
  at import when ``paddlefleet`` is missing, and the modeling modules of qwen2, qwen3,
  qwen2_moe, qwen3_moe and glm4_moe import it at module level (for their paddlefleet
  ``*ForCausalLM``, a ``GPTModel`` built by ``*ModelProvider``).  The stand-in gives them
  ``GPTModelProvider`` as a base class that cannot provide anything: the tests train the
  ``*Deprecated`` classes, plain Paddle layers that never touch it.
* ``paddlefleet_ops`` (``transformers/fused_a2a.py``, reached through ``moe_layer`` by
  deepseek_v3, glm4_moe, qwen3_moe and qwen3_next): the stand-in says DeepEP is unavailable,
  which is what the modules check (``is_deep_ep_available()``) and the truth on a CPU.

Installed only for what is missing: a real paddlefleet / paddlefleet_ops is used as is.
"""

import importlib.util
import sys
import types

PROVIDER = "paddleformers.transformers.gpt_provider"


class _NoPaddlefleetProvider:
    """Base class only (its subclasses are dataclasses of provider settings)."""

    transform_rules = {}

    @classmethod
    def from_config(cls, config):
        raise ImportError(
            f"{cls.__name__}: paddlefleet is not installed (test stand-in, "
            "tests/formers/family_standins.py); use the *Deprecated model classes"
        )


def paddlefleet_import_standins():
    """Install the stand-ins (module docstring); returns the names of those installed."""
    installed = []
    if importlib.util.find_spec("paddlefleet") is None and PROVIDER not in sys.modules:
        provider = types.ModuleType(PROVIDER)
        provider.__doc__ = "test stand-in: tests/formers/family_standins.py"
        provider.GPTModelProvider = _NoPaddlefleetProvider
        sys.modules[PROVIDER] = provider
        installed.append(PROVIDER)
    if importlib.util.find_spec("paddlefleet_ops") is None:
        ops = types.ModuleType("paddlefleet_ops")
        ops.__doc__ = "test stand-in: tests/formers/family_standins.py"
        ops.is_deep_ep_available = lambda: False
        sys.modules["paddlefleet_ops"] = ops
        installed.append("paddlefleet_ops")
    return installed
