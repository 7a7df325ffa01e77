"""Simulated CPU devices for every test, set before JAX initialises its backend.

Here, at the repository root, so that the Python blocks of README.md and
docs/*.md (run by pytest-markdown-docs) see the same 8 devices and settings
as tests/, whose conftest.py keeps the fixtures.

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
from pytest_markdown_docs.plugin import MarkdownDocstringCodeModule  # noqa: E402


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
  """Fences are collected from the Markdown files only, not from the docstrings of every .py file.

  pytest-markdown-docs imports each .py file it is shown to read its docstrings: that would import the launched
  worker scripts under tests/ (mp_workers/, ckpt_workers/) and import the test modules a second time under
  another module name. No docstring there holds a Python fence; the docs' examples live in README.md and docs/.
  """
  collected = yield
  return [node for node in collected if not isinstance(node, MarkdownDocstringCodeModule)]


def pytest_collection_modifyitems(items):
  """The README's and the docs' blocks are in the smoke run (``make test-fast``, ``-m fast``)."""
  for item in items:
    if item.path.suffix == ".md":
      item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True)
def _markdown_blocks_as_users_run_them(request):
  """A README or docs block runs under JAX's default rank promotion, as in a user's program.

  The strict setting above is for the suite's own code. The blocks also skip most XLA optimisation passes
  (``jax_disable_most_optimizations``, as the ``fast_compiles`` fixture does): their tiny models are compiled,
  not run, for most of their time, and they check float32 agreement, not speed.
  """
  if request.node.path.suffix != ".md":
    yield
    return
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    with jax.numpy_rank_promotion("allow"):
      yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)
