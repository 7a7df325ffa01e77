"""Fixtures and the hypothesis profile of the suite.

The simulated CPU devices, the compilation cache and strict rank promotion are
set in the repository's root conftest.py, before JAX initialises, so that
they apply to the Markdown blocks of README.md and docs/ too.
"""

import os

import jax
import pytest
from hypothesis import settings


@pytest.fixture(scope="module")
def fast_compiles():
  """Skips most XLA optimisation passes while a module's tests run, then restores the setting.

  For tests that check plumbing and float32 agreement, not speed: compiling the train step is most of their
  time, and this makes it ~2.5x faster on CPU.
  """
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


# Every new shape compiles a new step, so examples are few and have no deadline.
settings.register_profile("jaxdp", deadline=None, max_examples=20, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxdp"))
