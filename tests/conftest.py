"""Simulated CPU devices for every test, set before JAX initialises its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Strict promotion (as equinox's tests do) turns silent broadcasting bugs into errors.
jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import settings  # noqa: E402

# Every new shape compiles a new step, so examples are few and have no deadline.
settings.register_profile("jaxdp", deadline=None, max_examples=20, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxdp"))
