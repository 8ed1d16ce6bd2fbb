"""Test matrix: each Paddle version in its own virtualenv with its pins.

    pip install nox && nox -s tests      # the test suite on Paddle 3.3.1 and 2.6.2 (in-process)
    nox -s probes                        # the tests that start a process (builds, crash probes)
    pip install nox && nox -s demo       # the main job (llama example) on Paddle 3.3.1
    nox -s gpu_wheel                     # paddlepaddle-gpu 2.6.2: our CUDA op JIT-built (no GPU needed)
    nox -s cuda_compile                  # nvcc-compile + link the Paddle-free CUDA core
    nox -s fleet                         # tests/fleet/launch: 2-rank fleet hybrid parallel (TP/SP/sharding/PP)
    nox -s nlp_fleet                     # nlp + fleet/launch in one venv per Paddle version (CI)
    nox -s formers                       # PaddleFormers 1.2.0's Trainer (Paddle 3.3.1)
    nox -s nlp272                        # tests/nlp on Paddle 2.6.2 + PaddleNLP 2.7.2 (the report's stack)
    nox -s lint                          # ruff check + ruff format --check + clang-format (pinned), seconds
    nox -s format                        # ruff format the tree (not run by CI; docs/development.md)
    nox -s mutants                       # mutmut over the gradient core (not run by CI; hours)

pip keeps its download cache (~/.cache/pip, or $PIP_CACHE_DIR) between runs; venvs are reused.
With PADDLE_MGRAD_NOX_FREE_VENVS=1 (what .ci/run sets) each session deletes its virtualenv when
it succeeds, so the disk holds one at a time (all of them together take ~15 GB).
"""

import configparser
import functools
import glob
import os
import re
import shutil

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PADDLE_PINS = {
    "3.3.1": ["paddlepaddle==3.3.1"],
    # 2.6.2 wants numpy<2; fleet needs protobuf<5 ("hybrid_configs is not a attribute")
    "2.6.2": ["paddlepaddle==2.6.2", "numpy<2", "protobuf<5"],
}
NLP_PINS = [
    "paddlenlp==2.8.1",
    "aistudio-sdk==0.1.7",
    "huggingface_hub<0.26",
    "datasets<3",
    "pyarrow<19",
    "tqdm",
]
# The original report's stack: PaddleNLP 2.7.2 needs the same pins as 2.8.1 to import.
NLP272_PINS = ["paddlenlp==2.7.2"] + NLP_PINS[1:]
NLP272_TESTS = [
    "tests/nlp/test_llama_example.py",
    "tests/nlp/test_paddlenlp_llm.py",
    "tests/nlp/test_paddlenlp_cpu_gap.py",
]
# PaddleFormers 1.2.0 resolves datasets 5.x -> pyarrow>=24 (numpy>=2), while its fast_dataindex
# pins numpy<=1.26.4: "pyarrow requires NumPy 2.0 or newer" at import.  These make it import.
FORMERS_PINS = ["paddleformers==1.2.0", "datasets>=3,<4", "pyarrow<19"]
TEST_DEPS = ["pytest>=7", "hypothesis>=6", "pytest-xdist>=3.2", "wheel", "setuptools"]


def _workers():
    """pytest-xdist workers: the CPUs this process may use (2 on the CI box), at most 4 (each
    worker imports Paddle, ~1 GB), or $PADDLE_MGRAD_TEST_WORKERS (0: no xdist)."""
    wanted = os.environ.get("PADDLE_MGRAD_TEST_WORKERS")
    if wanted:
        return wanted
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return str(min(max(cpus, 1), 4))


# Every pytest session runs on all cores: worksteal lets an idle worker take the tail of a busy
# one's queue (tests run from seconds to a minute); tests/conftest.py orders the long ones first
# and gives every worker its own op cache.  ``nox -s tests -- -n 0`` (or
# PADDLE_MGRAD_TEST_WORKERS=0) runs in one process.
XDIST = ["-n", _workers(), "--dist", "worksteal"] if _workers() != "0" else []
PYTEST = ["pytest", "-q", "-p", "no:cacheprovider"]
# Mutation testing (``nox -s mutants``), pinned: mutmut's mutation operators change between
# releases, and with them the survivors docs/development.md lists as equivalent.
MUTMUT = "mutmut==3.8.1"
# The linter/formatter, pinned: a new ruff release may add findings to a tree that was green.
RUFF = "ruff==0.17.6"
# The C++/CUDA formatter (csrc/, style in .clang-format), pinned for the same reason.
CLANG_FORMAT = "clang-format==23.1.5"
# What clang-format formats: the op's sources.
CSRC_GLOBS = ("csrc/*.cc", "csrc/*.h", "csrc/*.cu")
# Equal thread counts everywhere (Paddle forces 1 at import unless set).
ENV = {
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    "PADDLE_MGRAD_CACHE": os.path.join(os.path.dirname(__file__), ".nox", "op-cache"),
}


def _installing_only(session):
    """Whether this is ``nox --install-only`` (the venv is built, ``session.run`` is skipped):
    what ``.ci/run`` does for the next session while the current one's tests use the CPUs."""
    config = getattr(getattr(session, "_runner", None), "global_config", None)
    return bool(getattr(config, "install_only", False))


def _frees_venv(fn):
    """A session that deletes its virtualenv after it succeeds when PADDLE_MGRAD_NOX_FREE_VENVS=1
    (not under ``--install-only``: that venv is built to be used next).

    Why: CI machines share a disk whose free space varies (a run died with "No space left on
    device" after ~3 GB); the largest venv (paddlepaddle-gpu + cuBLAS) is ~3.7 GB, all of them
    ~15 GB.  A failed session keeps its venv for inspection (CI stops there anyway)."""

    @functools.wraps(fn)
    def run(session, *args, **kwargs):
        fn(session, *args, **kwargs)
        if os.environ.get("PADDLE_MGRAD_NOX_FREE_VENVS") == "1" and not _installing_only(session):
            location = getattr(session.virtualenv, "location", None)
            if location and os.path.isdir(location):
                session.log(f"freeing {location}")
                shutil.rmtree(location, ignore_errors=True)

    return run


def _install(session, paddle_version, extra=()):
    session.install(*PADDLE_PINS[paddle_version], *TEST_DEPS, *extra)
    # Not editable: the tests run against the installed package (csrc shipped inside).
    session.install("--no-build-isolation", ".")


@nox.session
@_frees_venv
def lint(session):
    """The checks of .pre-commit-config.yaml over the whole tree (no Paddle needed): ruff check
    with the rules of ruff.toml, ruff format --check, clang-format --dry-run on csrc/."""
    session.install(RUFF, CLANG_FORMAT)
    session.run("ruff", "--version")
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")
    session.run("clang-format", "--version")
    session.run("clang-format", "--dry-run", "--Werror", *_csrc_files())


@nox.session(name="format")
def format_tree(session):
    """ruff format and clang-format, in place: what ``nox -s lint`` then finds clean."""
    session.install(RUFF, CLANG_FORMAT)
    session.run("ruff", "format", ".")
    session.run("clang-format", "-i", *_csrc_files())


def _csrc_files():
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(f for g in CSRC_GLOBS for f in glob.glob(os.path.join(here, g)))


@nox.session
@_frees_venv
def mutants(session):
    """mutmut over the modules that decide gradients, against their fast tests (what is mutated
    and which tests run: setup.cfg's [mutmut]), Paddle 3.3.1; then the survivors.  Arguments
    select mutants: ``nox -s mutants -- "paddle_mgrad.recomputation.policy*"``.  Results are
    kept in mutants/ and a rerun tests only the functions that changed; delete mutants/ for a
    fresh run.  Not in .ci/run (docs/development.md#mutation-testing)."""
    session.install(*PADDLE_PINS["3.3.1"], *TEST_DEPS, MUTMUT)
    # paddle_mgrad is not installed: mutmut puts mutants/ first on sys.path, where the tests
    # import it from (and the crash probes' subprocesses, through tests/helpers.py's ROOT).
    # One thread: mutmut forks a worker per mutant from a process that ran Paddle, and an
    # OpenMP pool does not survive a fork.  One worker: a mutant's tests take seconds, and the
    # machine's other cores stay free.
    env = dict(ENV, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    session.run("mutmut", "run", "--max-children", "1", *session.posargs, env=env)
    results = session.run("mutmut", "results", env=env, silent=True) or ""
    if _installing_only(session):
        return
    session.log(results)
    root = os.path.dirname(os.path.abspath(__file__))
    mutated = configparser.ConfigParser()
    mutated.read(os.path.join(root, "setup.cfg"))
    modules = {
        os.path.basename(path)[:-3]: path[:-3].replace("/", ".")
        for path in mutated.get("mutmut", "only_mutate").split()
    }
    with open(os.path.join(root, "docs", "development.md"), encoding="utf-8") as f:
        explained = _explained_mutants(f.read(), modules)
    unexplained = [
        line.strip()
        for line in results.splitlines()
        if ": " in line and line.split(":")[0].strip() not in explained
    ]
    if unexplained:
        session.error(
            "mutants that no test kills and docs/development.md#mutation-testing does "
            "not explain (kill each with a test, or add its line there):\n" + "\n".join(unexplained)
        )


def _explained_mutants(doc, modules):
    """The mutant names the table of docs/development.md#mutation-testing lists, one row per
    function: ``| `recomputing.KeptOutputs.__init__` | 5, 6 | why |`` stands for mutmut's
    ``paddle_mgrad.autograd.recomputing.xǁKeptOutputsǁ__init____mutmut_5`` and ``_6``
    (``modules``: a mutated module's dotted name by its file's name)."""
    names = set()
    for row in re.findall(r"^\| `(\w+)\.([\w.]+)` \| ([\d, ]+) \|", doc, re.M):
        module, function, numbers = row
        owner, _, name = function.rpartition(".")
        mangled = f"xǁ{owner}ǁ{name}" if owner else f"x_{name}"
        names.update(f"{modules[module]}.{mangled}__mutmut_{n.strip()}" for n in numbers.split(","))
    return names


# The unit suite: tests/ without the families that need PaddleNLP, PaddleFormers or 2 ranks.
UNIT_TESTS = [
    "tests",
    "--ignore=tests/nlp",
    "--ignore=tests/fleet/launch",
    "--ignore=tests/formers",
]


@nox.session
@nox.parametrize("paddle", list(PADDLE_PINS))
@_frees_venv
def tests(session, paddle):
    """pytest on one Paddle version (both by default): every unit test that runs inside the
    test process -- all but the ``probe`` ones (tests/conftest.py), which ``nox -s probes``
    runs.  Minutes for both versions; CI runs both sessions."""
    _install(session, paddle)
    session.run(*PYTEST, *XDIST, *UNIT_TESTS, "-m", "not probe", *session.posargs, env=ENV)


@nox.session
@nox.parametrize("paddle", list(PADDLE_PINS))
@_frees_venv
def probes(session, paddle):
    """The unit tests that start a process (``probe``, tests/conftest.py): real builds of the op
    (killed, corrupt, healed, ahead of time), crash probes in a fresh interpreter, what an
    import or the ``.pth`` hook does at interpreter start, the doctor, launcher retries, the
    Paddle-free GPU script.  Most of the unit suite's time; CI runs it after ``tests``."""
    _install(session, paddle)
    session.run(*PYTEST, *XDIST, *UNIT_TESTS, "-m", "probe", *session.posargs, env=ENV)


@nox.session
@nox.parametrize("paddle", list(PADDLE_PINS))
@_frees_venv
def nlp(session, paddle):
    """The llama example and trainer-integration tests with PaddleNLP 2.8.1."""
    _install(session, paddle, NLP_PINS)
    session.run(*PYTEST, *XDIST, "tests/nlp", *session.posargs, env=ENV)


@nox.session
@_frees_venv
def nlp272(session):
    """Paddle 2.6.2 + PaddleNLP 2.7.2, the original report's stack: tests/nlp's llama example and
    PaddleNLP-style llm script tests, unchanged (through PADDLE_MGRAD), and the CPU-gap test.
    Listed, not the whole directory: other tests/nlp files use models PaddleNLP 2.7.2 lacks
    (e.g. Mixtral).  PaddleNLP 2.7.2's Trainer calls paddle.device.synchronize() on CPU
    (TypeError, with or without paddle_mgrad): the tests stand in for it
    (tests/nlp/cpu_nlp_standins.py) and assert the failure without it."""
    _install(session, "2.6.2", NLP272_PINS)
    session.run(*PYTEST, *XDIST, *NLP272_TESTS, *session.posargs, env=ENV)


@nox.session
@nox.parametrize("paddle", list(PADDLE_PINS))
@_frees_venv
def fleet(session, paddle):
    """tests/fleet/launch: fleet hybrid parallel with 2 gloo ranks (TP2, TP2+SP,
    TP2+mp_async_allreduce, TP2+mp_fused_linear_param_grad_add, TP2+SP+sp_async_reduce_scatter
    (3.x, with and without the fused op), sharding stage1, PP2, PP2 with recompute_interval)
    against a one-process run, PaddleNLP 2.8.1's tiny llama, both recompute modes; PaddleNLP's
    ``llm/run_pretrain.py`` through PADDLE_MGRAD=all on the same 2-rank paths (TP2 async
    all-reduce with and without the fused op, TP2+SP, PP2 llama, PP2 qwen with
    recompute_hybrid, sharding stage1), both ``--recompute_use_reentrant`` modes, loss for loss
    against one plain process; and Paddle 3.x's zero-bubble DualPipeV schedule (deferred weight
    gradients through our op) against a one-process run."""
    _install(session, paddle, NLP_PINS)
    session.run(*PYTEST, *XDIST, "tests/fleet/launch", *session.posargs, env=ENV)


@nox.session
@nox.parametrize("paddle", list(PADDLE_PINS))
@_frees_venv
def nlp_fleet(session, paddle):
    """``nlp`` and ``fleet`` in one virtualenv and one pytest run (what .ci/run calls): the same
    pins, so one install instead of two, and xdist balances the 2-rank launches against the
    one-process runs."""
    _install(session, paddle, NLP_PINS)
    session.run(*PYTEST, *XDIST, "tests/nlp", "tests/fleet/launch", *session.posargs, env=ENV)


@nox.session
@_frees_venv
def formers(session):
    """PaddleFormers 1.2.0 (Paddle 3.x users' trainer): its own Trainer/TrainingArguments and a
    tiny llama with amp_master_grad + full recompute, PADDLE_MGRAD=all against plain Paddle; and
    every causal-LM family that runs on a CPU (tests/formers/test_families.py), full recompute
    in both modes, bit-identical to its own run without recompute."""
    _install(session, "3.3.1", FORMERS_PINS)
    session.run(*PYTEST, *XDIST, "tests/formers", *session.posargs, env=ENV)


# cuBLAS(Lt) for the CUDA build.  The machine's toolkit (/usr/local/cuda: CUDA 13.0 nvcc and
# cudart, no cuBLAS) is the only nvcc there is: NVIDIA's nvidia-cuda-nvcc-cu12 wheel ships ptxas,
# libdevice and crt headers but no nvcc binary, so a CUDA 12 build cannot be made from wheels.
# build_config.find_cuda therefore takes cuBLASLt from a wheel of the SAME major as nvcc (CUDA
# 13's wheels are unsuffixed: nvidia-cublas 13.x -> nvidia/cu13/{include,lib}).
CUBLAS_WHEEL = "nvidia-cublas==13.10.0.20"
GPU_PADDLE = ["paddlepaddle-gpu==2.6.2", "numpy<2", "protobuf<5"]


@nox.session
@_frees_venv
def cuda_compile(session):
    """nvcc-compile the CUDA core (sm_80, sm_90, PTX), link and load it (its CUDA entry point
    must fail cleanly without a GPU), and syntax-check the Paddle binding's CUDA branch, all with
    the flags and toolkit discovery of paddle_mgrad/ops/build_config.py (what ships)."""
    session.install(*PADDLE_PINS["2.6.2"], CUBLAS_WHEEL)
    paddle_inc = (
        session.run(
            "python",
            "-c",
            "import zlib, os, paddle; print(os.path.join(os.path.dirname(paddle.__file__), 'include'))",
            silent=True,
        )
        .strip()
        .splitlines()[-1]
    )
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".nox", "cuda-compile")
    session.run(
        "python",
        "benchmarks/gpu/bench_wgrad_gpu.py",
        "--compile-only",
        "--out",
        out,
        "--paddle-include",
        paddle_inc,
    )


@nox.session
@_frees_venv
def gpu_wheel(session):
    """The user's path on paddlepaddle-gpu 2.6.2 (no GPU needed): pip-install paddle_mgrad (not
    editable); without cuBLASLt the first use builds the CPU C++ op and warns once (what is
    missing, how to install it); with it, first use JIT-builds the op with CUDA (backend +cuda,
    module loads cuBLASLt through its rpath, its CUDA path fails cleanly without a GPU); then the
    CPU test suite on the GPU wheel."""
    import shutil

    root = os.path.dirname(os.path.abspath(__file__))
    session.install(*GPU_PADDLE, *TEST_DEPS)
    session.install("--no-build-isolation", "--force-reinstall", "--no-deps", ".")
    if _installing_only(session):  # cuBLAS comes later, in the run itself, after a check without it
        return
    session.run("python", "-m", "pip", "uninstall", "-q", "-y", "nvidia-cublas")
    caches = {m: os.path.join(root, ".nox", f"gpu-wheel-cache-{m}") for m in ("no-cublas", "cuda")}
    for cache in caches.values():  # first use must build: fresh JIT caches every run
        shutil.rmtree(cache, ignore_errors=True)
    check = os.path.join(root, ".ci", "gpu_wheel_check.py")
    # the doctor on a CUDA Paddle: names the pip command for cuBLASLt, then says healthy (+cuda)
    doctor = os.path.join(root, ".ci", "doctor_gpu_wheel_check.py")
    tmp = session.create_tmp()  # run outside the checkout: import the installed package
    session.chdir(tmp)
    session.run(
        "python",
        check,
        "no-cublas",
        "--installed",
        env=dict(ENV, PADDLE_MGRAD_CACHE=caches["no-cublas"]),
    )
    session.run(
        "python", doctor, "no-cublas", env=dict(ENV, PADDLE_MGRAD_CACHE=caches["no-cublas"])
    )
    session.install(CUBLAS_WHEEL)
    session.run(
        "python", check, "cuda", "--installed", env=dict(ENV, PADDLE_MGRAD_CACHE=caches["cuda"])
    )
    session.run("python", doctor, "cuda", env=dict(ENV, PADDLE_MGRAD_CACHE=caches["cuda"]))
    session.chdir(root)
    # The CPU suite on the GPU wheel, probes included, reusing the CUDA build.  (Paddle picks the
    # CPU place.)
    # Deselected: a test that needs our op WITHOUT its CUDA part (here it has one).
    session.run(
        *PYTEST,
        *XDIST,
        *UNIT_TESTS,
        "--deselect",
        "tests/test_trainer.py::test_fused_linear_on_gpu_without_cuda_build_is_refused",
        *session.posargs,
        env=dict(ENV, PADDLE_MGRAD_CACHE=caches["cuda"]),
    )


@nox.session
@_frees_venv
def demo(session):
    """Main job: train the tiny llama with every flag on (Paddle 3.3.1, CPU)."""
    _install(session, "3.3.1", NLP_PINS)
    session.run(
        "python",
        "examples/llama/run_pretrain.py",
        "examples/llama/pretrain_cpu.json",
        *session.posargs,
        env=ENV,
    )
