"""PADDLE_MGRAD: the .pth switch installed by pip -- parsing, laziness, zlib order, bad values,
the one log line, the exit report, and that pip really puts the .pth into site-packages.

Subprocesses start with ``paddle_mgrad_autoload.pth`` processed at interpreter start: the
installed one where paddle_mgrad is pip-installed, else a copy in a directory that the test
sitecustomize (tests/nlp/evidence) hands to ``site.addsitedir`` -- the same code path.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from helpers import PADDLE2, pip_install_target
from paddle_mgrad import FlagError
from paddle_mgrad.switch import parse_activation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = os.path.join(ROOT, "paddle_mgrad_autoload.pth")
EVIDENCE = os.path.join(ROOT, "tests", "nlp", "evidence")


def activation_lines(text):
    """paddle_mgrad's activation lines ("[rank N] " prefix allowed), not the first-build log."""
    return [ln for ln in text.splitlines() if re.match(r"(\[rank \d+\] )?paddle_mgrad: ", ln)]


def run_py(code, tmp_path, pythonpath=ROOT, pth_dir=None, **env_extra):
    """Run ``python -c code`` in a fresh interpreter whose startup processes the .pth."""
    if pth_dir is None:
        pth_dir = tmp_path / "site"
        pth_dir.mkdir(exist_ok=True)
        shutil.copy(PTH, pth_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_MGRAD")}
    env.update(
        PYTHONPATH=os.pathsep.join([EVIDENCE, str(pythonpath)]),
        PMG_TEST_PTH_DIR=str(pth_dir),
        PADDLE_MGRAD_CACHE=os.environ.get("PADDLE_MGRAD_CACHE", ""),
        **env_extra,
    )
    if not env["PADDLE_MGRAD_CACHE"]:
        del env["PADDLE_MGRAD_CACHE"]
    if isinstance(code, tuple):
        code = "\n".join(textwrap.dedent(c) for c in code)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=str(tmp_path),
    )


STATE = """
    import json, sys
    def state():
        return {"paddle": "paddle" in sys.modules, "paddle_mgrad": "paddle_mgrad" in sys.modules,
                "autoload": "paddle_mgrad_autoload" in sys.modules,
                "hook": any(type(f).__name__ == "_PaddleImportHook" for f in sys.meta_path)}
"""


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, (False, False)),
        ("", (False, False)),
        ("0", (False, False)),
        (" 0 ", (False, False)),
        ("recompute", (True, False)),
        ("fused_linear", (False, True)),
        ("recompute,fused_linear", (True, True)),
        ("Fused_Linear , recompute", (True, True)),
        ("all", (True, True)),
        ("ALL", (True, True)),
    ],
)
def test_parse_activation(value, expected):
    got = parse_activation(value)
    assert (got["recompute"], got["fused_linear"]) == expected


@pytest.mark.parametrize("value", ["1", "yes", "recompute,", "recompute;fused_linear", "fused"])
def test_parse_activation_rejects_with_one_line(value):
    with pytest.raises(FlagError) as e:
        parse_activation(value)
    msg = str(e.value)
    assert (
        "\n" not in msg and "recompute, fused_linear" in msg and "all" in msg and "0/empty" in msg
    )


@pytest.mark.probe
@pytest.mark.parametrize("value", [None, "", "0"])
def test_unset_imports_nothing(tmp_path, value):
    extra = {} if value is None else {"PADDLE_MGRAD": value}
    r = run_py((STATE, "print(json.dumps(state()))"), tmp_path, **extra)
    assert r.returncode == 0, r.stderr
    # the .pth ran (its module is loaded) and did nothing else: no paddle, no hook
    assert json.loads(r.stdout) == {
        "paddle": False,
        "paddle_mgrad": False,
        "autoload": True,
        "hook": False,
    }
    assert "paddle_mgrad" not in r.stderr


@pytest.mark.probe
def test_all_enables_at_first_paddle_import(tmp_path):
    r = run_py(
        (
            STATE,
            """
        order = []  # imports in the order they start; paddle's body starts with its submodules
        sys.addaudithook(lambda ev, args: order.append(args[0]) if ev == "import" else None)
        before = state()
        import paddle
        import paddle_mgrad
        from paddle_mgrad import registry
        first_sub = next(i for i, m in enumerate(order) if m.startswith("paddle."))
        print(json.dumps({"before": before, "after": state(), "enabled": paddle_mgrad.enabled(),
                          "c_ops": registry.is_installed("_C_ops.fused_linear_param_grad_add"),
                          "zlib_first": "zlib" in order[:first_sub]}))
    """,
        ),
        tmp_path,
        PADDLE_MGRAD="all",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["before"] == {"paddle": False, "paddle_mgrad": False, "autoload": True, "hook": True}
    assert out["after"] == {"paddle": True, "paddle_mgrad": True, "autoload": True, "hook": False}
    assert out["enabled"] == {"recompute": True, "fused_linear": True}
    assert out["c_ops"] and out["zlib_first"]
    lines = activation_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("paddle_mgrad: recompute, fused_linear on (op: ")
    assert lines[0].endswith(") via PADDLE_MGRAD")


@pytest.mark.probe
def test_import_paddle_mgrad_before_paddle(tmp_path):
    """paddle_mgrad's own __init__ imports paddle: activation waits until the package is whole."""
    r = run_py(
        """
        import paddle_mgrad
        from paddle_mgrad import registry
        print(paddle_mgrad.enabled(), registry.is_installed("_C_ops.fused_linear_param_grad_add"))
    """,
        tmp_path,
        PADDLE_MGRAD="all",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "{'recompute': True, 'fused_linear': True} True" in r.stdout
    assert len(activation_lines(r.stderr)) == 1, r.stderr


@pytest.mark.probe
def test_one_feature_and_rank_prefix(tmp_path):
    r = run_py(
        """
        import paddle, paddle_mgrad
        print(paddle_mgrad.enabled())
    """,
        tmp_path,
        PADDLE_MGRAD="recompute",
        PADDLE_TRAINER_ID="1",
    )
    assert r.returncode == 0, r.stderr
    assert "{'recompute': True, 'fused_linear': False}" in r.stdout
    lines = activation_lines(r.stderr)
    assert lines == ["[rank 1] paddle_mgrad: recompute on via PADDLE_MGRAD"]


ZLIB_AFTER_PADDLE = """
    import paddle, zlib
    assert zlib.decompress(zlib.compress(b"paddle" * 1000)) == b"paddle" * 1000
    print("zlib ok")
"""


@pytest.mark.probe
def test_zlib_after_paddle_works_with_the_switch(tmp_path):
    """Paddle 2.6 crashes when zlib is used after `import paddle` (its libpaddle exports
    zlib's symbols); with PADDLE_MGRAD set, zlib is imported first."""
    r = run_py(ZLIB_AFTER_PADDLE, tmp_path, PADDLE_MGRAD="recompute")
    assert r.returncode == 0 and "zlib ok" in r.stdout, r.stderr[-2000:]
    # The crash the switch removes: zlib's extension module, loaded after libpaddle, binds to the
    # zlib symbols libpaddle exports.  A Python with zlib built in (Debian's /usr/bin/python3)
    # loads nothing then and never had the crash: no control run there.
    if PADDLE2 and "zlib" not in sys.builtin_module_names:
        r = run_py(ZLIB_AFTER_PADDLE, tmp_path)
        assert r.returncode != 0 and "zlib ok" not in r.stdout


@pytest.mark.probe
def test_bad_value_is_one_line_and_exit_2_at_first_paddle_import(tmp_path):
    code = """
        print("before paddle", flush=True)
        import paddle
        print("after paddle")
    """
    r = run_py(code, tmp_path, PADDLE_MGRAD="recompute,bogus")
    assert r.returncode == 2
    assert r.stdout.split() == ["before", "paddle"]
    lines = [ln for ln in r.stderr.splitlines() if "paddle_mgrad" in ln or "Traceback" in ln]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("paddle_mgrad: error: PADDLE_MGRAD='recompute,bogus'")
    assert "'bogus'" in lines[0] and "recompute, fused_linear" in lines[0]
    # processes that never import paddle (pip, tools) are not affected
    r = run_py("print('no paddle')", tmp_path, PADDLE_MGRAD="bogus")
    assert r.returncode == 0 and r.stdout.strip() == "no paddle"


@pytest.mark.probe
def test_report_at_exit(tmp_path):
    report = tmp_path / "report"
    r = run_py(
        """
        import paddle
        from paddle.distributed.fleet.utils import recompute
        x = paddle.randn([4]); x.stop_gradient = False
        recompute(paddle.tanh, x, use_reentrant=False).sum().backward()
    """,
        tmp_path,
        PADDLE_MGRAD="recompute",
        PADDLE_MGRAD_REPORT=str(report),
    )
    assert r.returncode == 0, r.stderr
    (name,) = os.listdir(report)
    data = json.load(open(report / name))
    assert data["PADDLE_MGRAD"] == "recompute"
    assert data["active"]["recompute"] is True and data["active"]["fused_linear"] is False
    assert data["recompute"]["non_reentrant"] == 1 and data["recompute"]["recomputations"] == 1


@pytest.mark.probe
def test_pip_install_puts_the_pth_into_site_packages(tmp_path):
    """`pip install --no-build-isolation .` (as noxfile does) and the wheel (`pip install .`):
    the .pth and the module it imports land at the top of site-packages."""
    src = tmp_path / "src"  # a clean copy: no build/ left over from earlier builds
    src.mkdir()
    for name in (
        "setup.py",
        "MANIFEST.in",
        "README.md",
        "paddle_mgrad_autoload.py",
        "paddle_mgrad_autoload.pth",
    ):
        shutil.copy(os.path.join(ROOT, name), src)
    for name in ("paddle_mgrad", "csrc"):
        shutil.copytree(
            os.path.join(ROOT, name),
            src / name,
            ignore=shutil.ignore_patterns("__pycache__", "_prebuilt"),
        )
    target = tmp_path / "site-packages"
    pip_install_target(src, target, timeout=600)
    assert (
        target / "paddle_mgrad_autoload.pth"
    ).read_text().strip() == "import paddle_mgrad_autoload"
    assert (target / "paddle_mgrad_autoload.py").exists()
    # the installed copy switches paddle_mgrad on (PYTHONPATH: only the install target)
    r2 = run_py(
        "import paddle, paddle_mgrad; print(paddle_mgrad.__file__, paddle_mgrad.enabled())",
        tmp_path,
        pythonpath=target,
        pth_dir=target,
        PADDLE_MGRAD="recompute",
    )
    assert r2.returncode == 0, r2.stderr
    assert str(target) in r2.stdout and "'recompute': True" in r2.stdout

    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            str(wheels),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = wheels.iterdir()
    names = zipfile.ZipFile(whl).namelist()
    assert "paddle_mgrad_autoload.pth" in names and "paddle_mgrad_autoload.py" in names
