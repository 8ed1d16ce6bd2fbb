"""Test-only evidence collector for scripts run unmodified (put on PYTHONPATH by
tests/nlp/test_paddlenlp_llm.py; never part of the package).

* ``PMG_TEST_PTH_DIR``: where paddle_mgrad is not pip-installed (tests run from a source
  tree), process that directory as a site dir so its copy of ``paddle_mgrad_autoload.pth``
  runs exactly as site-packages' would, at interpreter start.
* ``PMG_TEST_AUDIT_DIR``: when PaddleNLP's ``Trainer`` is imported, wrap ``Trainer.train``
  to attach ``paddle_mgrad.diagnostics.audit.MainGradAudit`` to the model and write, per process,
  ``audit.<rank>.json``: the audit, paddle_mgrad's counters and what is installed.
* ``PMG_TEST_PADDLENLP_CPU_SYNC_STANDIN``: when PaddleNLP's trainer module is imported, apply
  tests/nlp/cpu_nlp_standins.py's stand-in (PaddleNLP 2.7.x on CPU).
* ``PMG_TEST_FLEET_CPU_STANDINS``: when PaddleNLP's trainer module is imported (before the
  script parses its arguments, i.e. before fleet.init), install
  tests/fleet/launch/cpu_fleet_standins.py (gloo transport for fleet hybrid parallel on CPU);
  the audit then also records how often each stand-in ran.
Imports nothing heavy at start: no paddle.
"""

import os
import sys

_pth_dir = os.environ.get("PMG_TEST_PTH_DIR")
if _pth_dir and "paddle_mgrad_autoload" not in sys.modules:
    import site

    site.addsitedir(_pth_dir)


def _after_import(module_name, callback):
    """Call ``callback(module)`` once ``module_name`` has been executed."""

    class Hook:
        def find_spec(self, name, path=None, target=None):
            if name != module_name:
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = spec.loader
            exec_module = loader.exec_module

            def run(module):
                try:
                    exec_module(module)
                finally:
                    del loader.exec_module
                callback(module)

            loader.exec_module = run
            return spec

    sys.meta_path.insert(0, Hook())


def _instrument(trainer_module):
    import json

    Trainer = trainer_module.Trainer
    train = Trainer.train

    def train_with_audit(self, *args, **kwargs):
        import paddle

        from paddle_mgrad import registry, stats
        from paddle_mgrad.diagnostics.audit import MainGradAudit

        audit = MainGradAudit(self.model)
        before = stats.snapshot()
        try:
            return train(self, *args, **kwargs)
        finally:
            after = stats.snapshot()
            out = {
                "rank": int(os.environ.get("PADDLE_TRAINER_ID", "0")),
                "audit": audit.summary(),
                "recompute": {
                    k: after["recompute"][k] - before["recompute"][k] for k in after["recompute"]
                },
                "linear": {k: after["linear"][k] - before["linear"][k] for k in after["linear"]},
                "policy": {
                    name: {
                        k: n - before["policy"].get(name, {}).get(k, 0) for k, n in counters.items()
                    }
                    for name, counters in after["policy"].items()
                },
                "plans": after["plans"],
                "paddle_c_ops": {
                    k: after["paddle_c_ops"][k] - before["paddle_c_ops"][k]
                    for k in after["paddle_c_ops"]
                },
                "installed": registry.installed_keys(),
                "F_linear_is_paddle_function": paddle.nn.functional.linear
                is paddle.nn.functional.common.linear,
                "main_grad_dtypes": sorted(
                    {
                        str(p.main_grad.dtype)
                        for p in self.model.parameters()
                        if getattr(p, "main_grad", None) is not None
                    }
                ),
                "paddle_mgrad_file": sys.modules["paddle_mgrad"].__file__,
                "model_class": type(self.model).__name__,
                "layer_types": sorted({type(layer).__name__ for layer in self.model.sublayers()}),
            }
            standins = sys.modules.get("pmg_test_cpu_fleet_standins")
            if standins is not None:
                out["fleet_standins"] = dict(standins.CALLS)
            d = os.environ["PMG_TEST_AUDIT_DIR"]
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"audit.{out['rank']}.json"), "w") as f:
                json.dump(out, f, indent=1, default=str)

    Trainer.train = train_with_audit


def _standin(_trainer_module):
    import importlib.util

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cpu_nlp_standins.py"
    )
    spec = importlib.util.spec_from_file_location("pmg_test_cpu_nlp_standins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.paddlenlp27_cpu_synchronize_standin()


def _fleet_standins(_trainer_module):
    import importlib.util

    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(tests, "fleet", "launch", "cpu_fleet_standins.py")
    spec = importlib.util.spec_from_file_location("pmg_test_cpu_fleet_standins", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.install()


def _on_trainer_import(trainer_module):
    # one import hook per module (two would both wrap and unwrap the same loader)
    if os.environ.get("PMG_TEST_PADDLENLP_CPU_SYNC_STANDIN") == "1":
        _standin(trainer_module)
    if os.environ.get("PMG_TEST_FLEET_CPU_STANDINS") == "1":
        _fleet_standins(trainer_module)
    if os.environ.get("PMG_TEST_AUDIT_DIR"):
        _instrument(trainer_module)


if (
    os.environ.get("PMG_TEST_AUDIT_DIR")
    or os.environ.get("PMG_TEST_PADDLENLP_CPU_SYNC_STANDIN") == "1"
    or os.environ.get("PMG_TEST_FLEET_CPU_STANDINS") == "1"
):
    _after_import("paddlenlp.trainer.trainer", _on_trainer_import)
