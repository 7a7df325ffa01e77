"""What the test modules share: the closeness rules and the meshes.

Two rules, each stated once:

* :func:`assert_close`: every element within ``atol + rtol * |expected|``
  (``np.testing.assert_allclose``), for values compared one by one;
* :func:`assert_close_to_scale`: each leaf's largest difference within
  ``rtol`` times the leaf's largest magnitude, for trained parameters, whose
  small elements carry the round-off of the large ones.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

import jaxdp


def assert_close(actual: Any, expected: Any, *, rtol: float, atol: float = 0.0) -> None:
  """Leaf by leaf, every element of ``actual`` within ``atol + rtol * |expected|`` of ``expected``."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


def assert_close_to_scale(actual: Any, expected: Any, rtol: float = 1e-6) -> None:
  """Leaf by leaf, ``max |actual - expected| <= rtol * max |expected|`` (the leaf's path named if not)."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    a, b = np.asarray(a), np.asarray(b)
    err = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
    assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative difference {err:.2e} > {rtol}"


@functools.cache
def mesh_of(k: int) -> Mesh:
  """A data mesh over the first ``k`` simulated devices (one object per ``k``)."""
  return jaxdp.data_mesh(jax.devices()[:k])


def grid_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
  """A mesh of ``shape`` over the first devices, every axis ``Auto``."""
  devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


@contextlib.contextmanager
def optimized_compiles():
  """XLA's optimisation passes on inside a module that skips most of them (`fast_compiles`): for a run whose bits
  are compared with a worker process's, which compiles with them."""
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


def float64():
  """A context with JAX's 64-bit mode on (restored on exit): `jax.enable_x64(True)`, or its older spelling."""
  enable = getattr(jax, "enable_x64", None)
  if enable is None:
    from jax.experimental import enable_x64 as enable
  return enable(True)
