"""Every Paddle-version or capability fact lives in ``paddle_mgrad/_compat.py``, named.

A module elsewhere that compares Paddle's version, reads ``IS_PADDLE_2``/``PADDLE_VERSION``, or
probes a Paddle module or class for an attribute (``hasattr(_C_ops, ...)``,
``getattr(core.eager.Tensor, ...)``) is making such a decision on its own: this test names it,
so that the fact moves to ``_compat.py`` with its line of why.  Tests, benchmarks and examples
may read ``IS_PADDLE_2`` (``helpers.PADDLE2``) but compare no version and probe no Paddle module
themselves, except the lines listed, each with its reason, in ``EXEMPT_OUTSIDE``.
"""

import ast
import os

import paddle
import pytest

from paddle_mgrad import _compat

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "paddle_mgrad")

# names that mean "which Paddle is this": only _compat.py decides with them
VERSION_NAMES = {"IS_PADDLE_2", "PADDLE_VERSION"}
# what a capability probe asks: Paddle's modules and classes (the root name of the expression)
PADDLE_ROOTS = {"paddle", "_C_ops", "core", "EagerParamBase", "_compat"}


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


def findings(source, path="<source>"):
    """``(line, what)`` for each version decision or capability probe in ``source``: a use of
    ``IS_PADDLE_2``/``PADDLE_VERSION``; Paddle's ``__version__`` compared, or taken apart
    (``.split``, ``.startswith``: a comparison to be); ``hasattr``, or ``getattr`` with a
    default, on Paddle's modules or classes.  (Reading the version for a report or a cache
    key decides nothing.)"""
    tree = ast.parse(source, path)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in VERSION_NAMES:
            found.append((node.lineno, f"uses {node.id}"))
        elif isinstance(node, ast.Attribute) and node.attr in VERSION_NAMES:
            found.append((node.lineno, f"uses {ast.unparse(node)}"))
        elif isinstance(node, ast.ImportFrom) and any(a.name in VERSION_NAMES for a in node.names):
            found.append(
                (
                    node.lineno,
                    "imports " + ", ".join(a.name for a in node.names if a.name in VERSION_NAMES),
                )
            )
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "__version__"
            and _root(node) in PADDLE_ROOTS
        ):
            up = parent.get(node)
            if isinstance(up, ast.Compare) or (
                isinstance(up, ast.Attribute) and up.attr in ("split", "startswith")
            ):
                found.append((node.lineno, f"compares {ast.unparse(node)}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and (node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3))
            and _root(node.args[0]) in PADDLE_ROOTS
        ):
            found.append((node.lineno, f"probes {ast.unparse(node)}"))
    return found


# modules that may ask Paddle directly, and why
EXEMPT = {
    # the doctor reports what Paddle is in a process that has not loaded paddle_mgrad
    os.path.join("paddle_mgrad", "diagnostics", "_doctor_probe.py"),
}


def _modules():
    for base, _, files in os.walk(ROOT):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(base, name)


def test_no_version_decision_outside_compat():
    bad = []
    for path in _modules():
        rel = os.path.relpath(path, os.path.dirname(ROOT))
        if rel == os.path.join("paddle_mgrad", "_compat.py") or rel in EXEMPT:
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        bad += [f"{rel}:{line}: {what}" for line, what in findings(source, path)]
    assert not bad, (
        "version/capability decisions outside paddle_mgrad/_compat.py (name the "
        "fact there, with one line of why, and import it):\n" + "\n".join(bad)
    )


CHECKOUT = os.path.dirname(ROOT)
# outside the package: tests, benchmarks and examples may read IS_PADDLE_2 (helpers.PADDLE2),
# but compare no version and probe no Paddle module themselves (the fact goes to _compat.py)
OUTSIDE = ("tests", "benchmarks", "examples")
# sites outside the package whose subject is the version or the attribute itself, and why:
# {(path, the line as written): why}
EXEMPT_OUTSIDE = {
    (
        os.path.join("tests", "test_compat.py"),
        'two = paddle.__version__.startswith("2.")',
    ): "checks IS_PADDLE_2 and the facts against the version itself",
    (
        os.path.join("tests", "diagnostics", "test_doctor.py"),
        'assert steps["paddle"]["version"] == paddle.__version__',
    ): "the doctor reports this Paddle's version",
    (
        os.path.join("tests", "ops", "test_build.py"),
        'assert info["paddle_version"] == paddle.__version__ and info["cuda"] is _build.with_cuda()',
    ): "a finished build records the Paddle version it was built against",
    (
        os.path.join("tests", "ops", "test_build.py"),
        'assert e["paddle_version"] == paddle.__version__',
    ): "inspect_cache reports the Paddle version a build records",
    (
        os.path.join("tests", "fleet", "test_c_ops.py"),
        'assert not hasattr(paddle._C_ops, "fused_linear_param_grad_add")',
    ): "disable() deletes the attribute that enable() added to a Paddle without it",
    (
        os.path.join("tests", "fleet", "launch", "cpu_dualpipev_standins.py"),
        'if not hasattr(core.ProcessGroupGloo, "get_stream"):',
    ): "a test-only stand-in for what Paddle's CPU gloo group lacks, never replacing Paddle's own",
}


def _outside_modules():
    for name in sorted(os.listdir(CHECKOUT)):  # setup.py, noxfile.py, ...
        if name.endswith(".py"):
            yield os.path.join(CHECKOUT, name)
    for top in OUTSIDE:
        for base, dirs, files in os.walk(os.path.join(CHECKOUT, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.join(base, name)


def outside_findings(paths):
    """``{(path, line as written): [where, ...]}`` for each version comparison or Paddle probe
    in ``paths`` (relative to the checkout)."""
    found = {}
    for path in paths:
        rel = os.path.relpath(path, CHECKOUT)
        with open(path, encoding="utf-8") as f:
            source = f.read()
        lines = source.splitlines()
        for line, what in findings(source, path):
            if what.startswith(("compares ", "probes ")):
                key = (rel, lines[line - 1].strip())
                found.setdefault(key, []).append(f"{rel}:{line}: {what}")
    return found


def test_no_version_decision_in_tests_benchmarks_or_examples():
    """Outside the package too, a version or capability decision reads a named fact
    (``helpers.PADDLE2``, ``paddle_mgrad._compat``); the sites whose subject is the version or
    the attribute itself are listed in EXEMPT_OUTSIDE, each with its reason."""
    found = outside_findings(_outside_modules())
    bad = sorted(w for key, where in found.items() if key not in EXEMPT_OUTSIDE for w in where)
    assert not bad, (
        "version comparisons / Paddle probes outside paddle_mgrad/ (use helpers.PADDLE2 or a "
        "named fact of paddle_mgrad/_compat.py, adding one there with its line of why; or, "
        "where the version itself is the subject, list the line in EXEMPT_OUTSIDE):\n"
        + "\n".join(bad)
    )
    stale = sorted(f"{path}: {line}" for path, line in EXEMPT_OUTSIDE if (path, line) not in found)
    assert not stale, "EXEMPT_OUTSIDE lists lines that are gone:\n" + "\n".join(stale)


def test_the_outside_check_sees_a_new_comparison(tmp_path):
    """A test file that decides on the version itself is named, even in a file that has an
    exempt line; reading the named fact is not."""
    exempt = os.path.join(CHECKOUT, "tests", "diagnostics", "test_doctor.py")
    with open(exempt, encoding="utf-8") as f:
        source = f.read()
    bad = tmp_path / "test_doctor.py"
    bad.write_text(source + '\nOLD = paddle.__version__.startswith("2.")\n')
    good = tmp_path / "test_ok.py"
    good.write_text("from helpers import PADDLE2\nOLD = PADDLE2\n")
    found = outside_findings([str(bad), str(good)])
    assert [line for _, line in found] == [
        'assert steps["paddle"]["version"] == paddle.__version__',
        'OLD = paddle.__version__.startswith("2.")',
    ]


@pytest.mark.parametrize(
    "source, what",
    [
        (
            "from paddle_mgrad._compat import IS_PADDLE_2\nx = 1 if IS_PADDLE_2 else 2",
            "uses IS_PADDLE_2",
        ),
        ("from .._compat import PADDLE_VERSION", "imports PADDLE_VERSION"),
        ("from . import _compat\nx = _compat.IS_PADDLE_2", "uses _compat.IS_PADDLE_2"),
        ("import paddle\nold = paddle.__version__ < '3'", "compares paddle.__version__"),
        ("import paddle\nold = paddle.__version__.startswith('2.')", "compares paddle.__version__"),
        (
            "from paddle import _C_ops\nok = hasattr(_C_ops, 'fused_linear_param_grad_add')",
            "probes hasattr(_C_ops, 'fused_linear_param_grad_add')",
        ),
        (
            "ok = hasattr(core.eager.Tensor, '_new_shared_tensor')",
            "probes hasattr(core.eager.Tensor, '_new_shared_tensor')",
        ),
        (
            "run = getattr(paddle.framework.core.eager, '_run_custom_op', None)",
            "probes getattr(paddle.framework.core.eager, '_run_custom_op', None)",
        ),
    ],
)
def test_the_check_sees_each_kind_of_decision(source, what):
    assert what in [w for _, w in findings(source)]


def test_ordinary_code_is_no_decision():
    source = (
        "import paddle\n"
        "def f(t, ctx):\n"
        "    y = paddle.matmul(t, t)\n"
        "    g = getattr(ctx, 'facts', None)\n"
        "    d = getattr(paddle, 'float32')\n"
        "    key = paddle.__version__ + str(d)\n"
        "    return hasattr(t, 'main_grad') and y\n"
    )
    assert findings(source) == []


def test_the_facts_hold_on_this_paddle():
    """Each named fact agrees with what this Paddle does (the reasons are in _compat.py)."""
    two = paddle.__version__.startswith("2.")
    assert _compat.IS_PADDLE_2 is two
    t = paddle.ones([2])
    assert _compat.HAS_SHARED_TENSOR_COPY is hasattr(t, "_new_shared_tensor")
    if _compat.HAS_SHARED_TENSOR_COPY:  # the copy shares the inplace version counter
        s = t._new_shared_tensor()
        t.scale_(2.0)
        assert s._inplace_version() == t._inplace_version() == 1
    assert hasattr(t, "__dict__") is not two  # 2.6's plain tensors: no Python attributes
    assert getattr(t, "__dict__", _compat.NO_ATTRS).get("main_grad") is None
    assert _compat.MAIN_GRAD_IN_DICT
    assert _compat.run_custom_op() is not None
    assert _compat.LINEAR_IS_C_OP is (two or not paddle.is_compiled_with_cuda())
    if _compat.PADDLE_COMMIT:
        assert _compat.PADDLE_COMMIT == paddle.version.commit
    if _compat.HOST_MEMORY_RESET_PEAK is not None:  # the peak drops to what is held now
        now, peak = _compat.HOST_MEMORY_STATS
        big = paddle.ones([256, 1024])
        del big
        assert peak("Allocated", 0) > now("Allocated", 0)
        _compat.HOST_MEMORY_RESET_PEAK("Allocated", 0)
        assert peak("Allocated", 0) == now("Allocated", 0)
