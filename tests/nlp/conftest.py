"""tests/nlp's fixtures (the helpers they use: llama_example_runs.py)."""

import pytest
from llama_example_runs import run_example


@pytest.fixture
def example():
    return run_example
