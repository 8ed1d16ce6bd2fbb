"""Test matrix: each Paddle version in its own virtualenv with its pins.

    pip install nox && nox -s tests      # the test suite on Paddle 3.3.1 and 2.6.2
    pip install nox && nox -s demo       # the main job (llama example) on Paddle 3.3.1
    pip install nox && nox -s fleet      # 2-rank fleet hybrid parallel (TP/SP/sharding/PP)
"""
import os

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PADDLE_PINS = {
    "3.3.1": ["paddlepaddle==3.3.1"],
    # 2.6.2 wants numpy<2; fleet needs protobuf<5 ("hybrid_configs is not a attribute")
    "2.6.2": ["paddlepaddle==2.6.2", "numpy<2", "protobuf<5"],
}
NLP_PINS = ["paddlenlp==2.8.1", "aistudio-sdk==0.1.7", "huggingface_hub<0.26", "datasets<3",
            "pyarrow<19", "tqdm"]
TEST_DEPS = ["pytest>=7", "hypothesis>=6", "wheel", "setuptools"]
# Equal thread counts everywhere (Paddle forces 1 at import unless set).
ENV = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
       "PADDLE_MGRAD_CACHE": os.path.join(os.path.dirname(__file__), ".nox", "op-cache")}


def _install(session, paddle_version, extra=()):
    session.install(*PADDLE_PINS[paddle_version], *TEST_DEPS, *extra)
    # Not editable: the tests run against the installed package (csrc shipped inside).
    session.install("--no-build-isolation", ".")


@nox.session
@nox.parametrize("paddle", list(PADDLE_PINS))
def tests(session, paddle):
    """pytest on one Paddle version (both by default)."""
    _install(session, paddle)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests", "--ignore=tests/nlp",
                "--ignore=tests/fleet", *session.posargs, env=ENV)


@nox.session
@nox.parametrize("paddle", list(PADDLE_PINS))
def nlp(session, paddle):
    """The llama example and trainer-integration tests with PaddleNLP 2.8.1."""
    _install(session, paddle, NLP_PINS)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/nlp", *session.posargs,
                env=ENV)


@nox.session
@nox.parametrize("paddle", list(PADDLE_PINS))
def fleet(session, paddle):
    """Fleet hybrid parallel with 2 gloo ranks (TP2, TP2+SP, TP2+mp_async_allreduce,
    TP2+mp_fused_linear_param_grad_add, sharding stage1, PP2, PP2 with recompute_interval)
    against a one-process run, PaddleNLP 2.8.1's tiny llama."""
    _install(session, paddle, NLP_PINS)
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/fleet", *session.posargs,
                env=ENV)


CUBLAS_WHEEL = "nvidia-cublas==13.10.0.20"  # headers only; matches the CUDA 13 nvcc here


@nox.session
def cuda_compile(session):
    """nvcc-compile the CUDA core (sm_80, sm_90, PTX), link and load it (its CUDA entry point
    must fail cleanly without a GPU), and syntax-check the Paddle binding's CUDA branch.
    cuBLAS headers and libcublasLt come from NVIDIA's wheel."""
    import glob
    import zipfile

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".nox", "cuda-headers")
    inc = os.path.join(root, "nvidia", "cu13", "include")
    lib = os.path.join(root, "nvidia", "cu13", "lib")
    if not glob.glob(os.path.join(lib, "libcublasLt.so*")):
        session.run("python", "-m", "pip", "download", "-q", "--no-deps", "-d", root, CUBLAS_WHEEL)
        with zipfile.ZipFile(glob.glob(os.path.join(root, "nvidia_cublas-*.whl"))[0]) as z:
            z.extractall(root, [n for n in z.namelist()
                                if "/include/" in n or n.endswith("libcublasLt.so.13")])
    session.install(*PADDLE_PINS["2.6.2"])
    paddle_inc = session.run(
        "python", "-c", "import zlib, os, paddle; print(os.path.join(os.path.dirname(paddle.__file__), 'include'))",
        silent=True).strip().splitlines()[-1]
    session.run("python", "benchmarks/gpu/bench_wgrad_gpu.py", "--compile-only", "--out",
                os.path.join(root, "out"), "--paddle-include", paddle_inc,
                env={"PMG_CUDA_INCLUDE": inc, "PMG_CUDA_LIB": lib})


@nox.session
def demo(session):
    """Main job: train the tiny llama with every flag on (Paddle 3.3.1, CPU)."""
    _install(session, "3.3.1", NLP_PINS)
    session.run("python", "examples/llama/run_pretrain.py", "examples/llama/pretrain_cpu.json",
                *session.posargs, env=ENV)
