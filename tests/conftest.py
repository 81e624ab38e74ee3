"""Shared fixtures: the smoke preset and its target (a tiny seeded random Llama), loaded once."""
import pytest

from xpress.config import load_config
from xpress.targets import load_target


@pytest.fixture(scope="session")
def cfg():
    return load_config("smoke")


@pytest.fixture(scope="session")
def target(cfg):
    """Never modify it in a test: every test file shares it."""
    return load_target(cfg)


@pytest.fixture(scope="session")
def smoke(target):
    return target
