"""The layout value: how a run is spread over its devices, built and checked once.

`dp = jaxdp.data_parallel(mesh, zero_stage=3, layers="blocks")` holds the
mesh, its data axes (one, several, or hybrid `("replica", "data")`), the
ZeRO stage, the stacks of layers, the pipeline schedule, the tensor-parallel
specs and the mapping backend. It is the one argument that
`jaxdp.init_state`, `jaxdp.make_train_step`,
`jaxdp.make_eval_step`, `jaxdp.make_diloco_step`,
`jaxdp.CheckpointManager.restore` and `jaxdp.place_state` take,
in place of the keywords each used to repeat. Every refusal of a pair of
settings lives here: the layout's own at construction, those of the layout
with a step's reduction and precision in `check_step`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jaxdp.sharding import pipelining
from jaxdp.core.checks import (
    check_not_donated,
    check_opt_state,
    check_optimizer,
    check_params,
    check_params_dtypes,
    check_state,
)
from jaxdp.sharding.legacy import accepts_legacy_keywords
from jaxdp.sharding.layout import (
    abstract_state,
    annotated_model_specs,
    assert_same_values,
    check_backend,
    check_layers,
    check_mesh_axis,
    check_zero_stage,
    data_mesh,
    data_size,
    layer_mask,
    make_layout,
    model_specs_for,
    place,
    replicated,
)
from jaxdp.core.precision import Precision, as_precision
from jaxdp.reductions import Resolved, init_state as reductions_init, resolve
from jaxdp.core.state import TrainState


class DataParallel(NamedTuple):
  """A checked layout (build it with `data_parallel`).

  Attributes:
    mesh: the device mesh the steps run on, as the caller made it (Explicit,
      Auto or mixed axes; the state and outputs live on it).
    axis_name: the data axis, or several (a tuple; hybrid sharding with
      `("replica", "data")`: ZeRO splits over the last, the gradient is
      all-reduced over all).
    zero_stage: 0 (replicated, DDP), 1 (optimizer state split), 2 (and the
      gradient) or 3 (and the parameters), over the last data axis.
    layers: the key path(s) of stacks of layers in the params (layer-wise
      ZeRO-3 and pipelines), or `None`.
    pipeline: a `jaxdp.Pipeline` over the mesh's stage axis, or `None`.
    param_specs: tensor-parallel `PartitionSpec`s of the params over the
      mesh's model axes (for `jaxdp.init_state`), or `None`.
    backend: `"shard_map"` or `"pmap"`.
  """

  mesh: Mesh
  axis_name: Any = "data"
  zero_stage: int = 0
  layers: Any = None
  pipeline: pipelining.Pipeline | None = None
  param_specs: Any = None
  backend: str = "shard_map"

  @property
  def replicas(self) -> int:
    """The number of data-parallel replicas: the product of the data axes' sizes."""
    return data_size(self.mesh, self.axis_name)

  @property
  def stage_axis(self) -> str | None:
    """The pipeline's stage axis, or `None` without a pipeline."""
    return None if self.pipeline is None else self.pipeline.axis_name

  def stage_stacks(self, params: Any) -> Any:
    """The params' tree of bools marking the stacks of layers split over the pipeline's stages (each stage
    holds a block of their layers), or `None` without a pipeline."""
    return None if self.pipeline is None else layer_mask(params, self.layers)


def data_parallel(
    mesh: Mesh | None = None,
    *,
    axis_name: Any = "data",
    zero_stage: int = 0,
    layers: Any = None,
    pipeline: pipelining.Pipeline | None = None,
    param_specs: Any = None,
    backend: str = "shard_map",
) -> DataParallel:
  """Checks a layout and returns it as a `DataParallel`.

  Args:
    mesh: the device mesh; default `jaxdp.data_mesh(axis_name=axis_name)`
      over every device. More axes than the data axes are left to the
      compiler (tensor parallelism), except a pipeline's stage axis.
    axis_name: the data axis (a str) or several (a tuple).
    zero_stage: 0, 1, 2 or 3 (see `jaxdp.sharding.layout`).
    layers: the stacks of layers (see `jaxdp.sharding.layerwise`): at stage 3
      split along one layer's dimensions and gathered one layer at a time;
      with a pipeline, split over the stages.
    pipeline: `jaxdp.pipeline`'s schedule over the mesh's stage axis.
    param_specs: the params' tree of model-axis `PartitionSpec`s
      (tensor parallelism), read by `jaxdp.init_state`.
    backend: `"shard_map"` (default) or `"pmap"` (one data axis, stage 0).

  Raises:
    ValueError, TypeError: a setting, or a pair of them, that cannot run;
      the message names the argument and the fix.
  """
  if mesh is None:
    mesh = data_mesh(axis_name=axis_name) if isinstance(axis_name, str) else None
  check_mesh_axis(mesh, axis_name)
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  check_zero_stage(zero_stage)
  check_backend(backend, mesh, axis_name)
  if backend == "pmap" and zero_stage:
    raise ValueError(
        "backend='pmap' passes the state unmapped (replicated), so it cannot hold a ZeRO-sharded state; "
        "use backend='shard_map' with zero_stage > 0."
    )
  check_layers(layers)
  if pipeline is not None:  # a stage axis without a pipeline is the step's refusal (check_step): a state may live there
    pipelining.check_pipeline(pipeline, mesh, axis_name, layers=layers, zero_stage=zero_stage, backend=backend)
  return DataParallel(mesh, axis_name, zero_stage, layers, pipeline, param_specs, backend)


def as_layout(value: Any, *, axis_name: Any = None) -> DataParallel:
  """`value` as a `DataParallel`: a layout as it is, a `Mesh` as `data_parallel(mesh)`, `None` as
  `data_parallel()` (every device on one `"data"` axis); `TypeError` for anything else."""
  if isinstance(value, DataParallel):
    return value
  if value is None or isinstance(value, Mesh):
    return data_parallel(value) if axis_name is None else data_parallel(value, axis_name=axis_name)
  raise TypeError(
      f"layout must be a jaxdp.DataParallel (from jaxdp.data_parallel(mesh, zero_stage=..., ...)), a "
      f"jax.sharding.Mesh or None, got {type(value).__name__}."
  )


def check_values(reduction: Resolved, precision: Precision, zero_stage: int = 0) -> None:
  """Refuses a reduction and a precision policy that do not go together (or with `zero_stage`); the pairs
  that need the mesh are `jaxdp.sharding.parallel.check_step`'s."""
  if reduction.mode == "none" and zero_stage:
    raise ValueError("reduction='none' keeps independent replicas, which a sharded (zero_stage > 0) state cannot "
                     "hold; use zero_stage=0.")
  if precision.loss_scaling is not None and reduction.mode == "none":
    raise ValueError(
        "loss_scaling with reduction='none': each replica skips on its own non-finite flag there, and one scale "
        "replicated over the replicas cannot follow them all. Use a reducing reduction ('mean', 'sum', "
        "'rank_mean'), or no loss_scaling."
    )
  if reduction.stateful and precision.reduce_dtype is not None:
    raise ValueError(
        f"{'compression=powersgd(...)' if reduction.compression is not None else 'a user reduction'} with "
        f"reduce_dtype={precision.reduce_dtype.name}: the precision policy's reduce dtype is for jaxdp's own "
        "all-reduce, which this reduction replaces; use one or the other (precision(reduce_dtype=None))."
    )


def check_stages_used(layout: DataParallel) -> None:
  """Refuses a step on a mesh with a `stage` axis but no pipeline (it would replicate the work over it)."""
  if layout.pipeline is None:
    pipelining.check_pipeline(None, layout.mesh, layout.axis_name, layers=layout.layers, zero_stage=layout.zero_stage,
                              backend=layout.backend)


def check_step(layout: DataParallel, reduction: Any, precision: Any) -> None:
  """Refuses a step's reduction (`jaxdp.reductions.Resolved`) and precision
  (`jaxdp.Precision`) that cannot run on `layout`: the pairwise refusals, in one place."""
  mode, zero, stateful = reduction.mode, layout.zero_stage, reduction.stateful
  what = "compression=powersgd(...)" if reduction.compression is not None else "a user reduction"
  check_values(reduction, precision, zero)
  if layout.layers is not None and zero == 3 and mode == "rank_mean":
    raise ValueError(
        "layers= at zero_stage=3 reduce-scatters a stacked layer's gradient inside the backward pass, where "
        "reduction='rank_mean' would need each replica's own mean first; use reduction='mean'."
    )
  if layout.pipeline is not None and mode == "none":
    raise ValueError(
        "reduction='none' with a pipeline is not supported: that step runs untyped (check_vma=False), and a pipeline "
        "needs the types to sum the gradient of the layers before the stack over the stages. Use reduction='mean'."
    )
  if stateful and layout.backend == "pmap":
    raise ValueError(
        f"{what} with backend='pmap': its state is per replica, split over the data axis, which pmap's replicated "
        "state cannot hold. Use backend='shard_map' (the default)."
    )
  if stateful and layout.pipeline is not None and reduction.compression is None:
    raise ValueError(
        "a user reduction with a pipeline: its state is made for each whole leaf, but a stage holds only its block "
        "of a stack's layers. Use a layout without a pipeline (ZeRO stages 0-3, or layer-wise ZeRO-3: "
        "jaxdp.scan_layers hands the reduction each stack's local gradient whole)."
    )
  if stateful and layout.pipeline is not None and zero == 3 and layout.pipeline.gather == "layer":
    raise ValueError(
        f"{what} with a ZeRO-3 pipeline with gather='layer': a stacked layer's gradient is reduce-scattered inside "
        "the pipeline's backward pass, one layer at a time, so no device ever holds the local gradient PowerSGD "
        "compresses. Use gather='step' (the stage's stacks are compressed layer by layer), or layer-wise ZeRO-3 "
        "without a pipeline (jaxdp.scan_layers hands PowerSGD each stack's local gradient whole)."
    )


@accepts_legacy_keywords("init_state", ("params", "optimizer", "layout"))
def init_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    layout: DataParallel | Mesh | None = None,
    *,
    model_state: Any = None,
    reduction: Any = None,
    precision: Any = None,
) -> TrainState:
  """Creates the training state and places it as `jaxdp.make_train_step` expects on `layout`.

  Args:
    params: the initial parameters (a pytree of arrays, the same on every
      process). Leaves that are `NamedSharding` arrays on the layout's
      mesh keep their split over its other (model) axes; a model library's
      partitioning boxes (linen's `nn.with_partitioning`) are unboxed and
      their model axes used, unless the layout has `param_specs`; their
      data axes are dropped (`zero_stage` places the state over those).
    optimizer: an optax `GradientTransformation`.
    layout: a `DataParallel` (`data_parallel`), a `Mesh` or
      `None` (every device on one `"data"` axis). At ZeRO stage 0 every
      leaf is replicated over the data axes (a full replica per device, as
      in DDP); 1 and 2 split the optimizer state over the last data axis; 3
      splits the parameters too (see `jaxdp.sharding.layout` for the dimension
      rule); stacks of layers are split along one layer's dimensions (never
      the layer axis), and over a pipeline's stage axis along their layer
      axis, as the pipelined step holds them.
    model_state: the model's non-trainable state (BatchNorm statistics), or
      `None`; replicated at every stage.
    reduction: the step's reduction (`jaxdp.reductions`): the state
      then holds its state in `compression` (PowerSGD's
      `jaxdp.reductions.compression.PowerSGDState`, a user reduction's stacked
      per replica), each replica's part split over the data axes.
    precision: the step's `jaxdp.Precision`: with `loss_scaling`
      the state's `loss_scale` holds its first scale, replicated.

  Returns:
    A `TrainState` of fresh buffers: a step that donates it never
    consumes the caller's `params`.
  """
  layout = as_layout(layout)
  mesh, axis_name, layers = layout.mesh, layout.axis_name, layout.layers
  check_params(params)
  check_optimizer(optimizer)
  resolved, policy = resolve(reduction), as_precision(precision)
  check_step(layout, resolved, policy)
  loss_scale = policy.init()
  params, model_specs = annotated_model_specs(params, layout.param_specs, mesh, axis_name)
  check_params_dtypes(params, "params")
  if jax.process_count() > 1:
    assert_same_values(params, model_state)
  # Host values are placed as the layout says (no leaf is ever whole on one device unless replicated there).
  abstract = abstract_state(params, optimizer, model_state, loss_scale)
  make_compression = lambda p: reductions_init(resolved, p, layout)  # noqa: E731
  abstract = abstract._replace(compression=jax.eval_shape(make_compression, params))
  state_layout = make_layout(abstract, mesh, axis_name, layout.zero_stage, model_specs, layers, layout.stage_axis)
  shardings = state_layout.shardings(mesh)
  params = place(params, jax.tree.map(
      # Kept only on this mesh's devices in this order (a mesh over the same devices reordered is another layout).
      lambda x, s: x.sharding if _is_global(x) and _same_devices(x.sharding.mesh, s.mesh) else s,
      params, shardings.params))
  model_state, loss_scale = place((model_state, loss_scale), replicated(mesh))
  # Copying inside the jit keeps outputs from aliasing the caller's arrays, which a donating step would consume.
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
  build = jax.jit(lambda p, m, s: TrainState.create(copy(p), optimizer, copy(m), copy(s), make_compression(p)),
                  out_shardings=shardings)
  return build(params, model_state, loss_scale)


def _same_devices(a: Any, b: Any) -> bool:
  return tuple(a.devices.flat) == tuple(b.devices.flat)


def _is_global(x: Any) -> bool:
  return isinstance(x, jax.Array) and isinstance(getattr(x, "sharding", None), NamedSharding) and (
      len(x.sharding.device_set) > 1
  )


@accepts_legacy_keywords("place_state", ("full_state", "optimizer", "layout"))
def place_state(full_state: TrainState, optimizer: optax.GradientTransformation,
                layout: DataParallel | Mesh | None = None) -> TrainState:
  """Places a state (gathered on the host, or placed in any other layout) in `layout`.

  Nothing is recomputed: each leaf is moved as it is, so
  `gather_state(place_state(full, ...))` equals `full` bitwise, on any
  device count, mesh shape and stage. Each process places only the shards of
  its own devices; with host arrays every process must pass the same values.

  Args:
    full_state: a `jaxdp.TrainState`, e.g. `jaxdp.gather_state(state)`.
    optimizer: the optax optimizer the state belongs to (its state's
      structure, shapes and dtypes are checked against `optimizer.init`).
    layout: the layout wanted (a `DataParallel`, a `Mesh` or
      `None`); its `param_specs` (default: read off `full_state.params`'
      shardings when they are on a mesh with the same axis names, else
      replicated) give the model-axis splits.
  """
  check_state(full_state, "full_state")
  check_not_donated(full_state, name="full_state")
  check_optimizer(optimizer)
  check_opt_state(full_state, optimizer, "full_state")
  layout = as_layout(layout)
  model_specs = model_specs_for(full_state.params, layout.param_specs, layout.mesh, layout.axis_name)
  state_layout = make_layout(full_state, layout.mesh, layout.axis_name, layout.zero_stage, model_specs)
  return place(full_state, state_layout.shardings(layout.mesh))
