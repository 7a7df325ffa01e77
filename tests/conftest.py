"""Simulated CPU devices for every test, set before JAX initialises its backend.

Compiled programs are shared through a JAX persistent compilation cache in a
temporary directory of this pytest session only (removed at exit, never
reused by another run): a program compiled again (a rerun, a restart, the
same step built anew, a worker process of a launched job) is read back
instead of recompiled. The launched workers inherit it through the
environment. A cache entry is the executable XLA produced, so results are
the same bits as a fresh compile.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

_COMPILATION_CACHE = tempfile.mkdtemp(prefix="jaxdp-tests-xla-cache-")
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
_CACHE_SETTINGS = {
    "jax_compilation_cache_dir": _COMPILATION_CACHE,
    # Every program, however small or quick to compile: the tests' programs are small.
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}
os.environ.update({name.upper(): str(value) for name, value in _CACHE_SETTINGS.items()})

import jax  # noqa: E402

for _name, _value in _CACHE_SETTINGS.items():
  jax.config.update(_name, _value)
jax.config.update("jax_num_cpu_devices", 8)
# Strict promotion (as equinox's tests do) turns silent broadcasting bugs into errors.
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402


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
