"""Build/install paddle_mgrad.

Paddle is not a hard requirement (choose ``paddlepaddle`` or
``paddlepaddle-gpu`` yourself); extras pin the combinations we test:

    pip install .[paddle3,test]      # Paddle 3.3.1 (CPU)
    pip install .[paddle26,test]     # Paddle 2.6.2 (CPU) + its pins

The C++/CUDA sources in ``csrc/`` are shipped inside the package and compiled
on first use (JIT, cached per user).  ``PADDLE_MGRAD_BUILD_OPS=1 pip install
--no-build-isolation .`` compiles them ahead of time into the wheel instead
(needs Paddle and a compiler at install time).
"""

import os
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def env_get(name):
    """``paddle_mgrad.env.get(name)``: the package's one parser of its environment variables
    (``PADDLE_MGRAD_BUILD_OPS=false`` is False; a value it does not accept is an error naming
    the accepted ones).  setup.py cannot import paddle_mgrad (its ``__init__`` imports paddle),
    so env.py (standard library + errors.py only) is loaded by path, inside a stand-in package
    that resolves its relative import."""
    import importlib.util
    import types

    pkg_name = "_paddle_mgrad_setup_env"
    if pkg_name not in sys.modules:
        pkg = types.ModuleType(pkg_name)
        pkg.__path__ = [os.path.join(HERE, "paddle_mgrad")]
        sys.modules[pkg_name] = pkg
        spec = importlib.util.spec_from_file_location(
            pkg_name + ".env", os.path.join(HERE, "paddle_mgrad", "env.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[pkg_name + ".env"].get(name)


PTH = "paddle_mgrad_autoload.pth"


class BuildPy(build_py):
    """Copy ``csrc/`` into the package, ``paddle_mgrad_autoload.pth`` next to it (so that the
    wheel -- and so every ``pip install`` -- puts it into site-packages, where Python runs its
    one ``import`` line at start: the ``PADDLE_MGRAD`` switch), and, on request, prebuild the op."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))
        dst = os.path.join(self.build_lib, "paddle_mgrad", "_csrc")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(os.path.join(HERE, "csrc"), dst)
        # A build/ tree left by an earlier ahead-of-time build must not leak its binaries into
        # a plain (JIT) install: only this run decides whether _prebuilt ships.
        shutil.rmtree(os.path.join(self.build_lib, "paddle_mgrad", "_prebuilt"), ignore_errors=True)
        if env_get("PADDLE_MGRAD_BUILD_OPS"):
            import zlib  # noqa: F401  (before paddle, for Paddle 2.6)

            sys.path.insert(0, self.build_lib)
            from paddle_mgrad.ops import _build

            _build.build_into(os.path.join(self.build_lib, "paddle_mgrad", "_prebuilt"))


with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="paddle_mgrad",
    version="0.1.0",
    description="fp32 main_grad that survives recompute, and a fused linear that "
    "accumulates weight gradients in place, for PaddlePaddle LLM training",
    long_description=long_description,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["paddle_mgrad", "paddle_mgrad.*"]),
    py_modules=["paddle_mgrad_autoload"],  # what the .pth imports: stdlib only, no paddle
    python_requires=">=3.8",
    install_requires=["numpy"],
    extras_require={
        "paddle3": ["paddlepaddle==3.3.1"],
        "paddle26": ["paddlepaddle==2.6.2", "numpy<2", "protobuf<5"],
        "test": ["pytest>=7", "hypothesis>=6"],
        "nlp": [
            "paddlenlp==2.8.1",
            "aistudio-sdk==0.1.7",
            "huggingface_hub<0.26",
            "datasets<3",
            "pyarrow<19",
        ],
        # the original report's stack: PaddleNLP 2.7.2 on Paddle 2.6.2 (same pins)
        "nlp27": [
            "paddlenlp==2.7.2",
            "aistudio-sdk==0.1.7",
            "huggingface_hub<0.26",
            "datasets<3",
            "pyarrow<19",
        ],
    },
    # `paddle-mgrad doctor` == `python -m paddle_mgrad doctor` (paddle_mgrad/_cli.py knows the name)
    entry_points={"console_scripts": ["paddle-mgrad = paddle_mgrad.__main__:main"]},
    cmdclass={"build_py": BuildPy},
    zip_safe=False,
)
