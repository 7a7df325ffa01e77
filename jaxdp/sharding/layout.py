"""Layout and placement: meshes, where each leaf of the training state lives, and putting it there.

Every leaf keeps its shape at every ZeRO stage; only its `NamedSharding`
changes. A leaf's sharding has two parts:

- its *model* part: whatever the user gave it over the mesh's other axes
  (tensor parallelism: `NamedSharding` arrays, or explicit
  `param_specs`), kept as it is by every function here;
- its *data* part: at ZeRO stage 1 and above, each leaf of the optimizer
  state is also split over the data axis along one dimension, and at stage 3
  each parameter too (Rajbhandari et al., 2020; PyTorch FSDP2's per-parameter
  sharding).

The dimension rule (`zero_dim`): the largest dimension that is not
already sharded over a model axis and whose size divides by the data axis's
device count (the first such one on a tie). A leaf with no such dimension
(a scalar, a bias of odd length) stays replicated over the data axis rather
than being padded: padding would change its shape, and with it what a
shape-aware optimizer (Adafactor's factored moments, Muon's matrices) and a
checkpoint see. `jaxdp.memory_report` lists those leaves and their bytes.

The optimizer state takes its model part from the parameter it belongs to:
an optimizer-state leaf whose key path ends with a parameter's key path and
has that parameter's shape (Adam's `mu['w']` for `params['w']`) gets that
parameter's model spec; any other leaf (counts, Adafactor's factored rows and
columns) is replicated over the model axes before the data rule is applied.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any, Iterable, NamedTuple, Sequence

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxdp.core.checks import check_not_donated
from jaxdp.reductions.compression import compression_specs
from jaxdp.core.loss import model_support
from jaxdp.core.state import TrainState

ZERO_STAGES = (0, 1, 2, 3)


# Meshes ------------------------------------------------------------------------------------------


def data_mesh(devices: Sequence[jax.Device] | None = None, axis_name: str = "data") -> Mesh:
  """A 1-D mesh over `devices` (default: every device) with one data axis.

  The axis type is set explicitly to `AxisType.Auto` so that behaviour does
  not depend on the JAX version's default, and so that the arrays jaxdp
  returns carry no mesh axes in their types (see `auto_mesh`); a mesh
  of `jax.make_mesh` (Explicit axes) works as well. For
  tensor parallelism or hybrid sharding build a `Mesh` with more axes
  (e.g. `jax.make_mesh((4, 2), ("data", "model"))`) and pass it instead.
  """
  if devices is not None and (isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable)):
    raise TypeError(
        f"devices must be an iterable of jax.Device (e.g. jax.devices()[:4]) or None, got {type(devices).__name__}."
    )
  devices = jax.devices() if devices is None else list(devices)
  if not devices:
    raise ValueError("devices is empty; pass at least one device (or None for all of them).")
  if len(set(devices)) != len(devices):
    repeated = sorted({str(d) for d in devices if devices.count(d) > 1})
    raise ValueError(f"devices lists {', '.join(repeated)} more than once; pass each device once.")
  return Mesh(np.asarray(devices), (axis_name,), axis_types=(AxisType.Auto,))


def auto_mesh(mesh: Mesh) -> Mesh:
  """`mesh` with every axis of type `AxisType.Auto` (the same devices and names).

  jaxdp runs on the mesh it is given, whatever its axis types (docs/meshes.md). Arrays on an `Explicit`
  mesh follow JAX's rules for it: eager single-device code that meets them (`nnx.update` then a metrics
  object's `reset()`) runs inside `jax.set_mesh(mesh)`, and fails outside it with "Length of device
  assignment 1 is not equal to the size of the mesh ... use jax.set_mesh". A program that wants arrays usable
  anywhere gives jaxdp this twin instead: Auto-typed arrays carry no mesh axes in their types.
  """
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def mesh_context(mesh: Mesh) -> Any:
  """The context a jaxdp program on `mesh` runs in: `jax.set_mesh(mesh)` where `mesh` has an Explicit axis.

  A step is then traced once, whether its caller is inside `with jax.set_mesh(mesh):` or not, and what it
  traces sees the mesh its arrays' types name. A mesh of Auto axes only, a caller already in this mesh's
  context, and a call while tracing (inside the caller's own `jit`, where `set_mesh` is refused: the
  caller's context stands) get no context of their own.
  """
  if AxisType.Explicit not in mesh.axis_types or jax.sharding.get_abstract_mesh() == mesh.abstract_mesh:
    return contextlib.nullcontext()
  try:
    return jax.set_mesh(mesh)
  except ValueError:  # "set_mesh can only be used outside of jax.jit"
    return contextlib.nullcontext()


def axis_names(axis_name: Any) -> tuple[str, ...]:
  """The data axes named by `axis_name`: one mesh axis (a str) or several (a tuple, e.g. `("replica", "data")`)."""
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def zero_axis(axis_name: Any) -> str:
  """The axis ZeRO splits the state over: `axis_name`, or the last of several data axes.

  With `axis_name=("replica", "data")` (hybrid sharding, FSDP's
  `HYBRID_SHARD`) the state is split over `"data"` and replicated over
  `"replica"`; the batch is split over both.
  """
  return axis_names(axis_name)[-1]


def data_size(mesh: Mesh, axis_name: Any) -> int:
  """The number of data-parallel replicas: the product of the sizes of the data axes."""
  return math.prod(mesh.shape[a] for a in axis_names(axis_name))


def data_rows(mesh: Mesh, axis_name: Any) -> np.ndarray:
  """`mesh.devices` as `[data-parallel position, other devices]` (positions in `P(axis_name)` order)."""
  names = axis_names(axis_name)
  order = [mesh.axis_names.index(a) for a in names]
  rest = [i for i in range(len(mesh.axis_names)) if i not in order]
  return np.transpose(mesh.devices, order + rest).reshape(data_size(mesh, axis_name), -1)


BACKENDS = ("shard_map", "pmap")
"""How a step maps over the data axis: `jit` of `jax.shard_map`, or `jax.pmap`."""


def check_backend(backend: Any, mesh: Mesh, axis_name: Any) -> None:
  """Raises unless `backend` is one of `BACKENDS` and can map over `mesh[axis_name]`."""
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} is not supported; use one of {', '.join(map(repr, BACKENDS))}.")
  if backend == "pmap" and mesh.axis_names != (axis_name,):
    raise ValueError(
        f"backend='pmap' maps over one axis only, but mesh has axes {mesh.axis_names}; "
        "use backend='shard_map' for multi-axis meshes."
    )
  if backend == "pmap" and any(d.process_index != jax.process_index() for d in mesh.devices.flat):
    # pmap maps over this process's devices with per-process inputs; the step hands it the global batch.
    raise ValueError(
        "backend='pmap' runs on one process's devices only, but the mesh spans several processes; use "
        "backend='shard_map' (the default) in multi-process runs: the same numbers, bitwise, on one process."
    )


def check_mesh_axis(mesh: Any, axis_name: Any) -> None:
  """Raises unless `mesh` is a `Mesh` with the axis `axis_name` (a str), or each of several (a tuple)."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one with jaxdp.data_mesh().")
  names = axis_names(axis_name) if isinstance(axis_name, (str, tuple)) else None
  if not names or not all(isinstance(a, str) for a in names) or len(set(names)) != len(names):
    raise TypeError(
        f"axis_name must name a mesh axis (a str) or several distinct ones (a tuple of str, e.g. "
        f"('replica', 'data') for hybrid sharding), got {axis_name!r}."
    )
  if len(set(mesh.devices.flat)) != mesh.devices.size:
    repeated = sorted({str(d) for d in mesh.devices.flat if list(mesh.devices.flat).count(d) > 1})
    raise ValueError(
        f"mesh lists {', '.join(repeated)} more than once ({mesh.devices.size} entries, "
        f"{len(set(mesh.devices.flat))} devices); give each device once, e.g. jaxdp.data_mesh(devices)."
    )
  for name in names:
    if name not in mesh.axis_names:
      raise ValueError(
          f"mesh has axes {mesh.axis_names} but no axis {name!r} (axis_name={axis_name!r}); "
          f"pass axis_name= one of {mesh.axis_names}, or build the mesh with jaxdp.data_mesh(axis_name={name!r})."
      )


def check_zero_stage(zero_stage: Any) -> None:
  if type(zero_stage) is not int or zero_stage not in ZERO_STAGES:
    kind = type(zero_stage)
    advice = "" if kind is int else f" (a {kind.__module__}.{kind.__name__}; pass a Python int, e.g. int(zero_stage))"
    raise ValueError(f"zero_stage={zero_stage!r} is not supported{advice}; use one of {ZERO_STAGES}.")


# Placement ---------------------------------------------------------------------------------------


def replicated(mesh: Mesh) -> NamedSharding:
  """The sharding of a value held whole by every device of `mesh`."""
  return NamedSharding(mesh, P())


def constrain(tree: Any, shardings: Any) -> Any:
  """`tree` laid out as `shardings` (one `NamedSharding` or a matching tree) inside a traced function.

  JAX takes each kind of mesh axis its own way: an `Explicit` axis is in
  the array's type and is moved with `jax.sharding.reshard` (a type
  change), an `Auto` axis is the compiler's and is asked for with
  `with_sharding_constraint`; each refuses the other's axes. A mixed mesh
  gets both, each naming only its own axes.
  """
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: _constrain_leaf(x, shardings), tree)
  return jax.tree.map(_constrain_leaf, tree, shardings)


def _constrain_leaf(x: Any, sharding: NamedSharding) -> Any:
  mesh = sharding.mesh
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
  if explicit:
    x = jax.sharding.reshard(x, NamedSharding(mesh, _only_axes(sharding.spec, explicit)))
  if set(mesh.axis_names) - explicit:
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, _only_axes(sharding.spec, set(mesh.axis_names) - explicit)))
  return x


def _only_axes(spec: P, keep: set) -> P:
  """`spec` naming only the mesh axes in `keep` (the others' dimensions left unsplit)."""
  def part(entry):
    names = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in keep)
    return None if not names else names[0] if len(names) == 1 else names
  return P(*(part(e) for e in spec))


def split_along(mesh: Mesh, axis_name: Any) -> NamedSharding:
  """The sharding of a batch whose leading axis is split over `axis_name` (replicated over other axes)."""
  return NamedSharding(mesh, P(axis_name if isinstance(axis_name, str) else tuple(axis_name)))


def global_array(shape: tuple[int, ...], sharding: jax.sharding.Sharding, block: Any) -> jax.Array:
  """The global array of `shape` whose shard at each global index is `block(index)` (a host array).

  The one place jaxdp calls `jax.make_array_from_callback`, rather than
  `make_array_from_process_local_data`: the callback is handed the global
  index of each *addressable* shard and returns exactly that device's data,
  so a process needs (and touches) only its own shards, whatever the order
  of the processes' devices along the axes and whatever axes the array is
  replicated over.
  """
  return jax.make_array_from_callback(tuple(shape), sharding, block)


def from_host(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array from a host array that every process holds whole: each process places its own shards."""
  # A copy per shard: no device buffer may alias ``host`` or another device's buffer (steps donate them).
  return global_array(host.shape, sharding, lambda index: np.array(host[index], copy=True))


def _place_leaf(x: Any, sharding: jax.sharding.Sharding) -> Any:
  if isinstance(x, jax.Array) and getattr(x, "sharding", None) == sharding:
    return x
  if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
    return jax.device_put(x, sharding)
  # A process-local value (numpy, or a jax.Array on this process's devices, e.g. jax.random.key(0)) that every
  # process holds alike: device_put cannot target other processes' devices, so each places its own shards.
  typed_key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  placed = from_host(np.asarray(jax.random.key_data(x) if typed_key else x), sharding)
  return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x)) if typed_key else placed


def place(tree: Any, shardings: Any) -> Any:
  """`jax.device_put(tree, shardings)` that also works for process-local values in a multi-process run.

  `shardings` is one `Sharding` or a matching tree of them. Every process
  must pass the same values. A leaf already placed as asked is returned as it is.
  """
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: _place_leaf(x, shardings), tree)
  return jax.tree.map(_place_leaf, tree, shardings)


def to_host(x: Any) -> np.ndarray:
  """The whole value of `x` as a numpy array (gathered from every process when it spans several).

  A typed PRNG key (e.g. in `optax.noisy_sgd`'s state) has no numpy form: its key data are gathered and it
  comes back as an unsharded key array of the same implementation.
  """
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(to_host(jax.random.key_data(x)), impl=jax.random.key_impl(x))
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))  # a new array no step can donate
  return np.array(x)  # a copy: np.asarray of a CPU array is a read-only view of its device buffer


# The layout --------------------------------------------------------------------------------------


def _entries(spec: P | None, ndim: int) -> list:
  entries = list(spec or ())
  return entries + [None] * (ndim - len(entries))


def _spec(entries: list) -> P:
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return P(*entries)


def _axes_of(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def zero_dim(shape: Sequence[int], model_spec: P | None, n: int) -> int | None:
  """The dimension a leaf of `shape` is split along over `n` data-parallel devices, or `None`.

  The largest dimension not already sharded over a model axis whose size
  divides by `n` (the first such one on a tie); `None` (replicated over
  the data axis) if there is none, or if `n == 1`.
  """
  if n <= 1:
    return None
  entries = _entries(model_spec, len(shape))
  candidates = [d for d, size in enumerate(shape) if entries[d] is None and size >= n and size % n == 0]
  return max(candidates, key=lambda d: (shape[d], -d)) if candidates else None


def _with_data(model_spec: P, ndim: int, dim: int | None, axis_name: str) -> P:
  entries = _entries(model_spec, ndim)
  if dim is not None:
    entries[dim] = axis_name
  return _spec(entries)


def model_spec_of(x: Any, mesh: Mesh, axis_name: str) -> P:
  """The part of `x`'s sharding over `mesh`'s axes other than `axis_name` (`P()` if it has none).

  A spec names axes, so the split is kept on any mesh that has those axes with the same sizes, whatever their
  order or the other axes (a mesh reordered, or one with a "replica" axis added); axes `mesh` lacks, or has
  with another size, are dropped (the leaf is then replicated over them).
  """
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return P()
  source = dict(sharding.mesh.shape)
  entries = []
  for entry in _entries(sharding.spec, np.ndim(x)):
    kept = tuple(a for a in _axes_of(entry) if a not in axis_names(axis_name) and mesh.shape.get(a) == source.get(a))
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return _spec(entries)


def check_param_specs(param_specs: Any, params: Any, mesh: Mesh, axis_name: str, source: str = "param_specs") -> Any:
  """`param_specs` checked against `params` and `mesh`: a tree of `PartitionSpec` over the model axes.

  `source`: what the messages call the specs (the argument the user passed)."""
  try:
    specs = jax.tree.leaves(jax.tree.map(lambda _, s: [s], params, param_specs), is_leaf=lambda x: isinstance(x, list))
  except ValueError as e:
    raise ValueError(f"{source} must have the structure of params, one PartitionSpec (or None) per leaf: {e}") from None
  specs = [s[0] for s in specs]
  for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(params), specs):
    name = f"{source}{jax.tree_util.keystr(path)}"
    if spec is None:
      continue
    if not isinstance(spec, P):
      raise TypeError(f"{name} is {spec!r}; pass a jax.sharding.PartitionSpec (or None for replicated).")
    if len(spec) > np.ndim(x):
      raise ValueError(f"{name} = {spec} has more entries than the leaf has dimensions ({np.shape(x)}).")
    for d, entry in enumerate(spec):
      for axis in _axes_of(entry):
        if axis in axis_names(axis_name):
          raise ValueError(
              f"{name} = {spec} shards over the data axis {axis!r}; give only the model axes, and let "
              "zero_stage= shard over the data axis."
          )
        if axis not in mesh.axis_names:
          raise ValueError(f"{name} = {spec} names axis {axis!r}, which the mesh (axes {mesh.axis_names}) lacks.")
      size = math.prod(mesh.shape[a] for a in _axes_of(entry))
      if np.shape(x)[d] % size:
        raise ValueError(
            f"{name} = {spec} splits dimension {d} (size {np.shape(x)[d]}) over {size} devices, which does "
            "not divide it."
        )
  return jax.tree.map(lambda _, s: P() if s is None else s, params, param_specs)


def data_dim(spec: P, axis_name: Any) -> int | None:
  """The dimension `spec` splits over ZeRO's axis (`zero_axis`), or `None`."""
  zero = zero_axis(axis_name)
  return next((d for d, entry in enumerate(spec) if zero in _axes_of(entry)), None)


def data_part(spec: P, axis_name: Any) -> P:
  """`spec` with only ZeRO's axis kept: the spec `shard_map` sees when only the data axes are manual."""
  zero = zero_axis(axis_name)
  return _spec([zero if zero in _axes_of(entry) else None for entry in spec])


def model_part(spec: P, axis_name: Any) -> P:
  """`spec` without the data axes: the part the compiler partitions inside `shard_map` over the data axes."""
  names = axis_names(axis_name)
  entries = []
  for entry in spec:
    kept = tuple(a for a in _axes_of(entry) if a not in names)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return _spec(entries)


def per_model_shard(fn: Any, spec: P, axis_name: Any) -> Any:
  """`fn` (a data-axis collective) run on each model-axis shard of a leaf whose full spec is `spec`.

  For use inside `shard_map` over the data axes. A data-axis collective on
  a leaf the compiler partitions over model axes otherwise makes XLA gather
  the leaf over those axes first (more bytes sent than the collective
  itself needs); a nested `shard_map` over the model axes keeps every
  device on its own model shard.
  """
  model = model_part(spec, axis_name)
  axes = {a for entry in model for a in _axes_of(entry)}
  if not axes:
    return fn
  return jax.shard_map(fn, in_specs=model, out_specs=model, axis_names=axes)


class Layout(NamedTuple):
  """Where every leaf of a `jaxdp.TrainState` lives, for one mesh, data axis and ZeRO stage.

  Attributes:
    specs: a `TrainState` of full `PartitionSpec`s (model and data axes).
    grad_specs: the params' tree of the data-axis `PartitionSpec` each
      reduced gradient leaf has: split along the dimension its parameter
      is split along at stage 3 (reduce-scattered) at stages 2 and 3,
      `P()` (all-reduced) at stages 0 and 1.
    zero_stage: the stage.
    split_specs: the params' tree of the full `PartitionSpec` each
      parameter has when split over the data axis (its model axes kept;
      unchanged where no dimension divides), the same at every stage: the
      params' own specs at stage 3, the slices the update computes before
      stages 1-2 gather them in flat buckets (`bucket_bytes`), and the
      reduced gradient's full specs at stages 2-3.
    layers: the params' tree of bools, `True` for a leaf of a stack of
      layers named by `layers=` (`layer_mask`); `None` if none.
  """

  specs: TrainState
  grad_specs: Any
  zero_stage: int
  split_specs: Any = None
  layers: Any = None  # the params' tree of bools: True for a leaf of a stack of layers (see layer_mask)

  def shardings(self, mesh: Mesh) -> TrainState:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs)


def _per_parameter(opt_state: Any, params: Any, values: Any, default: Any) -> Any:
  """Each optimizer-state leaf's parameter's entry of `values` (a params-shaped tree) if its path ends with
  that parameter's path and shapes agree (Adam's `mu['w']` for `params['w']`), else `default`."""
  shapes = {path: np.shape(x) for path, x in jax.tree_util.tree_leaves_with_path(params)}
  by_path = dict(jax.tree_util.tree_leaves_with_path(values, is_leaf=lambda x: isinstance(x, P)))
  longest_first = sorted(shapes, key=len, reverse=True)

  def value(path, x):
    for param_path in longest_first:
      if len(param_path) <= len(path) and tuple(path[len(path) - len(param_path):]) == tuple(param_path) and (
          np.shape(x) == shapes[param_path]
      ):
        return by_path[param_path]
    return default

  return jax.tree_util.tree_map_with_path(value, opt_state)


def _opt_model_specs(opt_state: Any, params: Any, model_specs: Any) -> Any:
  """The model spec of each optimizer-state leaf: its parameter's if its path ends with one and shapes agree."""
  return _per_parameter(opt_state, params, model_specs, P())


def key_name(key: Any) -> Any:
  """A pytree key as the name a user writes: a dict key, an attribute or field name, a sequence index."""
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return getattr(key, attribute)
  return key


def _layer_paths(layers: Any) -> list[tuple]:
  if isinstance(layers, (str, int)):
    return [(layers,)]
  if isinstance(layers, tuple) and layers:
    return [layers]
  if isinstance(layers, list) and layers:
    return [path for entry in layers for path in _layer_paths(entry)]
  raise TypeError(
      f"layers must name the stacked layers in params: a key (layers='layers'), a path of keys "
      f"(layers=('decoder', 'layers')) or a list of them, got {layers!r}."
  )


def one_layer_spec(spec: P | None, ndim: int) -> P:
  """The spec of one layer of a stacked leaf of `ndim` dimensions whose spec is `spec` (its layer axis dropped)."""
  return _spec(_entries(spec, ndim)[1:])


def check_layers(layers: Any) -> None:
  """Raises `TypeError` unless `layers` is `None` or names stacks of layers as `layer_mask` reads."""
  if layers is not None:
    _layer_paths(layers)


def layer_mask(params: Any, layers: Any) -> Any:
  """The params' tree of bools: `True` for the leaves under the key paths `layers` names (stacks of layers).

  `layers`: `None` (no stack), a key (`"layers"`), a path of keys (`("decoder", "layers")`) or a list
  of them; the leaves under each must share a leading layer axis (`nnx.vmap`, `nn.scan` or a stacked
  pytree). Raises `ValueError` naming the fix when a path names nothing or a stack's leaves disagree.
  """
  if layers is None:
    return None
  paths = _layer_paths(layers)
  leaves = [(tuple(key_name(k) for k in path), x) for path, x in jax.tree_util.tree_leaves_with_path(params)]
  mask = [False] * len(leaves)
  for prefix in paths:
    members = [i for i, (path, _) in enumerate(leaves) if path[:len(prefix)] == tuple(prefix)]
    if not members:
      tops = sorted({str(path[0]) for path, _ in leaves if path})
      raise ValueError(
          f"layers={layers!r}: params have no leaf under {prefix!r} (top-level keys: {', '.join(tops)}); name the "
          "subtree that holds the stacked layers (made with nnx.vmap, nn.scan or a stacked pytree)."
      )
    counts = {np.shape(leaves[i][1])[0] if np.ndim(leaves[i][1]) else None for i in members}
    if len(counts) != 1 or None in counts:
      detail = ", ".join(f"{'/'.join(map(str, leaves[i][0]))}: {np.shape(leaves[i][1])}" for i in members[:4])
      raise ValueError(
          f"layers={layers!r}: the leaves under {prefix!r} do not share a leading layer axis ({detail}); stack the "
          "layers' parameters on axis 0 (nnx.vmap, nn.scan with variable_axes={'params': 0}, or jnp.stack)."
      )
    for i in members:
      mask[i] = True
  return jax.tree.unflatten(jax.tree.structure(params), mask)


def make_layout(abstract: TrainState, mesh: Mesh, axis_name: str, zero_stage: int, model_specs: Any = None,
                layers: Any = None, stage_axis: str | None = None) -> Layout:
  """The `Layout` of a state shaped like `abstract` (arrays or `ShapeDtypeStruct`s).

  `model_specs` is the params' tree of model-axis `PartitionSpec`s
  (`None`: every parameter replicated over the model axes). `layers`
  names the stacks of layers in the params (`layer_mask`): their
  leaves, and the optimizer state that belongs to them, are split by the
  dimension rule applied to one layer's shape, never along the layer axis,
  so that a layer's slice can be gathered inside the loop over layers
  (`jaxdp.gather`).

  `stage_axis`: a pipeline's stage axis (`jaxdp.sharding.pipelining`): the stacked leaves, and the optimizer
  state that belongs to them, are split over it along their layer axis (stage `s` holds layers
  `s·L/P … (s+1)·L/P − 1`); every other leaf is replicated over it.
  """
  zero = zero_axis(axis_name)
  n = mesh.shape[zero]
  if model_specs is None:
    model_specs = jax.tree.map(lambda _: P(), abstract.params)
  stacked = layer_mask(abstract.params, layers)
  if stacked is None:
    stacked = jax.tree.map(lambda _: False, abstract.params)
  if stage_axis is not None:  # the stage split is the layout's own, whatever the leaves carry now
    stages = mesh.shape[stage_axis]
    for (path, x), is_layer in zip(jax.tree_util.tree_leaves_with_path(abstract.params), jax.tree.leaves(stacked)):
      if is_layer and np.shape(x)[0] % stages:
        raise ValueError(
            f"layers={layers!r}: {jax.tree_util.keystr(path)} stacks L = {np.shape(x)[0]} layers, which do not split "
            f"over the {stages} devices of the stage axis {stage_axis!r} (L % {stages} = {np.shape(x)[0] % stages}); "
            f"use a number of layers that divides by {stages}."
        )
    model_specs = jax.tree.map(
        lambda x, spec, is_layer: _with_stage(spec, np.ndim(x), stage_axis, is_layer), abstract.params, model_specs,
        stacked, is_leaf=lambda x: isinstance(x, P))
  for path, is_layer, spec in zip(jax.tree_util.tree_leaves_with_path(abstract.params), jax.tree.leaves(stacked),
                                  jax.tree.leaves(model_specs, is_leaf=lambda x: isinstance(x, P))):
    if is_layer and _entries(spec, len(np.shape(path[1])))[0] not in (None, stage_axis):
      raise ValueError(
          f"layers={layers!r}: {jax.tree_util.keystr(path[0])} is split over a model axis along its layer axis "
          f"(spec {spec}); each device must hold every layer's slice. Split it over the model axes along another "
          "dimension."
      )

  def sharded(x, model_spec, is_layer=False):  # the leaf's full spec when split over the data axis (where it can be)
    shape = np.shape(x)
    if not is_layer:
      return _with_data(model_spec, len(shape), zero_dim(shape, model_spec, n), zero)
    dim = zero_dim(shape[1:], one_layer_spec(model_spec, len(shape)), n)
    return _with_data(model_spec, len(shape), None if dim is None else dim + 1, zero)

  opt_specs = _opt_model_specs(abstract.opt_state, abstract.params, model_specs)
  opt_stacked = _per_parameter(abstract.opt_state, abstract.params, stacked, False)
  split_specs = jax.tree.map(sharded, abstract.params, model_specs, stacked)
  specs = TrainState(
      params=split_specs if zero_stage == 3 else model_specs,
      opt_state=jax.tree.map(sharded, abstract.opt_state, opt_specs, opt_stacked) if zero_stage >= 1 else opt_specs,
      step=P(),
      model_state=jax.tree.map(lambda _: P(), abstract.model_state),
      loss_scale=jax.tree.map(lambda _: P(), abstract.loss_scale),
      compression=compression_specs(getattr(abstract, "compression", None), axis_name, stage_axis),
  )
  grad_specs = jax.tree.map(lambda s: data_part(s, axis_name) if zero_stage >= 2 else P(), split_specs)
  return Layout(specs, grad_specs, zero_stage, split_specs, None if layers is None else stacked)


def _with_stage(spec: P, ndim: int, stage_axis: str, is_layer: bool) -> P:
  """`spec` without `stage_axis`, then split over it along dim 0 when `is_layer`."""
  entries = []
  for entry in _entries(spec, ndim):
    kept = tuple(a for a in _axes_of(entry) if a != stage_axis)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  if is_layer:
    entries[0] = stage_axis
  return _spec(entries)


def manual_part(spec: P, axes: Any) -> P:
  """`spec` with only the mesh axes `axes` kept: the spec `shard_map` sees when those axes are manual."""
  entries = []
  for entry in spec:
    kept = tuple(a for a in _axes_of(entry) if a in axes)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return _spec(entries)


def model_specs_of(params: Any, mesh: Mesh, axis_name: str) -> Any:
  """The params' tree of model-axis specs read off their shardings (`P()` for unsharded leaves)."""
  return jax.tree.map(lambda x: model_spec_of(x, mesh, axis_name), params)


def state_specs(state: TrainState) -> TrainState:
  """The `PartitionSpec` of every leaf of a placed state, read off its arrays (`P()` for host values).

  The layout is in the shardings: `state_specs(state).opt_state` shows
  which optimizer-state leaves ZeRO split over the data axis, and along
  which dimension; model axes show tensor-parallel splits.
  """

  def spec(x):  # trailing unsplit dimensions dropped: an Explicit mesh's arrays spell P() as P(None, None)
    sharding = getattr(x, "sharding", None)
    return _spec(list(sharding.spec)) if isinstance(sharding, NamedSharding) else P()

  return jax.tree.map(spec, state)


def abstract_state(params: Any, optimizer: optax.GradientTransformation, model_state: Any = None,
                   loss_scale: Any = None) -> TrainState:
  """The stage-0 state of `params` as `ShapeDtypeStruct`s (every stage has these shapes)."""
  return jax.eval_shape(lambda p, m, s: TrainState.create(p, optimizer, m, s), params, model_state, loss_scale)


def assert_same_values(params: Any, model_state: Any) -> None:
  """Every process must start from the same values: compares a CRC-32 of each leaf across processes."""
  from jaxdp.core.processes import assert_same_across_processes

  def crc(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return "global array"  # already one value, placed by the caller
    return zlib.crc32(np.ascontiguousarray(np.asarray(x)).view(np.uint8).reshape(-1))

  assert_same_across_processes(jax.tree.map(crc, {"params": params, "model_state": model_state}), "initial values")


def model_specs_for(params: Any, param_specs: Any, mesh: Mesh, axis_name: str) -> Any:
  if param_specs is not None:
    return check_param_specs(param_specs, params, mesh, axis_name)
  return model_specs_of(params, mesh, axis_name)


ANNOTATIONS = "the partitioning annotation (nn.with_partitioning) of params"
"""What the messages call the specs a model library's boxes carried (not an argument the user passed)."""


def annotated_model_specs(params: Any, param_specs: Any, mesh: Mesh, axis_name: Any) -> tuple[Any, Any]:
  """`(params, model_specs)`: a model library's partitioning boxes removed and the params' model-axis specs.

  `param_specs` (the user's argument) wins and must name model axes only. Without it, the specs come from the
  boxes (linen's `nn.with_partitioning`), with the data axes dropped from them: an annotation over the data
  axis is the model's FSDP placement, which `zero_stage=` decides here (the FSDP guide); the model axes are
  kept. Without either, from the arrays' own shardings (`model_specs_of`).
  """
  params, boxed = unboxed(params)
  if param_specs is not None:
    return params, check_param_specs(param_specs, params, mesh, axis_name)
  if boxed is not None:
    return params, check_param_specs(without_axes(boxed, axis_names(axis_name)), params, mesh, axis_name, ANNOTATIONS)
  return params, model_specs_of(params, mesh, axis_name)


def without_axes(specs: Any, axes: Iterable[str]) -> Any:
  """`specs` (a `PartitionSpec` or a tree of them; `None` leaves kept) naming none of `axes`."""
  keep = lambda s: _spec(list(_only_axes(s, {a for e in s for a in _axes_of(e)} - set(axes))))  # noqa: E731
  return jax.tree.map(lambda s: keep(s) if isinstance(s, P) else s, specs, is_leaf=lambda x: isinstance(x, P))


def unboxed(params: Any) -> tuple[Any, Any]:
  """`(params, specs)`: a model library's metadata boxes removed and the specs they carried (`None` if none)."""
  for support in model_support():
    if support.unbox is not None:
      unboxed, specs = support.unbox(params)
      if specs is not None:
        return unboxed, specs
  return params, None


def gather_state(state: TrainState) -> TrainState:
  """The whole state as numpy arrays of its own (copies, never views of device buffers), whatever its layout.

  The layout may be any stage, mesh or device count.

  In a multi-process run every process receives the whole arrays (call it on
  every process). Use it to export or to compare layouts; checkpoints do not
  need it (they save each shard where it lives).
  """
  check_not_donated(state)
  return jax.tree.map(to_host, state)
