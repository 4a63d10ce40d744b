"""A `gpu` test that fails on purpose, for tests/test_gpu_check.py: bench/gpu_check.sh must still run the chain
after it. Its name is not test_*.py, so the suite never collects it; only a command line that names it runs it."""

import pytest


@pytest.mark.gpu
def test_fails_on_purpose():
    assert 1 + 1 == 3, "deliberate failure: the GPU check goes on to the chain all the same"


@pytest.mark.gpu
def test_passes():
    pass


def test_without_the_gpu_marker():
    raise AssertionError("selected although the GPU check asks for -m gpu only")
