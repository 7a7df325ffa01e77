"""DiLoCo (Douillard et al., 2023): exact data parallelism inside replica groups, an outer step every H steps.

The mesh has the data axes (`"data"`, D devices per group) and one more,
the outer axis (e.g. `"replica"`, R groups). One call of the step is one inner step
on every group: each group runs jaxdp's exact data-parallel step
(`jaxdp.train_step`, the weighted mean over the group's rows) on its
own rows of the global batch, with its own parameters and inner optimizer
state. Nothing crosses the outer axis then. Every `inner_steps` calls,
the outer sync: each group's delta `outer_params - inner_params_r` is
averaged over the outer axis, weighted by the group's summed example (or
token) weights over the period, the outer optimizer applies that average
as its gradient to `outer_params`, and every group restarts from the new
outer parameters (the inner optimizer states stay per group, as in the
paper).

Two jitted programs, picked on the host by the state's step count: the
inner step, and the inner step followed by the sync; each one's compiled
HLO shows its own collectives (`DiLoCoStep.comm_report`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxdp.core import checks as _checks
from jaxdp.runtime import host_inputs
from jaxdp.core.checks import check_int, check_optimizer
from jaxdp.sharding.layout import (
    Layout,
    annotated_model_specs,
    axis_names,
    check_mesh_axis,
    make_layout,
    manual_part,
    mesh_context,
    model_specs_of,
    place,
    replicated,
)
from jaxdp.core.loss import check_loss_fn
from jaxdp.core.loss_scaling import check_loss_scale
from jaxdp.core.precision import as_precision, summed_in
from jaxdp.core.randomness import check_unique_ids
from jaxdp.analysis.reports import Collective, collectives_from_hlo
from jaxdp.training.config import step_config
from jaxdp.sharding.legacy import accepts_legacy_keywords
from jaxdp.sharding import pipelining
from jaxdp.sharding.parallel import DataParallel, as_layout, check_step, data_parallel
from jaxdp.reductions import check_state as check_reduction_state, init_state as init_reduction_state, resolve
from jaxdp.core.state import TrainState
from jaxdp.training.step import train_step
from jaxdp.runtime.compiled import global_update_step

DELTA_DTYPES = (None, "bfloat16", "int8")
"""What the outer sync may communicate the delta in: `None` (the parameters' own dtype), bfloat16, or int8
(blocks of `INT8_BLOCK` values, each with a float32 scale)."""

INT8_BLOCK = 256
"""Values per float32 scale of an int8 delta (1.6% more bytes than the int8 values alone)."""


class DiLoCoState(NamedTuple):
  """The state of a DiLoCo run.

  Attributes:
    inner: a `jaxdp.TrainState` whose every leaf has a leading
      `[R]` dimension, one entry per replica group, split over the outer
      axis (the groups' parameters differ between syncs); each group's
      entry is laid out over the group's data (and stage and model) axes
      as `jaxdp.make_train_step` lays out a state on the layout: replicated
      at ZeRO stage 0, but for a stateful reduction's per-replica state in
      `inner.compression` (PowerSGD's errors), split over the data axes.
    outer_params: the global parameters, as of the last sync (replicated
      over the groups, laid out as one group's).
    outer_opt_state: the outer optimizer's state for `outer_params`.
    inner_step: int32 scalar, the number of inner steps run (calls of the
      step); the sync follows every `inner_steps`-th.
    period_weight: float32 `[R]`, each group's summed weight of the
      inner steps it applied since the last sync (its weight in the
      average of the deltas).
  """

  inner: TrainState
  outer_params: Any
  outer_opt_state: Any
  inner_step: Any
  period_weight: Any


def diloco_params(state: DiLoCoState) -> Any:
  """The outer (global) parameters: what to evaluate and to keep after training."""
  return state.outer_params


def default_outer_optimizer() -> optax.GradientTransformation:
  """The paper's outer optimizer: Nesterov SGD, learning rate 0.7, momentum 0.9."""
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def check_int8_groups(delta_dtype: Any, groups: int) -> None:
  """Refuses an int8 delta over more than 127 groups: each group's values are rounded to `127 // R` levels so
  that their int8 sum cannot overflow, and `R > 127` leaves none (every scale would divide by zero)."""
  if delta_dtype == jnp.int8 and groups > 127:
    raise ValueError(
        f"delta_dtype=jnp.int8 over {groups} replica groups: the int8 sum of R groups fits only with 127 // R "
        "levels per group, none for R > 127. Use delta_dtype=jnp.bfloat16 (or None), or at most 127 groups."
    )


def _model_axes(param_specs: Any) -> tuple[str, ...]:
  """The mesh axes a layout's `param_specs` name: tensor parallelism inside each group."""
  specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
  return tuple(dict.fromkeys(a for spec in specs for entry in spec if entry is not None for a in axis_names(entry)))


def _outer_axis(mesh: Mesh, axis_name: Any, model_axes: tuple[str, ...] = ()) -> str:
  """The mesh's one axis that is neither a data axis nor a model axis (the groups'), after checking there is
  exactly one."""
  check_mesh_axis(mesh, axis_name)
  data = axis_names(axis_name)
  others = [a for a in mesh.axis_names if a not in data and a not in model_axes]
  if not others:
    raise ValueError(
        f"DiLoCo without an outer axis: every axis of the mesh {mesh.axis_names} is a data axis of the layout. Build "
        f"a mesh with the groups' axis besides, e.g. jax.make_mesh((R, D), ('replica', {data[0]!r}), "
        "axis_types=(AxisType.Auto,) * 2) with jaxdp.data_parallel(mesh, axis_name="
        f"{data[0]!r}), or use jaxdp.make_train_step for exact data parallelism over every device."
    )
  if len(others) > 1:
    raise ValueError(
        f"mesh has axes {others} besides the data axes {data} and the model axes {list(model_axes)}; the groups' "
        "axis is the mesh's one axis that is neither: name the tensor-parallel axes in "
        "jaxdp.data_parallel(mesh, axis_name=..., param_specs=...) (the params' splits over them), or build the "
        "mesh over the groups' axis and the data axes only."
    )
  return others[0]


def _group_mesh(layout: Any) -> tuple[Mesh, str]:
  """The mesh of a DiLoCo layout and its outer axis (checked: one outer axis, the data axes, the model axes its
  `param_specs` name, a pipeline's stage axis, nothing else)."""
  model_axes = ()
  if isinstance(layout, Mesh) or layout is None:
    mesh, axis_name = layout, "data"
  elif isinstance(layout, DataParallel):
    mesh, axis_name, model_axes = layout.mesh, layout.axis_name, _model_axes(layout.param_specs)
    if layout.stage_axis is not None:
      model_axes = (*model_axes, layout.stage_axis)
    if layout.backend != "shard_map":
      raise ValueError(
          "make_diloco_step runs on shard_map: give it a jaxdp.data_parallel(mesh, axis_name=...) without "
          "backend='pmap'."
      )
  else:
    as_layout(layout)  # raises the TypeError that names what a layout is
  if mesh is None:
    raise ValueError("DiLoCo needs a mesh with the outer axis of its groups; pass jaxdp.data_parallel(mesh) with e.g. "
                     "jax.make_mesh((R, D), ('replica', 'data'), axis_types=(AxisType.Auto,) * 2).")
  return mesh, _outer_axis(mesh, axis_name, model_axes)


def outer_axis_of(layout: DataParallel | Mesh) -> str:
  """The axis of a DiLoCo layout's replica groups: its mesh's one axis that is not a data axis (`ValueError` if
  there is none, or more than one)."""
  return _group_mesh(layout)[1]


def _state_layouts(state: DiLoCoState, mesh: Mesh, outer_axis: str, layout: DataParallel,
                   model_specs: Any = None) -> tuple[Layout, DiLoCoState]:
  """`(group, shardings)`: the `Layout` of one group's entry of `inner` on the whole mesh, as
  `jaxdp.make_train_step` lays out a state on `layout` (ZeRO's splits over the group's data axes, a pipeline's
  over its stages, the model axes' as `model_specs` says, a reduction's state over the group's data axes), and
  where a DiLoCo state lives: each group's entry so, after the groups' axis; the outer parameters and optimizer
  state split over the data, stage and model axes alike (as one group's at the same ZeRO stage), replicated over
  the groups."""
  is_spec = lambda x: isinstance(x, P)  # noqa: E731
  split = lambda tree: make_layout(tree, mesh, layout.axis_name, layout.zero_stage, model_specs,  # noqa: E731
                                   layout.layers, layout.stage_axis)
  group = split(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), state.inner))
  inner = jax.tree.map(lambda spec: NamedSharding(mesh, P(outer_axis, *spec)), group.specs, is_leaf=is_spec)
  outer = split(TrainState(state.outer_params, state.outer_opt_state, state.inner_step)).specs
  as_sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
  return group, DiLoCoState(
      inner, jax.tree.map(as_sharding, outer.params, is_leaf=is_spec),
      jax.tree.map(as_sharding, outer.opt_state, is_leaf=is_spec), replicated(mesh), NamedSharding(mesh, P(outer_axis)),
  )


def _as_layout(layout: DataParallel | Mesh | None) -> DataParallel:
  """A DiLoCo layout as a `DataParallel` on its whole mesh (a `Mesh`: its data axis `"data"`)."""
  return layout if isinstance(layout, DataParallel) else data_parallel(layout, axis_name="data")


def _group_layout(mesh: Mesh, outer_axis: str, layout: DataParallel) -> DataParallel:
  """One replica group's layout: `layout` on the mesh's other axes at the first index of the outer axis (what a
  group's reduction state is made for, and what its step's settings are checked on)."""
  keep = [a for a in mesh.axis_names if a != outer_axis]
  devices = np.take(mesh.devices, 0, axis=mesh.axis_names.index(outer_axis))
  types = tuple(t for a, t in zip(mesh.axis_names, mesh.axis_types) if a != outer_axis)
  return data_parallel(Mesh(devices, tuple(keep), axis_types=types), axis_name=layout.axis_name,
                       zero_stage=layout.zero_stage, layers=layout.layers, pipeline=layout.pipeline,
                       param_specs=layout.param_specs)


@accepts_legacy_keywords("init_diloco_state", ("params", "inner_optimizer", "layout"))
def init_diloco_state(
    params: Any,
    inner_optimizer: optax.GradientTransformation,
    layout: DataParallel | Mesh | None = None,
    *,
    outer_optimizer: optax.GradientTransformation | None = None,
    model_state: Any = None,
    precision: Any = None,
    reduction: Any = None,
) -> DiLoCoState:
  """The state `make_diloco_step` expects, placed on `mesh`: every group starts from `params`.

  Args:
    params: the initial parameters (a pytree of arrays).
    inner_optimizer: the groups' optax optimizer (the step's).
    layout: a `jaxdp.DataParallel` (or a `Mesh`, its data axis
      `"data"`) whose mesh has the data axes inside a group, the model axes
      its `param_specs` name (tensor parallelism inside a group; the params
      are placed split over them as `jaxdp.init_state` places them), its
      pipeline's stage axis, and one more axis, the groups'
      (`outer_axis_of(layout)`), nothing else. Its ZeRO stage, `layers`
      and pipeline lay out each group's state as `jaxdp.init_state` does.
    outer_optimizer: the outer optimizer (the step's); default
      `default_outer_optimizer`.
    model_state: the model's non-trainable state, or `None`; each group
      keeps its own copy (it is not averaged at the sync).
    precision: the step's `jaxdp.Precision`: with `loss_scaling` each
      group's `inner.loss_scale` holds its first scale; each group's scale
      then follows its own steps (it is not averaged at the sync).
    reduction: the step's inner reduction: with a stateful one
      (`jaxdp.reductions.powersgd`, a user's) each group's
      `inner.compression` holds its state for the group's replicas, as
      `jaxdp.init_state` makes it on the group's devices; it carries on
      across syncs (PowerSGD's error feedback stays per replica).

  Returns:
    A `DiLoCoState` of fresh buffers.
  """
  build, shardings, params = _builder(params, inner_optimizer, layout, outer_optimizer, model_state, precision,
                                     reduction)
  return jax.jit(build, out_shardings=shardings)(params, model_state)


def _builder(params, inner_optimizer, layout, outer_optimizer, model_state, precision, reduction):
  """`(build(params, model_state) -> DiLoCoState, its shardings, params)`, the arguments checked (`params` without
  a model library's partitioning boxes, as `build` takes them)."""
  mesh, outer_axis = _group_mesh(layout)
  layout = _as_layout(layout)
  axis_name = layout.axis_name
  group, resolved = _group_layout(mesh, outer_axis, layout), resolve(reduction)
  # Tensor parallelism inside each group: the params' model-axis splits, as jaxdp.init_state reads them.
  params, model_specs = annotated_model_specs(params, getattr(layout, "param_specs", None), mesh, axis_name)
  check_optimizer(inner_optimizer, "inner_optimizer")
  outer_optimizer = default_outer_optimizer() if outer_optimizer is None else outer_optimizer
  check_optimizer(outer_optimizer, "outer_optimizer")
  _checks.check_params(params)
  _checks.check_params_dtypes(params, "params")
  r = mesh.shape[outer_axis]
  loss_scaling = as_precision(precision).loss_scaling

  def build(params, model_state):
    loss_scale = None if loss_scaling is None else loss_scaling.init()
    inner = TrainState.create(params, inner_optimizer, model_state, loss_scale=loss_scale,
                              compression=init_reduction_state(resolved, params, group))
    inner = jax.tree.map(lambda x: jnp.broadcast_to(x, (r, *jnp.shape(x))), inner)
    outer = jax.tree.map(jnp.copy, params)
    step, period_weight = jnp.zeros((), jnp.int32), jnp.zeros((r,), jnp.float32)
    return DiLoCoState(inner, outer, outer_optimizer.init(outer), step, period_weight)

  abstract = jax.eval_shape(build, params, model_state)
  return build, _state_layouts(abstract, mesh, outer_axis, layout, model_specs)[1], params


@accepts_legacy_keywords("abstract_diloco_state", ("params", "inner_optimizer", "layout"))
def abstract_diloco_state(
    params: Any,
    inner_optimizer: optax.GradientTransformation,
    layout: DataParallel | Mesh | None = None,
    *,
    outer_optimizer: optax.GradientTransformation | None = None,
    model_state: Any = None,
    precision: Any = None,
    reduction: Any = None,
) -> DiLoCoState:
  """The `DiLoCoState` `init_diloco_state` would build, as `jax.ShapeDtypeStruct`s with their
  shardings on the layout's mesh (what `jaxdp.CheckpointManager.restore_diloco` reads into); nothing is
  computed. `params` and `model_state` may be `ShapeDtypeStruct`s."""
  build, shardings, params = _builder(params, inner_optimizer, layout, outer_optimizer, model_state, precision,
                                     reduction)
  abstract = jax.eval_shape(build, params, model_state)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


class DiLoCoStep:
  """`step(state, batch, weights=None, rng=None) -> (state, metrics)`; built by `make_diloco_step`.

  `metrics` holds each group's metrics of `jaxdp.train_step` with a
  leading `[R]` dimension (`loss` the group's weighted mean, `weight`
  its summed weight, `skipped`...): the global weighted mean loss is
  `sum(loss * weight) / sum(weight)`. `metrics["synced"]` is 1 on a
  call that ended with the outer sync.
  """

  def __init__(self, settings, loss_fn, inner_optimizer, outer_optimizer, layout, outer_axis, inner_steps,
               delta_dtype, donate, max_consecutive_skips=None):
    self.settings, self.loss_fn = settings, loss_fn
    self.inner_optimizer, self.outer_optimizer = inner_optimizer, outer_optimizer
    self.layout, mesh = layout, layout.mesh
    self.mesh, self.outer_axis, self.axis_name = mesh, outer_axis, settings.axis_name
    self.inner_steps, self.delta_dtype, self.donate = inner_steps, delta_dtype, donate
    self.n_groups = mesh.shape[outer_axis]
    self.group_size = int(np.prod([mesh.shape[a] for a in axis_names(self.axis_name)]))
    self._group = _group_layout(mesh, outer_axis, layout)  # what a group's reduction state is made for
    # ZeRO or a pipeline inside the groups: make_train_step's sharded step, run by each group (global_update_step)
    self._sharded = layout.zero_stage > 0 or layout.pipeline is not None
    self._programs: dict = {}  # (sync, the state's entry id) -> jitted program
    self._last = (None, 0)  # (weak reference to the inner_step array last returned, its host value)
    # The host input layer's caches (jaxdp.runtime.host_inputs): checked once per signature, then only what values need.
    # The state's signature and model-axis splits -> (a small int, its shardings, its (shape, dtype) pairs, its
    # group's Layout).
    self._state_ids: dict = {}
    self._plans: dict = {}  # (state id, inputs' signature) -> the InputPlan of inputs validated once
    self._known = None  # the state the last call returned (KnownState): placed, unshared, checked
    self._placed_rng = host_inputs.PlacedKey()
    self._rows = NamedSharding(mesh, P((outer_axis, *axis_names(self.axis_name))))  # the batch's sharding
    # The exact step's non-finite guard (host_inputs.Guard's count on the devices, SkipWatch on the host): a call
    # whose step was non-finite in at least one group counts; max_consecutive_skips of them in a row stop the run.
    self.max_consecutive_skips = max_consecutive_skips
    # Each group counts its own (no collective between the groups in the inner step); the host reads the largest.
    self._skips = host_inputs.SkipWatch(
        max_consecutive_skips, "replica group",
        "that group skipped its update each time (the others applied theirs), so the state passed in holds every "
        "group's last good parameters.", read=host_inputs.read_max)
    self._skip_count = None  # the count on the devices, the next call's input (None: from zero)

  @property
  def consecutive_skips(self) -> int:
    """The calls in a row whose step was non-finite in at least one group, as of the last count read."""
    return self._skips.count

  def reset_nonfinite_guard(self) -> None:
    """Clears the count of consecutive non-finite steps, so that a tripped step runs again."""
    self._skips.reset()
    self._skip_count = None

  # Host side -------------------------------------------------------------------------------------

  def _count(self, state: DiLoCoState) -> int:
    ref, count = self._last
    if ref is not None and ref() is state.inner_step:
      return count  # the state this step returned: no wait for the device
    return int(jax.device_get(state.inner_step))

  def _check_state(self, state: Any) -> None:
    if not isinstance(state, DiLoCoState):
      raise TypeError(
          f"state must be a jaxdp.runtime.diloco.DiLoCoState, got {type(state).__name__}; build it with "
          "jaxdp.init_diloco_state(params, inner_optimizer, layout, outer_optimizer=...)."
      )

  def _check(self, state, batch, weights, rng) -> None:
    """Validates inputs of a new signature (shapes and structure, never values)."""
    _checks.check_state(state.inner, "state.inner")
    r = self.n_groups
    for path, leaf in jax.tree_util.tree_leaves_with_path((state.inner, state.period_weight)):
      if np.ndim(leaf) == 0 or np.shape(leaf)[0] != r:
        raise ValueError(
            f"state{'.inner' if path[0].idx == 0 else '.period_weight'}{jax.tree_util.keystr(path[1:])} has shape "
            f"{np.shape(leaf)}; every leaf of state.inner and state.period_weight needs a leading dimension of "
            f"{r}, the size of the outer axis {self.outer_axis!r}: build the state with jaxdp.init_diloco_state on this "
            "step's mesh."
        )
    group = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), state.inner)
    check_loss_scale(self.settings.loss_scaling, group.loss_scale, "state.inner")
    try:
      check_reduction_state(group.compression, group.params, self.settings.reduction, self._group,
                            "state.inner.compression")
    except ValueError as error:  # its fix names jaxdp.init_state, which makes a TrainState: DiLoCo's is another
      raise ValueError(f"{error} For DiLoCo, make the state with jaxdp.init_diloco_state(..., reduction=) with the "
                       "step's reduction.") from None
    _checks.check_step_inputs(
        self.loss_fn, self.inner_optimizer, group, batch, weights, rng, n_replicas=r * self.group_size,
        accum_steps=self.settings.accum_steps,
    )
    pipeline = self.layout.pipeline
    if pipeline is not None:
      pipelining.check_stacks(group.params, self.layout.layers, pipeline, self.mesh.shape[pipeline.axis_name])
      pipelining.check_rows(batch, pipeline, r * self.group_size, self.settings.accum_steps)
    if _checks.signature(jax.eval_shape(self.outer_optimizer.init, state.outer_params)) != _checks.signature(
        state.outer_opt_state):
      raise ValueError(
          "state.outer_opt_state does not match outer_optimizer.init(state.outer_params) in structure, shape or "
          "dtype: the state was built with another outer optimizer; pass the same outer_optimizer to "
          "jaxdp.init_diloco_state and jaxdp.make_diloco_step."
      )
    if _checks.signature(state.outer_params) != _checks.signature(group.params):
      raise ValueError("state.outer_params and each group's state.inner.params differ in structure, shape or dtype; "
                       "build the state with jaxdp.init_diloco_state.")

  def _prepare(self, state, batch, weights, rng):
    """Runs the host input layer (`jaxdp.runtime.host_inputs`) on one call's inputs.

    Returns `(shardings, args, leaves, treedef)`: the state's shardings, the program's arguments, the leaves
    of the state it gets and that state's structure.
    """
    weights = _checks.as_array(weights)
    _checks.check_padded_weights(batch, weights)  # identity lookups, and only without weights
    check_unique_ids(batch, weights, self.settings.example_ids)  # host ids only, and only with example_ids
    leaves, treedef = jax.tree.flatten(state)
    entry = host_inputs.known_state(self._known, leaves, treedef)  # the state the last call returned
    known = entry is not None
    if not known:
      self._check_state(state)
      host_inputs.check_state_donation(state, leaves)  # also a state another step has consumed
      # The layout follows the state's shapes and its outer params' splits over the model axes (kept as given).
      model_specs = model_specs_of(state.outer_params, self.mesh, self.axis_name)
      key = (_checks.signature(state), tuple(jax.tree.leaves(model_specs)))
      if key not in self._state_ids:
        self._state_ids[key] = (len(self._state_ids), None, None, None)
      entry = self._state_ids[key]
    _, inputs_key = host_inputs.input_signature(batch, weights, rng)
    host_inputs.agree_across_processes({"state": state, "batch": batch, "weights": weights, "rng": rng},
                                       "DiLoCo step inputs")
    plan = self._plans.get((entry[0], inputs_key))
    if plan is None:
      self._check(state, batch, weights, rng)
      if entry[1] is None:  # the state's shardings and kinds, once it is valid
        group, shardings = _state_layouts(state, self.mesh, self.outer_axis, self.layout, model_specs)
        entry = self._state_ids[key] = (entry[0], shardings, host_inputs.state_kinds(state), group)
      plan = self._plans[entry[0], inputs_key] = host_inputs.plan_inputs(batch, weights, None, self._rows, entry[2])
    _, shardings, kinds, _ = entry
    if not known:
      state = place(_checks.unshared_buffers(state) if self.donate else state, shardings)
      leaves = jax.tree.leaves(state)
    host_inputs.check_input_values(plan, batch, weights)  # each call: the values of host inputs only
    inputs = host_inputs.place_inputs(plan, (batch, weights, None), self._rows)
    if self.donate:
      inputs = host_inputs.unshare_inputs(plan, inputs, kinds, lambda: leaves)
    batch, weights, _ = inputs
    rng = self._placed_rng(rng, lambda key: place(key, replicated(self.mesh)))
    self._entry = entry
    return shardings, (state, batch, weights, rng), leaves, treedef

  def _program(self, sync: bool, shardings: DiLoCoState):
    """The program of the state `_prepare` placed last (its entry: its signature and model-axis splits)."""
    key = (sync, self._entry[0])
    if key not in self._programs:
      build = self._build_sharded if self._sharded else self._build
      self._programs[key] = build(sync, shardings)
    return self._programs[key]

  def _guard_input(self) -> Any:
    if self._skip_count is None:  # per group, split over the outer axis as the groups' state is
      self._skip_count = place(np.zeros((self.n_groups,), np.int32), NamedSharding(self.mesh, P(self.outer_axis)))
    return self._skip_count

  def __call__(self, state: DiLoCoState, batch: Any, weights: jax.Array | None = None, rng: jax.Array | None = None):
    self._skips.check()  # before anything is checked, placed or donated: a tripped step runs nothing
    shardings, prepared, leaves, treedef = self._prepare(state, batch, weights, rng)
    count = self._count(prepared[0])
    sync = (count + 1) % self.inner_steps == 0
    try:
      with mesh_context(self.mesh):  # one trace, in the context of the mesh its types name
        new_state, metrics, skips = self._program(sync, shardings)(*prepared, self._guard_input())
    except RuntimeError as error:  # JAX refuses a deleted input before it runs or donates anything
      host_inputs.raise_if_consumed(error, prepared[0])
      raise
    if self.donate:
      host_inputs.mark_donated(leaves)
    self._skip_count = skips
    self._skips.push(skips)
    self._last = (weakref.ref(new_state.inner_step), count + 1)
    # The output has the input's structure, shapes and shardings: the next call knows it.
    self._known = host_inputs.KnownState(jax.tree.leaves(new_state), treedef, self._entry, strong=True)
    return new_state, metrics

  def lower_inner(self, state, batch, weights=None, rng=None) -> jax.stages.Lowered:
    """The `jax.stages.Lowered` of the inner step (no sync) on these inputs."""
    shardings, prepared, *_ = self._prepare(state, batch, weights, rng)
    with mesh_context(self.mesh):
      return self._program(False, shardings).lower(*prepared, self._guard_input())

  def lower_sync(self, state, batch, weights=None, rng=None) -> jax.stages.Lowered:
    """The `jax.stages.Lowered` of the inner step followed by the outer sync."""
    shardings, prepared, *_ = self._prepare(state, batch, weights, rng)
    with mesh_context(self.mesh):
      return self._program(True, shardings).lower(*prepared, self._guard_input())

  def comm_report(self, state, batch, weights=None, rng=None, *, sync: bool, compiled: bool = True
                  ) -> dict[str, Collective]:
    """The collectives of the inner program (`sync=False`) or of the sync program, per device, as
    `jaxdp.comm_report` counts them: `compiled=True` reads the compiled HLO (on CPU, XLA widens a
    bfloat16 all-reduce to float32), `compiled=False` the HLO before optimisation (the dtypes jaxdp
    writes: the bytes GPU and TPU backends move)."""
    lowered = (self.lower_sync if sync else self.lower_inner)(state, batch, weights, rng)
    hlo = lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")
    return collectives_from_hlo(hlo, self.n_groups * self.group_size)

  def bytes_per_step(self, state, batch, weights=None, rng=None, *, field: str = "bytes", compiled: bool = True,
                     outer_only: bool = False) -> float:
    """Per-device collective bytes per call, averaged over an outer period: `((H - 1) * inner + sync) / H`.

    `field`: `"bytes"` (the buffers reduced or gathered, as
    `jaxdp.Collective` counts them) or `"traffic_bytes"` (ring
    traffic per device). `compiled`: as in `comm_report`.
    `outer_only`: only the collectives over the outer axis, `(sync -
    inner) / H` (the sync program is the inner one plus those), the bytes
    that cross between groups; the rest stay within a group.
    """
    if field not in ("bytes", "traffic_bytes"):
      raise ValueError(f"field must be 'bytes' or 'traffic_bytes', got {field!r}.")
    inner, sync = [sum(getattr(c, field) for c in self.comm_report(state, batch, weights, rng, sync=s,
                                                                   compiled=compiled).values())
                   for s in (False, True)]
    if outer_only:
      return (sync - inner) / self.inner_steps
    return ((self.inner_steps - 1) * inner + sync) / self.inner_steps

  # Device side -----------------------------------------------------------------------------------

  def _build(self, sync: bool, shardings: DiLoCoState):
    settings, outer_axis, outer_optimizer = self.settings, self.outer_axis, self.outer_optimizer
    delta_dtype = self.delta_dtype
    loss_fn, inner_optimizer = self.loss_fn, self.inner_optimizer

    limit = np.iinfo(np.int32).max if self.max_consecutive_skips is None else self.max_consecutive_skips

    def group_step(state: DiLoCoState, batch, weights, rng, skips):
      inner = jax.tree.map(lambda x: x[0], state.inner)  # this group's entry
      if rng is not None and settings.example_ids is None:  # the groups' rows differ: so do their keys
        rng = jax.random.fold_in(rng, lax.axis_index(outer_axis))
      # With example_ids every group keeps the key: each row's masks follow its id, wherever the row is.
      inner, metrics = train_step(loss_fn, inner_optimizer, inner, batch, weights, rng=rng, layout=settings.axis_name,
                                  reduction=settings.reduction, precision=settings.precision,
                                  accum_steps=settings.accum_steps, example_ids=settings.example_ids)
      applied = metrics["weight"].astype(jnp.float32) * (1 - metrics["skipped"]).astype(jnp.float32)
      period_weight = state.period_weight[0] + applied
      outer_params, outer_opt_state = state.outer_params, state.outer_opt_state
      if sync:
        outer_params, outer_opt_state, params = _outer_sync(outer_optimizer, outer_params, outer_opt_state,
                                                            inner.params, period_weight, outer_axis, delta_dtype)
        inner, period_weight = inner._replace(params=params), jnp.zeros_like(period_weight)
      new_state = DiLoCoState(
          jax.tree.map(lambda x: x[None], inner), outer_params, outer_opt_state, state.inner_step + 1,
          period_weight[None],
      )
      # The exact step's guard, per group: its non-finite steps in a row (stopped at the limit).
      skips = host_inputs.update_guard(host_inputs.Guard(skips[0], jnp.zeros((), jnp.int32)), metrics["nonfinite"],
                                       None, limit, None).skips
      metrics = {name: value[None] for name, value in metrics.items()}
      return new_state, metrics, skips[None]

    # Manual over the groups' and the data axes; model axes (tensor parallelism inside a group) left to the compiler.
    manual = (outer_axis, *axis_names(self.axis_name))
    specs = jax.tree.map(lambda s: manual_part(s.spec, manual), shardings)
    rows = P(manual)
    mapped = jax.shard_map(
        group_step, mesh=self.mesh, in_specs=(specs, rows, rows, P(), P(outer_axis)),
        out_specs=(specs, P(outer_axis), P(outer_axis)), axis_names=set(manual),
        # Untyped: the groups' parameters vary over the outer axis, and a typed step would take a loss varying
        # over an axis it does not reduce for a batch split over an unnamed axis (and refuse it). The outer
        # parameters are replicated by construction: computed from all-reduced values only.
        check_vma=False,
    )

    def program(state, batch, weights, rng, skips):
      new_state, metrics, skips = mapped(state, batch, weights, rng, skips)
      return new_state, {**metrics, "synced": jnp.asarray(int(sync), jnp.int32)}, skips

    skips = NamedSharding(self.mesh, P(outer_axis))
    return jax.jit(program, donate_argnums=(0,) if self.donate else (), out_shardings=(shardings, None, skips))

  def _build_sharded(self, sync: bool, shardings: DiLoCoState):
    """The program with ZeRO or a pipeline inside the groups: `jaxdp.make_train_step`'s step on such a layout
    (`global_update_step`: each group's reduced gradient in a map over the groups' and its own manual axes, the
    update on the global arrays, vmapped over the groups, so every optax optimizer sees whole leaves), then the
    sync in a map over the groups' axis alone (the outer update sees whole leaves too)."""
    outer_axis, outer_optimizer, delta_dtype = self.outer_axis, self.outer_optimizer, self.delta_dtype
    limit = np.iinfo(np.int32).max if self.max_consecutive_skips is None else self.max_consecutive_skips
    step = global_update_step(self.settings, self.loss_fn, self.inner_optimizer, self.mesh, self._entry[3],
                              check_vma=True, pipeline=self.layout.pipeline, group_axis=outer_axis)

    def sync_group(outer_params, outer_opt_state, inner_params, period_weight):
      outer_params, outer_opt_state, params = _outer_sync(
          outer_optimizer, outer_params, outer_opt_state, jax.tree.map(lambda x: x[0], inner_params),
          period_weight[0], outer_axis, delta_dtype)
      return outer_params, outer_opt_state, jax.tree.map(lambda x: x[None], params)

    # Manual over the groups' axis only: ZeRO's, the stages' and the model axes' splits are the compiler's.
    synced = jax.shard_map(sync_group, mesh=self.mesh, in_specs=(P(), P(), P(outer_axis), P(outer_axis)),
                           out_specs=(P(), P(), P(outer_axis)), axis_names={outer_axis},
                           check_vma=False)  # the outer state is replicated by construction, as in _build

    def program(state: DiLoCoState, batch, weights, rng, skips):
      inner, metrics = step(state.inner, batch, weights, rng, None)
      applied = metrics["weight"].astype(jnp.float32) * (1 - metrics["skipped"]).astype(jnp.float32)
      period_weight = state.period_weight + applied
      outer_params, outer_opt_state = state.outer_params, state.outer_opt_state
      if sync:
        outer_params, outer_opt_state, params = synced(outer_params, outer_opt_state, inner.params, period_weight)
        inner, period_weight = inner._replace(params=params), jnp.zeros_like(period_weight)
      new_state = DiLoCoState(inner, outer_params, outer_opt_state, state.inner_step + 1, period_weight)
      skips = host_inputs.update_guard(host_inputs.Guard(skips, jnp.zeros_like(skips)), metrics["nonfinite"], None,
                                       limit, None).skips  # per group, elementwise
      return new_state, {**metrics, "synced": jnp.asarray(int(sync), jnp.int32)}, skips

    skips = NamedSharding(self.mesh, P(outer_axis))
    return jax.jit(program, donate_argnums=(0,) if self.donate else (), out_shardings=(shardings, None, skips))


def _outer_sync(outer_optimizer, outer_params, outer_opt_state, inner_params, period_weight, outer_axis: str,
                delta_dtype):
  """Per group: the weighted average of the groups' deltas (one all-reduce over `outer_axis`), the outer
  update, and the group's restart from the new outer parameters: `(outer_params, outer_opt_state,
  inner_params)`."""
  total = lax.psum(period_weight, outer_axis)  # 4 bytes
  share = jnp.where(total > 0, period_weight / jnp.where(total > 0, total, 1.0), 0.0)

  narrow = delta_dtype not in (None, jnp.int8)  # a 16-bit float

  def contribution(outer, current):
    wide = jnp.promote_types(outer.dtype, jnp.float32)  # float64 parameters keep their precision
    delta = (outer - current).astype(wide) * share.astype(wide)
    # (summed in float32 where XLA's CPU backend would abort on a 16-bit sum: the same bits, see summed_in)
    return delta.astype(delta_dtype).astype(summed_in(delta_dtype)) if narrow else delta

  contributions = jax.tree.map(contribution, outer_params, inner_params)
  summed = _int8_psum(contributions, outer_axis) if delta_dtype == jnp.int8 else lax.psum(contributions, outer_axis)
  average = jax.tree.map(lambda d, p: (d.astype(delta_dtype) if narrow else d).astype(p.dtype), summed, outer_params)

  def update(operand):
    params, opt_state = operand
    updates, opt_state = outer_optimizer.update(average, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # No group applied an inner step over the period (all skipped): nothing to average, the outer state stays.
  outer_params, outer_opt_state = lax.cond(total > 0, update, lambda operand: operand,
                                           (outer_params, outer_opt_state))
  restarted = jax.tree.map(lambda p, q: p.astype(q.dtype), outer_params, inner_params)
  return outer_params, outer_opt_state, restarted


def _int8_psum(tree: Any, axis: str) -> Any:
  """`lax.psum(tree, axis)` of float32 leaves, communicated as int8: the leaves flattened into one vector, in
  blocks of `INT8_BLOCK` values.

  Each block's scale is its largest magnitude over every device (one all-reduce of the scales) over
  `127 // R`: each device's rounded values then lie in `[-(127 // R), 127 // R]` and their sum over the R
  devices fits int8, so the all-reduce itself runs in int8. Each value is off by at most half a scale step
  per device.
  """
  levels = 127 // lax.axis_size(axis)
  leaves, treedef = jax.tree.flatten(tree)
  flat = jnp.concatenate([x.reshape(-1) for x in leaves])
  blocks = jnp.pad(flat, (0, -flat.size % INT8_BLOCK)).reshape(-1, INT8_BLOCK)
  scales = lax.pmax(jnp.max(jnp.abs(blocks), axis=1), axis) / levels
  scales = jnp.where(scales > 0, scales, 1.0)[:, None]
  quantized = jnp.clip(jnp.round(blocks / scales), -levels, levels).astype(jnp.int8)
  summed = (lax.psum(quantized, axis).astype(jnp.float32) * scales).reshape(-1)
  offsets = np.cumsum([0] + [x.size for x in leaves])
  return jax.tree.unflatten(treedef, [summed[a:z].reshape(x.shape) for x, a, z in zip(leaves, offsets, offsets[1:])])


@accepts_legacy_keywords("make_diloco_step", ("loss_fn", "inner_optimizer", "layout"))
def make_diloco_step(
    loss_fn: Callable[..., Any],
    inner_optimizer: optax.GradientTransformation,
    layout: DataParallel | Mesh | None = None,
    *,
    inner_steps: int,
    outer_optimizer: optax.GradientTransformation | None = None,
    delta_dtype: Any = None,
    reduction: Any = None,
    precision: Any = None,
    accum_steps: int = 1,
    example_ids: Any = None,
    donate: bool = True,
    max_consecutive_skips: int | None = 10,
) -> DiLoCoStep:
  """Builds the DiLoCo step: exact data parallelism over the layout's data axes inside each replica group, and
  every `inner_steps` calls the outer sync across the groups.

  The groups lie along the mesh's one axis that is not a data axis (the
  outer axis, `outer_axis_of(layout)`). Rows of the global batch are split
  over `(outer axis, *data axes)`:
  group `r` gets the `r`-th of R contiguous blocks of rows, split over its
  devices as `jaxdp.make_train_step` splits a batch. Each call runs
  `jaxdp.train_step` on every group (the exact weighted mean of the
  group's rows, reduced over the group's data axes only). The call that
  completes a period of `inner_steps` then averages the groups' deltas
  `outer_params - inner_params_r` with weights proportional to each group's
  summed weight over the period (weight of skipped steps excluded), and the
  outer optimizer applies that average as its gradient. With this weighting,
  `inner_steps=1`, inner `optax.sgd(lr)` and outer `optax.sgd(1.0)`
  give the exact step of the global weighted mean (the weighted average of
  `lr * group mean gradient` is `lr` times the global mean gradient).

  Args:
    loss_fn: as for `jaxdp.make_train_step`.
    inner_optimizer: the groups' optax optimizer; each group keeps its own
      state, which the sync leaves as it is.
    layout: a `jaxdp.DataParallel` whose `axis_name` names the data
      axes inside a group (or a `Mesh`, its data axis `"data"`); its mesh
      has the model axes its `param_specs` name (the compiler partitions
      them as the state's params are split), its pipeline's stage axis, and
      one more axis, the R groups', and nothing else. With a ZeRO stage,
      `layers` or a pipeline each group runs `jaxdp.make_train_step`'s
      step on that layout (the update on the global arrays, vmapped over
      the groups: every optax optimizer sees whole leaves).
    inner_steps: H, the inner steps per outer sync (an int >= 1).
    outer_optimizer: applied to the averaged delta; default
      `default_outer_optimizer` (Nesterov SGD, lr 0.7, momentum 0.9).
    delta_dtype: the dtype the deltas are all-reduced in: `None` (the
      parameters' own), `jnp.bfloat16` (half the bytes of float32) or
      `jnp.int8` (a quarter: the leaves in one vector, with a float32
      scale per block of `INT8_BLOCK` values, the block's largest
      magnitude over the groups divided by `127 // R` so that the int8
      sum cannot overflow; refused for more than 127 groups). The
      weighting is applied before the cast.
    reduction, precision, accum_steps: the inner step's, as for
      `jaxdp.make_train_step` (`reductions.none()` is refused: a
      group must stay one replica). A reduction with a state
      (`jaxdp.reductions.powersgd`, a user's) compresses each group's
      inner all-reduce and needs the state made by
      `jaxdp.init_diloco_state(..., reduction=)`. A
      policy with `loss_scaling` needs the state made by
      `jaxdp.init_diloco_state(..., precision=)`: each group keeps its own
      scale (a group whose step overflows backs off and skips alone).
    example_ids: layout-invariant dropout, as for `jaxdp.make_train_step`:
      every group then uses the key as given (not folded with its index)
      and each row's masks follow its id, so with `inner_steps=1`, SGD
      inside and `optax.sgd(1.0)` outside the step is the exact step with
      the same `example_ids`. `None`: each group folds its index into the
      key.
    donate: donate the input state's buffers to the output state.
    max_consecutive_skips: as for `jaxdp.make_train_step`: a call
      whose inner step had a NaN/Inf gradient or loss in at least one group
      (that group skips its update, `metrics["skipped"]`, and adds no
      weight to the period) counts; after this many in a row the next call
      raises `FloatingPointError` before it runs or donates anything,
      until `step.reset_nonfinite_guard()`. `None` never raises.

  Returns:
    A `DiLoCoStep`.
  """
  inner_steps = check_int(inner_steps, "inner_steps", 1, "the number of inner steps between outer syncs (H).")
  mesh, outer_axis = _group_mesh(layout)
  layout = _as_layout(layout)
  axis_name = layout.axis_name
  settings = step_config(layout, reduction, precision, accum_steps, example_ids)._replace(group_axis=outer_axis)
  check_step(_group_layout(mesh, outer_axis, layout), settings.reduction, settings.precision)
  if settings.mode == "none":
    raise ValueError(
        "reduction='none' leaves each device of a group with its own update, but a DiLoCo group must stay one "
        "replica between syncs; use reduction='mean' (or 'sum', 'rank_mean')."
    )
  check_loss_fn(loss_fn)
  check_optimizer(inner_optimizer, "inner_optimizer")
  outer_optimizer = default_outer_optimizer() if outer_optimizer is None else outer_optimizer
  check_optimizer(outer_optimizer, "outer_optimizer")
  if delta_dtype is not None:
    try:
      name = jnp.dtype(delta_dtype).name
    except (TypeError, ValueError):
      name = None
    if name is None or name not in DELTA_DTYPES:
      raise ValueError(f"delta_dtype must be None, jnp.bfloat16 or jnp.int8, got {delta_dtype!r}.")
    delta_dtype = jnp.dtype(name)
  check_int8_groups(delta_dtype, mesh.shape[outer_axis])
  if not isinstance(donate, (bool, np.bool_)):
    raise TypeError(f"donate must be True or False, got {donate!r}.")
  if max_consecutive_skips is not None:
    check_int(max_consecutive_skips, "max_consecutive_skips", 1, "or None to never stop on skipped steps.")
  return DiLoCoStep(settings, loss_fn, inner_optimizer, outer_optimizer, layout, outer_axis, inner_steps,
                    delta_dtype, bool(donate), max_consecutive_skips)
