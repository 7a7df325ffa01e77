"""Looking at the replicas: host-side copies, equality checks, in-graph divergence."""

from __future__ import annotations

import numbers
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdp.core.checks import check_not_donated
from jaxdp.training.reduction import as_varying, axis_names, varies


def _host(x: Any) -> np.ndarray:
  """`x` as numpy; a typed PRNG key (`optax.noisy_sgd`'s state) as its raw `uint32` data."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def _device_copies(leaf: Any) -> tuple[list[jax.Device], list[np.ndarray]]:
  if not isinstance(leaf, jax.Array):
    return [], [np.asarray(leaf)]
  shards = sorted(leaf.addressable_shards, key=lambda s: s.device.id)
  return [s.device for s in shards], [_host(s.data) for s in shards]


def per_replica(tree: Any) -> Any:
  """Numpy copies of every (addressable) device's replica, stacked on a new leading axis.

  Row `i` of each leaf is what the `i`-th device (in device-id order)
  holds. For a state that is meant to be replicated, the rows differ only if
  the replicas have diverged (e.g. under `reduction="none"`). A typed PRNG
  key comes back as its raw `uint32` data (numpy cannot hold a key).
  """
  check_not_donated(tree, name="tree")
  return jax.tree.map(lambda leaf: np.stack(_device_copies(leaf)[1]), tree)


def _gather_over_processes(copies: list[np.ndarray]) -> list[np.ndarray]:
  from jax.experimental import multihost_utils

  # Every process contributes its first local copy; the local ones are compared already.
  gathered = multihost_utils.process_allgather(copies[0], tiled=False)
  return copies + [np.asarray(g) for i, g in enumerate(gathered) if i != jax.process_index()]


def _copies_that_must_agree(leaf: Any) -> list[tuple[list[str], list[np.ndarray]]]:
  """Groups of (device names, copies) that hold the same part of `leaf`.

  A replicated leaf is one group (over processes too); a sharded leaf (a ZeRO
  chunk, a batch) has one group per shard index, each compared among the
  local devices that hold that shard.
  """
  if not isinstance(leaf, jax.Array):
    return [(["host"], [np.asarray(leaf)])]
  groups: dict[tuple, tuple[list[str], list[np.ndarray]]] = {}
  for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
    key = tuple((i.start, i.stop, i.step) for i in shard.index)
    names, copies = groups.setdefault(key, ([], []))
    names.append(str(shard.device))
    copies.append(_host(shard.data))
  if jax.process_count() > 1 and leaf.sharding.is_fully_replicated:
    (names, copies), = groups.values()
    others = [f"process {p}" for p in range(jax.process_count()) if p != jax.process_index()]
    return [(names + others, _gather_over_processes(copies))]
  return list(groups.values())


def assert_replicas_equal(tree: Any, *, atol: float = 0.0) -> None:
  """Asserts that every device's copy of every leaf is the same.

  Compares each device's copy with the first device's through
  `chex.assert_trees_all_close` (`rtol=0`). Replicated leaves are
  compared across processes too when there are several (call it with the
  same tree on every process). Sharded leaves (ZeRO chunks) are compared
  among the devices that hold the same shard.

  Raises:
    AssertionError: naming the leaf path, the devices that differ and the
      largest absolute difference.
  """
  check_not_donated(tree, name="tree")
  if isinstance(atol, bool) or not isinstance(atol, numbers.Real) or not atol >= 0:  # NaN fails >= too
    raise ValueError(f"atol must be a number >= 0 (the largest allowed |difference|), got {atol!r}.")
  failures = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    for names, copies in _copies_that_must_agree(leaf):
      reference, bad = copies[0], []
      for name, copy in zip(names[1:], copies[1:]):
        try:
          chex.assert_trees_all_close(copy, reference, atol=atol, rtol=0.0)
        except AssertionError:
          bad.append((name, float(np.max(np.abs(copy.astype(np.float64) - reference.astype(np.float64))))))
      if bad:
        failures.append(
            f"{jax.tree_util.keystr(path) or '<root>'}: {', '.join(n for n, _ in bad)} differ from "
            f"{names[0]} (largest |difference| {max(d for _, d in bad):.6g}, atol={atol})"
        )
  if failures:
    raise AssertionError("replicas differ:\n  " + "\n  ".join(failures))


def replica_divergence(tree: Any, axis_name: str, *, skip_varying: bool = True) -> jax.Array:
  """In-graph measure of how far the replicas of `tree` have drifted apart.

  For every leaf, a checksum (its sum and the sum of its absolute values, in
  float32; a complex leaf's two parts, a typed key's data) is compared across
  `axis_name` with `pmax - pmin`; the largest gap is returned, identical
  on every replica. It is `0` for consistent replicas. Call it inside
  `shard_map`/`pmap` over `axis_name`. With `skip_varying` (the
  default), leaves typed as varying over `axis_name` inside `shard_map`
  with `check_vma=True` are taken for ZeRO's chunks, which differ by
  design, and skipped; pass `skip_varying=False` when they are replicas
  (e.g. a `reduction="none"` state made `as_varying`), or the result is
  0 whatever they hold. The checksum can miss differences of a few ulps in
  large leaves (float32 sums).
  """
  gaps = [jnp.zeros((), jnp.float32)]
  tracked = skip_varying and varies(lax.axis_index(axis_name), axis_names(axis_name)[-1])
  replicated = [x for x in jax.tree.leaves(tree) if not (tracked and varies(x, axis_names(axis_name)[-1]))]
  for leaf in replicated:
    gaps.append(_gap(leaf, axis_name, lambda x: as_varying(x, axis_name)))
  return jnp.max(jnp.stack(gaps))


def _gap(leaf: Any, axes: Any, cast: Any = lambda x: x) -> jax.Array:
  """The largest `pmax - pmin` over `axes` of `leaf`'s float32 checksums (sum, sum of |x|) per real part."""
  gaps = []
  for part in _real_parts(jnp.asarray(leaf)):
    x = cast(part.astype(jnp.float32))
    checksum = jnp.stack([jnp.sum(x), jnp.sum(jnp.abs(x))])
    gaps.append(jnp.max(lax.pmax(checksum, axes) - lax.pmin(checksum, axes)))
  return jnp.max(jnp.stack(gaps))


def divergence_over_mesh(tree: Any, specs: Any, mesh: jax.sharding.Mesh) -> jax.Array:
  """`replica_divergence` over every mesh axis that holds copies, for arrays laid out as `specs`.

  Called under `jit` on global arrays (not inside a map). Each leaf's
  checksums are compared across each mesh axis its spec leaves it
  replicated on: the data axes, but also a model axis for a bias that is not
  split over it, or `"replica"` for a ZeRO chunk on a hybrid mesh. A
  `shard_map` over the data axes alone cannot see the copies on the
  others: the compiler takes them to agree and may read any of them.
  """
  everything = tuple(mesh.axis_names)
  flat_specs = tuple(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))

  def per_device(*leaves):
    gaps = [jnp.zeros((), jnp.float32)]
    for leaf, spec in zip(leaves, flat_specs):
      used = {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}
      copies = tuple(a for a in everything if a not in used and mesh.shape[a] > 1)
      if copies:
        gaps.append(_gap(leaf, copies))
    return lax.pmax(jnp.max(jnp.stack(gaps)), everything)  # the same on every device

  # check_vma=False: the copies are compared as the devices hold them, which the types say are equal.
  return jax.shard_map(per_device, mesh=mesh, in_specs=flat_specs, out_specs=P(), check_vma=False)(
      *jax.tree.leaves(tree))


def _real_parts(x: jax.Array) -> list[jax.Array]:
  """What a float32 checksum can read of `x`: a typed PRNG key's data; a complex leaf's real and imaginary parts."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return [x.real, x.imag] if jnp.iscomplexobj(x) else [x]
