"""Version shims between Paddle 2.6 and 3.x, kept in one place.

Paddle 2.6's ``libpaddle`` exports zlib's ``deflate*`` symbols; if ``zlib`` is
imported *after* paddle the interpreter can segfault (also when ``setup.py``
zips an egg).  Importing ``zlib`` first is harmless on 3.x, so we always do it.
"""
from __future__ import annotations

import zlib  # noqa: F401  (must precede ``import paddle`` on Paddle 2.6)

import paddle
from paddle.base.framework import EagerParamBase, global_var  # 2.6 and 3.x
from paddle.framework import core

_v = paddle.__version__.split(".")
try:
    PADDLE_VERSION = (int(_v[0]), int(_v[1]))
except ValueError:  # develop builds report "0.0.0"
    PADDLE_VERSION = (99, 0)
IS_PADDLE_2 = PADDLE_VERSION < (3, 0)


def tracer():
    return global_var._dygraph_tracer_  # paddle.framework._dygraph_tracer(), one call fewer


def is_tensor(x) -> bool:
    return isinstance(x, core.eager.Tensor)


def is_parameter(x) -> bool:
    return isinstance(x, EagerParamBase)
