"""Test-only evidence collector for tests/formers (put on PYTHONPATH by test_paddleformers.py;
never part of the package).  The same collector as tests/nlp/evidence/sitecustomize.py (loaded
from there, not copied), hooked on PaddleFormers' Trainer instead of PaddleNLP's:

* ``PMG_TEST_PTH_DIR``: process that directory as a site dir, so its copy of
  ``paddle_mgrad_autoload.pth`` runs as site-packages' would, at interpreter start.
* ``PMG_TEST_AUDIT_DIR``: when ``paddleformers.trainer.trainer`` is imported, wrap
  ``Trainer.train`` to attach ``paddle_mgrad.diagnostics.audit.MainGradAudit`` and write ``audit.<rank>.json``.
Imports nothing heavy at start: no paddle.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "pmg_test_nlp_evidence",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "nlp",
        "evidence",
        "sitecustomize.py",
    ),
)
_nlp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_nlp)  # runs the .pth (PMG_TEST_PTH_DIR); its PaddleNLP hook stays idle

if os.environ.get("PMG_TEST_AUDIT_DIR"):
    _nlp._after_import("paddleformers.trainer.trainer", _nlp._instrument)
