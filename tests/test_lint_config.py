"""The pre-commit hooks and ``nox -s lint`` (what CI runs first) check the same things with the
same tools: a hook that drifts from the noxfile would let a commit pass that CI refuses."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _noxfile_pins():
    tree = ast.parse(open(os.path.join(ROOT, "noxfile.py"), encoding="utf-8").read())
    return {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name) and isinstance(node.value, ast.Constant)
    }


def _hook_pins():
    text = open(os.path.join(ROOT, ".pre-commit-config.yaml"), encoding="utf-8").read()
    return re.findall(r'additional_dependencies: \["([^"]+)"\]', text), text


def test_hooks_use_the_noxfile_pins():
    pins = _noxfile_pins()
    hooks, _ = _hook_pins()
    assert hooks and set(hooks) == {pins["RUFF"], pins["CLANG_FORMAT"]}, (hooks, pins)


def test_hooks_run_what_lint_runs():
    _, text = _hook_pins()
    lint = open(os.path.join(ROOT, "noxfile.py"), encoding="utf-8").read()
    lint = lint[lint.index("def lint(") : lint.index("def format_tree(")]
    for hook, nox_call in (
        ("ruff check", '"ruff", "check"'),
        ("ruff format", '"ruff", "format", "--check"'),
        ("clang-format", '"clang-format", "--dry-run", "--Werror"'),
    ):
        assert f"entry: {hook}" in text, hook
        assert nox_call in lint, nox_call
