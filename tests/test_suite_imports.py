"""No Python file under tests/ imports a ``conftest`` module.  pytest imports every
``conftest.py`` under the one name ``conftest`` (tests/ has no packages), so ``from conftest
import X`` gets whichever conftest was loaded last -- tests/nlp's shadows tests/' in a plain
``pytest`` run.  Names test modules share live in helpers.py.  And a bare ``pytest`` collects
``tests/`` alone (setup.cfg's ``testpaths``), not the copy of the tests that ``nox -s mutants``
leaves in ``mutants/``."""

import ast
import os
import shutil
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def conftest_imports(path):
    """``(line, statement)`` for each import of a ``conftest`` module in the file at ``path``
    (module level or inside a function)."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n == "conftest" or n.startswith("conftest.") for n in names):
            found.append((node.lineno, ast.get_source_segment(source, node)))
    return sorted(found)


def _python_files(root):
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def test_no_file_under_tests_imports_a_conftest():
    files = list(_python_files(TESTS))
    assert os.path.join(TESTS, "conftest.py") in files and len(files) > 50  # the scan saw the tree
    offenders = [
        f"{os.path.relpath(path, TESTS)}:{line}: {stmt}"
        for path in files
        for line, stmt in conftest_imports(path)
    ]
    assert not offenders, "import from helpers.py instead:\n" + "\n".join(offenders)


def test_scan_finds_every_form_of_conftest_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os\nfrom conftest import PADDLE2\n\n\ndef f():\n"
        "    import conftest\n    from conftest import (ROOT,\n        TESTS)\n"
        "import conftest as c, sys\n"
    )
    assert [line for line, _ in conftest_imports(str(bad))] == [2, 6, 7, 9]
    good = tmp_path / "good.py"
    good.write_text(
        "from helpers import PADDLE2\nimport conftest_like\nx = 'from conftest import PADDLE2'\n"
    )
    assert conftest_imports(str(good)) == []


@pytest.mark.probe
def test_a_bare_pytest_collects_tests_alone(tmp_path):
    # the checkout's pytest configuration in a tree of its own: a test under tests/, one under
    # mutants/tests/ (as mutmut leaves it) and one at the top; the bare run may see the first only
    shutil.copy(os.path.join(ROOT, "setup.cfg"), tmp_path / "setup.cfg")
    for folder in ("tests", "mutants/tests", "."):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        name = "test_" + folder.replace("/", "_").strip(".") + "here.py"
        (tmp_path / folder / name).write_text("def test_it():\n    pass\n")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    collected = sorted(line for line in r.stdout.splitlines() if "::" in line)
    assert collected == ["tests/test_testshere.py::test_it"], r.stdout
