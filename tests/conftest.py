import zlib  # noqa: F401  (before paddle: Paddle 2.6 clashes with zlib)

import numpy as np
import paddle
import pytest

import paddle_mgrad
from paddle_mgrad._compat import IS_PADDLE_2

PADDLE2 = IS_PADDLE_2


@pytest.fixture(autouse=True)
def _clean_state():
    """Every test starts from unpatched Paddle, fixed seeds, grad on, AMP off."""
    paddle_mgrad.disable()
    paddle.seed(1234)
    np.random.seed(1234)
    paddle.set_device("cpu")
    yield
    paddle_mgrad.disable()

