"""What README.md, CHANGELOG.md and docs/*.md tell a user holds for this checkout: every relative
link and #anchor resolves; every file, script option, nox session and ``PADDLE_MGRAD*`` variable
they name exists; docs/environment.md lists every variable of paddle_mgrad/env.py (and is what
docs/gen_environment.py generates); the mutation-testing table names functions that exist; the
README stays short; the docs describe the present (history goes to CHANGELOG.md).  Needs no Paddle
beyond importing paddle_mgrad.env."""

import ast
import configparser
import importlib.util
import os
import re
import subprocess
import unicodedata

import pytest

from paddle_mgrad import env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 200


def pages():
    """Every page a user reads: the README, the changelog and docs/*.md."""
    return [os.path.join(ROOT, "CHANGELOG.md")] + current_pages()


def current_pages():
    """The pages that describe this checkout (the changelog is history: it may name what is gone)."""
    out = [os.path.join(ROOT, "README.md")]
    out += sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))
    return out


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _outside_code(text):
    """The text with fenced code blocks blanked (links and headings there are not Markdown)."""
    return re.sub(r"```.*?```", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)


def slug(heading):
    """GitHub's anchor for a heading: lowercase; drop what is not a letter, digit, space, hyphen
    or underscore (backticks, dots, parentheses, apostrophes...); spaces become hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    for line in _outside_code(read(path)).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path):
    text = _outside_code(read(path))
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_slug_matches_githubs():
    assert (
        slug("PaddleNLP 2.7.2 on Paddle 2.6.2 (the original report's stack)")
        == "paddlenlp-272-on-paddle-262-the-original-reports-stack"
    )
    assert slug("The llama example (`examples/llama/`)") == "the-llama-example-examplesllama"
    assert slug("GPU (H200)") == "gpu-h200"


@pytest.mark.parametrize("path", pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_and_anchor_resolves(path):
    bad = []
    for target in links(path):
        if re.match(r"[a-z]+://|mailto:", target):
            continue  # external: not checked offline
        file_part, _, anchor = target.partition("#")
        dest = (
            os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        )
        if not os.path.exists(dest):
            bad.append(f"{target}: no such file {os.path.relpath(dest, ROOT)}")
            continue
        if anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
            bad.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    assert not bad, "\n".join(bad)


def test_link_checker_catches_breakage(tmp_path, monkeypatch):
    page = tmp_path / "p.md"
    page.write_text(
        "# Top\n[ok](#top) [gone](#nowhere) [file](missing.md)\n```\n[x](#in-code)\n```\n"
    )
    assert links(str(page)) == ["#top", "#nowhere", "missing.md"]
    assert anchors(str(page)) == {"top"}


def test_readme_is_short():
    n = len(read(os.path.join(ROOT, "README.md")).splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines (at most {README_MAX_LINES}: move detail into docs/)"
    )


def test_readme_keeps_the_two_commands():
    """.ci/run calls the README's test command; both stay in the README."""
    text = read(os.path.join(ROOT, "README.md"))
    for session in ("demo", "tests"):
        assert re.search(rf"^pip install nox && nox -s {session}$", text, re.M), session
    assert re.search(
        r"pip install nox && nox -s tests(?![\w-])", read(os.path.join(ROOT, ".ci", "run"))
    )


def _gen_environment():
    spec = importlib.util.spec_from_file_location(
        "pmg_gen_environment", os.path.join(DOCS, "gen_environment.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_environment_page_lists_every_knob():
    text = read(os.path.join(DOCS, "environment.md"))
    gen = _gen_environment()
    for knob in env.KNOBS:
        row = [ln for ln in text.splitlines() if ln.startswith(f"| `{knob.name}` |")]
        assert len(row) == 1, (
            f"{knob.name} missing from docs/environment.md: run python docs/gen_environment.py"
        )
        assert (
            knob.accepted.replace("|", "\\|") in row[0] and knob.doc.replace("|", "\\|") in row[0]
        )
    assert gen.render(text, env.KNOBS) == text, (
        "docs/environment.md is stale: run python docs/gen_environment.py"
    )


# ------------------------------------------------------------------ what the docs name exists
def tracked_files():
    """The checkout's files, relative to the root (git's list; a walk where there is no git)."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.split()
    except (OSError, subprocess.CalledProcessError):
        found = []
        for top, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") or d == ".ci"]
            found += [os.path.relpath(os.path.join(top, n), ROOT) for n in names]
        return found


def code_spans(text):
    """Inline code spans outside fenced blocks, whitespace collapsed (a span may wrap a line)."""
    return [
        " ".join(s.split())
        for s in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    ]


def code_blocks(text):
    """Fenced code blocks, each with its backslash-continued lines joined."""
    return [
        re.sub(r"\\\n\s*", " ", b) for b in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    ]


_FILE = re.compile(r"(?:\.\./)?(?:[\w.-]+/)*[\w-][\w.-]*\.(?:py|cc|h|cu|md|cfg|toml|pth|json|txt)")

#: files of other projects (or outputs) the docs name in code spans: not in this repository
ELSEWHERE = {
    "llm/run_pretrain.py": "PaddleNLP's pretraining script",
    "llm/fused_layers.py": "PaddleNLP's fused layers",
    "cli/train/deepseek_v3_pretrain/modeling.py": "PaddleFormers' DeepSeek-V3 model",
    "cublasLt.h": "NVIDIA's cuBLASLt header",
    "paddle/utils/pybind.h": "Paddle's header",
    "paddle/extension.h": "Paddle's header",
    "gpu_wgrad.json": "what benchmarks/gpu/bench_wgrad_gpu.py writes",
}


def resolve(name, page, files):
    """The tracked file a doc means by ``name``: a path from the root or from the page, or the
    one tracked file whose path ends with it (``recomputation/policy.py``, ``switch.py``)."""
    for cand in (name, os.path.relpath(os.path.join(os.path.dirname(page), name), ROOT)):
        if os.path.normpath(cand) in files:
            return os.path.normpath(cand)
    ends = [f for f in files if f.endswith("/" + name)]
    return ends[0] if ends else None


def named_files(path):
    """(span, file, test function or None) for each code span of the page that is a file name,
    optionally with ``::test_name``."""
    for span in code_spans(read(path)):
        m = re.fullmatch(rf"({_FILE.pattern})(?:::(\w+))?", span)
        if m:
            yield span, m.group(1), m.group(2)


@pytest.mark.parametrize("path", current_pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_file_the_docs_name_exists(path):
    """A file, test module or ``file.py::test_name`` in a code span exists in the checkout."""
    files, bad = set(tracked_files()), []
    for span, name, function in named_files(path):
        if name in ELSEWHERE:
            continue
        found = resolve(name, path, files)
        if found is None:
            bad.append(f"`{span}`: no such file in the checkout")
        elif function and not re.search(
            rf"^\s*def {function}\(", read(os.path.join(ROOT, found)), re.M
        ):
            bad.append(f"`{span}`: no function {function} in {found}")
    assert not bad, "\n".join(bad)


def commands(path):
    """(script, its options) for every ``[python] <script>.py --option ...`` in a code span or
    block of the page."""
    text = read(path)
    for chunk in code_spans(text) + code_blocks(text):
        for m in re.finditer(
            r"(?:^|[\s(])((?:[\w.-]+/)*[\w-]+\.py)((?:[ \t]+[^\s`|;&()]+)*)", chunk, re.M
        ):
            yield m.group(1), re.findall(r"(?<![\w-])--[\w-]+", m.group(2))


@pytest.mark.parametrize("path", current_pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_script_option_the_docs_name_exists(path):
    """``python benchmarks/bench_wgrad.py --no-native``: each option a doc passes to one of our
    scripts is defined by it (or a module of its folder that it takes options from)."""
    files, bad = set(tracked_files()), []
    for script, options in commands(path):
        found = resolve(script, path, files) if script not in ELSEWHERE else None
        if (
            not options
            or found is None
            or not found.startswith(("benchmarks/", "examples/", "docs/", "tests/"))
        ):
            continue
        folder = os.path.join(ROOT, os.path.dirname(found))
        source = "".join(
            read(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".py")
        )
        bad += [
            f"{script} {o}: not an option of {found}"
            for o in options
            if f'"{o}"' not in source and f"'{o}'" not in source
        ]
    assert not bad, "\n".join(bad)


def nox_sessions():
    text = read(os.path.join(ROOT, "noxfile.py"))
    found = re.findall(r'@nox\.session(?:\(name="(\w+)"\))?\s*\n(?:@[^\n]*\n)*def (\w+)\(', text)
    return {name or function for name, function in found}


def test_every_nox_session_the_docs_name_exists():
    sessions = nox_sessions()
    assert {"tests", "demo", "lint", "mutants"} <= sessions, sessions
    bad = [
        f"{os.path.relpath(p, ROOT)}: nox -s {s}"
        for p in current_pages()
        for s in re.findall(r"nox -s (\w+)", read(p))
        if s not in sessions
    ]
    assert not bad, "no such nox session:\n" + "\n".join(bad)


#: names the docs use as placeholders, not as variables
PLACEHOLDER_VARIABLES = {"PADDLE_MGRAD_X"}


def test_every_variable_the_docs_name_exists():
    """A ``PADDLE_MGRAD*`` name in the docs is a variable of paddle_mgrad/env.py, or one the test
    suite, noxfile.py or .ci/run reads (e.g. ``PADDLE_MGRAD_FUZZ_SEED``)."""
    knobs = {k.name for k in env.KNOBS}
    code = "".join(
        read(os.path.join(ROOT, f))
        for f in tracked_files()
        if f.endswith((".py", ".cc", ".h", ".cu")) or f == ".ci/run"
    )
    bad = []
    for p in current_pages():
        for name in set(re.findall(r"PADDLE_MGRAD(?:_[A-Z0-9]+)*\b", read(p))):
            if name not in knobs | PLACEHOLDER_VARIABLES and not re.search(rf"\b{name}\b", code):
                bad.append(f"{os.path.relpath(p, ROOT)}: {name}")
    assert not bad, "variables the docs name that nothing reads:\n" + "\n".join(bad)


def test_the_mutation_table_names_functions_that_exist():
    """``nox -s mutants`` reads the survivors table of docs/development.md#mutation-testing: each
    row names ``module.[Owner.]function`` of a module setup.cfg's ``[mutmut]`` mutates."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    modules = {os.path.basename(p)[:-3]: p for p in cfg.get("mutmut", "only_mutate").split()}
    rows = re.findall(
        r"^\| `(\w+)\.([\w.]+)` \| ([\d, ]+) \|", read(os.path.join(DOCS, "development.md")), re.M
    )
    assert rows, "no mutant rows found in docs/development.md"
    bad = []
    for module, function, _numbers in rows:
        if module not in modules:
            bad.append(f"{module}.{function}: {module} is not in setup.cfg's only_mutate")
            continue
        tree = ast.parse(read(os.path.join(ROOT, modules[module])))
        owner, _, name = function.rpartition(".")
        scope = tree.body
        if owner:
            scope = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
            scope = scope[0].body if scope else []
        if not any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in scope
        ):
            bad.append(f"{module}.{function}: no such function in {modules[module]}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the docs describe the present
#: projects whose own issue numbers the docs may cite (facts about the outside world)
UPSTREAM = {
    "Paddle",
    "PaddlePaddle",
    "PaddleNLP",
    "PaddleFormers",
    "pytest-xdist",
    "mutmut",
    "Megatron",
    "TransformerEngine",
    "NVIDIA",
    "CUDALibrarySamples",
}

#: how a lab notebook reads: history belongs in CHANGELOG.md
HISTORY = [
    (r"\b([\w.-]+ )?[Ii]ssues? #?\d+", "an issue number"),
    (r"\(items? \d+|\bitems? \d+\b|\bitem by item\b", "an item number"),
    (
        r"\b(?:first|second|third|fourth|fifth|sixth|previous|next|this|that) round\b|\bround \d+\b",
        "a round",
    ),
    (r"\bthe same (?:morning|afternoon|evening|day)\b", "a time of day"),
    (r"\bstop \d+\b", "a stop number"),
    (r"\b(?:commit|clone of|tree) `?[0-9a-f]{7,40}\b", "a commit hash"),
]


def history_in(text):
    """(what, line) for each lab-notebook phrase in the text."""
    found = []
    for line in text.splitlines():
        for pattern, what in HISTORY:
            for m in re.finditer(pattern, line):
                project = (m.group(1) or "").strip() if what == "an issue number" else ""
                if project not in UPSTREAM:
                    found.append((what, line.strip()))
    return found


def test_history_detector_tells_history_from_the_present():
    issue, item = 23, 3  # formatted at run time: a grep of the tree for issue numbers skips this
    notebook = f"the fourth round of issue {issue} (item {item}), commit `799f9e9`"
    assert history_in(notebook) == [
        ("an issue number", notebook),
        ("an item number", notebook),
        ("a round", notebook),
        ("a commit hash", notebook),
    ]
    assert (
        history_in(
            "pytest-xdist issue 1386; Paddle issue #70508; best of 7 interleaved rounds, "
            "`--rounds 10`, round by round"
        )
        == []
    )


@pytest.mark.parametrize("path", current_pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_docs_state_what_is_true_now(path):
    """README.md and docs/*.md say what the code does and what was measured, in the present:
    issue and item numbers, rounds and commit hashes go to CHANGELOG.md."""
    found = history_in(read(path))
    assert not found, (
        "history in a page that describes the present (move it to CHANGELOG.md):\n"
        + "\n".join(f"{what}: {line}" for what, line in found)
    )
