import numpy as np
import pytest


@pytest.fixture
def rng():
    """A seeded generator per test: no global seeding, the same inputs every run."""
    return np.random.default_rng(20261130)
