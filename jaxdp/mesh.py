"""Meshes and the placement of the training state on them."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxdp._checks import check_optimizer, check_params_dtypes
from jaxdp.sharding import check_zero_stage, init_zero_state
from jaxdp.state import TrainState


def data_mesh(devices: Sequence[jax.Device] | None = None, axis_name: str = "data") -> Mesh:
  """A 1-D mesh over ``devices`` (default: every device) with one data axis.

  The axis type is set explicitly to ``AxisType.Auto`` so that behaviour does
  not depend on the JAX version's default, and so that the arrays jaxdp
  returns carry no mesh axes in their types (see :func:`auto_mesh`).
  """
  devices = jax.devices() if devices is None else list(devices)
  if not devices:
    raise ValueError("devices is empty; pass at least one device (or None for all of them).")
  if len(set(devices)) != len(devices):
    repeated = sorted({str(d) for d in devices if devices.count(d) > 1})
    raise ValueError(f"devices lists {', '.join(repeated)} more than once; pass each device once.")
  return Mesh(np.asarray(devices), (axis_name,), axis_types=(AxisType.Auto,))


def auto_mesh(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis of type ``AxisType.Auto`` (the same devices and names).

  The jitted steps run on this twin of the caller's mesh, so the arrays they
  return carry no mesh axes in their types. Arrays on an ``Explicit`` mesh
  do, and ordinary single-device code that later meets them (``nnx.update``
  then a metrics object's ``reset()``) fails with "Length of device
  assignment 1 is not equal to the size of the mesh ... use jax.set_mesh".
  Auto-typed arrays work anywhere.
  """
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def check_mesh_axis(mesh: Any, axis_name: str) -> None:
  """Raises unless ``mesh`` is a ``Mesh`` that has an axis called ``axis_name``."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one with jaxdp.data_mesh().")
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f"mesh has axes {mesh.axis_names} but no axis_name={axis_name!r}; "
        f"pass axis_name= one of {mesh.axis_names}, or build the mesh with jaxdp.data_mesh(axis_name={axis_name!r})."
    )


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding of a value held whole by every device of ``mesh``."""
  return NamedSharding(mesh, P())


def split_along(mesh: Mesh, axis_name: str) -> NamedSharding:
  """The sharding of a batch whose leading axis is split over ``axis_name``."""
  return NamedSharding(mesh, P(axis_name))


def _place_leaf(x: Any, sharding: NamedSharding) -> Any:
  if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
    return jax.device_put(x, sharding)
  # A process-local value (numpy, or a jax.Array on this process's devices, e.g. jax.random.key(0)) that every
  # process holds alike: device_put cannot target other processes' devices, so each places its own shards.
  typed_key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  host = np.asarray(jax.random.key_data(x) if typed_key else x)
  placed = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x)) if typed_key else placed


def place(tree: Any, shardings: Any) -> Any:
  """``jax.device_put(tree, shardings)`` that also works for process-local values in a multi-process run.

  ``shardings`` is one ``Sharding`` or a matching tree of them. Every process
  must pass the same values.
  """
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: _place_leaf(x, shardings), tree)
  return jax.tree.map(_place_leaf, tree, shardings)


def _assert_same_values(params: Any, model_state: Any) -> None:
  """Every process must start from the same values: compares a CRC-32 of each leaf across processes."""
  import zlib

  from jaxdp.distributed import assert_same_across_processes

  def crc(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return "global array"  # already one value, placed by the caller
    return zlib.crc32(np.ascontiguousarray(np.asarray(x)).view(np.uint8).reshape(-1))

  assert_same_across_processes(jax.tree.map(crc, {"params": params, "model_state": model_state}), "initial values")


def init_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: str = "data",
    zero_stage: int = 0,
    model_state: Any = None,
) -> TrainState:
  """Creates the training state and places it as :func:`make_train_step` expects.

  Args:
    params: the initial parameters (a pytree of arrays, the same on every process).
    optimizer: an optax ``GradientTransformation``.
    mesh: the mesh to place the state on.
    axis_name: the data-parallel axis.
    zero_stage: 0 replicates every leaf on every device (a full replica per
      device, as in DDP); 1 and 2 shard the optimizer state over
      ``axis_name``; 3 shards the parameters too (see :mod:`jaxdp.sharding`).
    model_state: the model's non-trainable state (BatchNorm statistics), or
      ``None``; replicated at every stage.

  Returns:
    A :class:`TrainState` of fresh buffers: a step that donates it never
    consumes the caller's ``params``.
  """
  check_mesh_axis(mesh, axis_name)
  check_zero_stage(zero_stage)
  check_optimizer(optimizer)
  check_params_dtypes(params, "params")
  if jax.process_count() > 1:
    _assert_same_values(params, model_state)
  params, model_state = place((params, model_state), replicated(mesh))
  return init_zero_state(params, optimizer, mesh, axis_name, zero_stage, model_state)
