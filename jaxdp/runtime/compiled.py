"""The jitted data-parallel step: placement, `jit` and the mapping over the data axis.

`make_train_step` composes the pure functions of `jaxdp.training.step`:

- ZeRO stage 0: the whole `jaxdp.train_step` runs per replica inside
  `shard_map` (or `pmap`);
- stages 1-3: `jaxdp.gradient_step` runs per replica inside
  `shard_map` (the stage-3 all-gather of the parameters, the forward and
  backward pass, the all-reduce or reduce-scatter of the gradient), and
  `jaxdp.finish_step` runs on the global arrays: the optimizer sees
  every leaf whole, with its real shape, and XLA partitions the update as
  the state is sharded. Every optax optimizer (clipping by the global norm,
  LAMB's trust ratio, Adafactor's factored moments, Muon's matrix
  iterations) then gives stage 0's numbers.

Only the data axis is manual (`shard_map(..., axis_names={axis_name})`);
any other mesh axis (tensor parallelism) is left to the compiler. A
pipeline's stage axis is manual too (`jaxdp.sharding.pipelining`), and a
pipelined step takes the route of stages 1-3 at every stage.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxdp.core import checks as _checks
from jaxdp.runtime import host_inputs
from jaxdp.sharding import pipelining
from jaxdp.core.checks import check_int, check_optimizer
from jaxdp.reductions import check_state as check_reduction_state
from jaxdp.reductions.compression import PowerSGDState
from jaxdp.sharding.layout import (
    Layout,
    axis_names,
    constrain,
    data_size,
    data_dim,
    data_part,
    make_layout,
    manual_part,
    model_part,
    model_specs_of,
    mesh_context,
    place,
    replicated,
    split_along,
    zero_axis,
)
from jaxdp.core.loss import check_loss_fn, model_support
from jaxdp.core.loss_scaling import check_loss_scale
from jaxdp.core.randomness import check_unique_ids
from jaxdp.training.reduction import ReducedGradient
from jaxdp.training.replicas import divergence_over_mesh, replica_divergence
from jaxdp.training.config import StepConfig, step_config
from jaxdp.sharding.legacy import accepts_legacy_keywords
from jaxdp.sharding.parallel import DataParallel, as_layout, check_stages_used, check_step
from jaxdp.training.step import finish_step, gather_params, sharded_gradient_step, train_step
from jaxdp.core.state import TrainState

_COUNTS_READ_EVERY = 8  # the subnormal count of device weights is taken at most every this many calls,
_COUNTS_WAIT_CALLS = 8  # and read once done, or when it is this many calls old (then it waits for the device)


class CompiledStep:
  """A jitted data-parallel step: `step(state, batch, weights=None, rng=None) -> (state, metrics)`.

  Built by `make_train_step`. Inputs are validated on the host (shapes
  and structure only, once per signature) before anything runs or is
  donated, then placed on the mesh (`jaxdp.runtime.host_inputs`). A call with
  the state the previous call returned and inputs of a signature seen before
  does only what their values need, and dispatches one program. The step
  holds the leaves of the state it returned last until its next call (which
  donates them).
  `lower(...)` validates and places the same way and returns the
  `jax.stages.Lowered` of that program, for HLO and `memory_analysis()`.
  """

  def __init__(self, build, loss_fn, optimizer, layout: DataParallel, config: StepConfig, *,
               max_consecutive_skips: int | None, donate: bool = True):
    self._build, self.donate, self.layers, self.pipeline = build, donate, layout.layers, layout.pipeline
    self.layout_value, self.config = layout, config
    self.compression = config.compression
    self._stage_axis = layout.stage_axis
    mesh, axis_name = layout.mesh, layout.axis_name
    self._programs: dict = {}  # layout key -> the one program for states of that layout
    self._layouts: dict = {}  # layout key -> Layout
    self.loss_fn, self.optimizer = loss_fn, optimizer
    checks = [support.before_step(loss_fn) for support in model_support() if support.before_step is not None]
    self._before_step = [check for check in checks if check is not None]
    self.mesh, self.axis_name = mesh, axis_name
    self.reduction, self.backend = config.mode, layout.backend
    self.accum_steps, self.zero_stage = config.accum_steps, layout.zero_stage
    self.max_consecutive_skips = max_consecutive_skips
    self.loss_scaling = config.loss_scaling
    # The guards run on the devices (host_inputs.Guard, carried from program to program); the host reads:
    self._guard = None  # the latest Guard, the next call's input
    self._skips = host_inputs.SkipWatch(max_consecutive_skips)  # each call's count of non-finite steps in a row
    self._pending = self._skips.pending
    self._weight_counts = None  # the newest running count of subnormal device weights, not read yet
    self._counts_due = None  # (count, calls since taken): taken, not done yet
    self._calls_unread = _COUNTS_READ_EVERY  # calls since that count was last read (the first is read when ready)
    # The host input layer's caches (jaxdp.runtime.host_inputs): checked once per signature, then only what values need.
    self._plans: dict = {}  # (layout key, inputs' signature) -> the InputPlan of inputs validated once
    self._layout_ids: dict = {}  # the state's signature and model splits -> its layout key, a small int
    self._kinds: dict = {}  # layout key -> the state's (shape, dtype) pairs, for inputs that may alias it
    self._known = None  # the state the last call returned (KnownState): placed, unshared, checked
    self._placed_rng = host_inputs.PlacedKey()
    self._split = split_along(mesh, axis_name)  # the batch's sharding
    self._n = data_size(mesh, axis_name)
    self._per_device = _per_device_weights(mesh, self._split)
    self._traces = 0  # times JAX traced one of this step's programs (one per layout, once)

  @property
  def consecutive_skips(self) -> int:
    """The non-finite steps in a row, as of the last count read."""
    return self._skips.count

  def reset_nonfinite_guard(self) -> None:
    """Clears the count of consecutive non-finite steps, so that a tripped step runs again."""
    self._skips.reset()
    if self._guard is not None:  # the next call starts the count on the devices from zero
      self._guard = self._guard._replace(skips=None, padded=None)

  def _check_previous_weights(self) -> None:
    # Device weights below float32's smallest normal (the host's are refused before the step): counted on the
    # devices by the step's program (a running total), taken at the first call after device weights and then
    # every _COUNTS_READ_EVERY calls, read once done (never waiting for the device before it is
    # _COUNTS_WAIT_CALLS calls old): at the latest 16 calls after the step that counted them (one process only).
    due = self._counts_due
    if due is None:
      if self._weight_counts is None or self._calls_unread < _COUNTS_READ_EVERY:
        return
      due, self._weight_counts, self._calls_unread = (self._weight_counts, 0), None, 0
    counts, age = due
    if age < _COUNTS_WAIT_CALLS and not counts.is_ready():
      self._counts_due = (counts, age + 1)
      return
    self._counts_due = None
    count = host_inputs.read_total(counts)
    if count:
      self._weight_counts = None
      self._guard = self._guard._replace(subnormal=None)  # counted again from zero
      raise ValueError(_checks.subnormal_weights_message(
          "the weights (a JAX array) given to an earlier step", count,
          "that step counted their rows as padding (with no other weight it was skipped: metrics weight 0, "
          "skipped 1, nonfinite 0)", "This error comes from a later call, which ran nothing; the steps in "
          "between were applied."))

  def _check_previous_steps(self) -> None:
    self._check_previous_weights()
    self._skips.check()

  def _prepare(self, state, batch, weights, rng, has_more=None):
    """Runs the host input layer (`jaxdp.runtime.host_inputs`) on one call's inputs, in this order.

    Returns `(program, args, leaves, treedef, plan, layout_key)`: the program for the state's layout, its
    arguments (the state as its flat `leaves`), the leaves of the state it gets and that state's structure,
    the inputs' `InputPlan`, and the layout's key.
    """
    for check in self._before_step:  # a model library's (e.g. the model's mode must not have changed)
      check()
    weights, has_more = _checks.as_array(weights), _checks.as_array(has_more)
    _checks.check_padded_weights(batch, weights)  # identity lookups, and only without weights
    _checks.check_has_more(has_more)  # nothing without has_more
    check_unique_ids(batch, weights, self.config.example_ids)  # host ids only, and only with example_ids
    leaves, treedef = jax.tree.flatten(state)
    layout_key = host_inputs.known_state(self._known, leaves, treedef)  # the state the last call returned
    known, model_specs = layout_key is not None, None
    if not known:
      state, leaves, layout_key, model_specs = self._enter_state(state, leaves)
    _, inputs_key = host_inputs.input_signature(batch, weights, rng, has_more)
    # Every call, on every process: a process whose inputs differ must fail with the others.
    host_inputs.agree_across_processes(
        {"state": state, "batch": batch, "weights": weights, "rng": rng, "has_more": has_more}, "step inputs")
    plan = self._plans.get((layout_key, inputs_key))
    if plan is None:
      plan = self._plan(layout_key, inputs_key, model_specs, state, batch, weights, rng, has_more)
    if not known:
      state = place(state, self._layouts[layout_key].shardings(self.mesh))
      leaves = jax.tree.leaves(state)
    rng = self._placed_rng(rng, lambda key: place(key, replicated(self.mesh)))
    host_inputs.check_input_values(plan, batch, weights)  # each call: the values of host inputs only
    inputs = host_inputs.place_inputs(plan, (batch, weights, has_more), self._split)
    if self.donate:
      inputs = host_inputs.unshare_inputs(plan, inputs, self._kinds[layout_key], lambda: leaves)
    batch, weights, has_more = inputs
    guard = host_inputs.fresh_guard(
        self._guard, skips=self.max_consecutive_skips is not None, weights=plan.floating_weights,
        place_scalar=lambda x: place(x, replicated(self.mesh)), place_split=lambda x: place(x, self._split),
        n=self._n)
    if self._guard is None:
      self._guard = host_inputs.Guard()
    # The state goes in as its flat leaves (already flattened here): JAX does not flatten the tree again.
    args = (leaves, batch, weights, rng, has_more, guard)
    return self._program_for(layout_key, treedef), args, leaves, treedef, plan, layout_key

  def _enter_state(self, state, leaves):
    """A state this step did not just return: checked, unshared and keyed by its layout (not yet placed)."""
    _checks.check_state(state)
    host_inputs.check_state_donation(state, leaves)  # also a state another step has consumed
    if self.donate:
      state = _checks.unshared_buffers(state)
    # The layout follows the state's shapes and its params' splits over the model axes (kept as given).
    model_specs = model_specs_of(state.params, self.mesh, self.axis_name)
    key = (_checks.signature(state), tuple(jax.tree.leaves(model_specs)))
    # A small int stands for the (long) key in every cache: hashed on each call.
    layout_key = self._layout_ids.setdefault(key, len(self._layout_ids))
    return state, leaves, layout_key, model_specs

  def _plan(self, layout_key, inputs_key, model_specs, state, batch, weights, rng, has_more):
    """Validates inputs of a new signature (shapes and structure, never values) and returns their plan."""
    n = data_size(self.mesh, self.axis_name)
    _checks.check_step_inputs(
        self.loss_fn, self.optimizer, state, batch, weights, rng, n_replicas=n, accum_steps=self.accum_steps,
    )
    check_loss_scale(self.loss_scaling, state.loss_scale)
    check_reduction_state(state.compression, state.params, self.config.reduction, self.layout_value)
    if has_more is not None and self.reduction == "none":
      raise ValueError(
          "has_more is summed over the replicas in the step's all-reduce, and reduction='none' has none: every "
          "process would learn only its own flag and the streams would stop at different steps. Use a reducing "
          "step (reduction='mean', 'sum' or 'rank_mean') with a StreamingPipeline."
      )
    if has_more is not None and np.shape(has_more) != (n,):
      raise ValueError(
          f"has_more has shape {np.shape(has_more)}; pass one count per device of the data axis, shape ({n},) "
          "(jaxdp.StreamingPipeline yields it), or None."
      )
    if self.pipeline is not None:
      pipelining.check_stacks(state.params, self.layers, self.pipeline, self.mesh.shape[self._stage_axis])
      pipelining.check_rows(batch, self.pipeline, n, self.accum_steps)
    if layout_key not in self._layouts:
      self._layouts[layout_key] = make_layout(state, self.mesh, self.axis_name, self.zero_stage, model_specs,
                                              self.layers, self._stage_axis)
      self._kinds[layout_key] = host_inputs.state_kinds(state)  # the state's (shape, dtype) pairs
    plan = host_inputs.plan_inputs(batch, weights, has_more, self._split, self._kinds[layout_key])
    self._plans[layout_key, inputs_key] = plan
    return plan

  def _program_for(self, layout_key, treedef):
    """The one program of a layout (its state's structure is `treedef`, part of the layout's key): the jitted
    step, its state flat in and out, and the guards."""
    if layout_key not in self._programs:
      self._programs[layout_key] = _program(self._build(self._layouts[layout_key]), treedef, self._per_device,
                                            self.donate, self.max_consecutive_skips, self._traced)
    return self._programs[layout_key]

  def _traced(self) -> None:
    self._traces += 1  # the program's Python runs only when JAX traces it

  def layout(self, state: TrainState) -> Layout:
    """The `jaxdp.sharding.layout.Layout` this step places `state` in (model splits kept, ZeRO's added)."""
    return self.layout_at(state, self.zero_stage)

  def layout_at(self, state: TrainState, zero_stage: int) -> Layout:
    """The layout of `state` on this step's mesh at `zero_stage`."""
    return make_layout(state, self.mesh, self.axis_name, zero_stage,
                       model_specs_of(state.params, self.mesh, self.axis_name), self.layers, self._stage_axis)

  def __call__(
      self,
      state: TrainState,
      batch: Any,
      weights: jax.Array | None = None,
      rng: jax.Array | None = None,
      *,
      has_more: jax.Array | None = None,
  ):
    self._check_previous_steps()
    program, args, leaves, treedef, plan, layout_key = self._prepare(state, batch, weights, rng, has_more)
    try:
      with mesh_context(self.mesh):  # one trace, in the context of the mesh its types name
        new_leaves, metrics, guard = program(*args)
    except RuntimeError as error:  # JAX refuses a deleted input before it runs or donates anything
      host_inputs.raise_if_consumed(error, treedef.unflatten(args[0]))
      raise
    if self.donate:
      host_inputs.mark_donated(leaves)
    self._guard = host_inputs.Guard(*(new if new is not None else old for new, old in zip(guard, self._guard)))
    self._skips.push(guard.skips, guard.padded)
    if plan.device_weights and jax.process_count() == 1:
      # Not read here (that would wait for the device): read by a later call. With several processes each
      # would see only its devices' counts, and one raising alone would leave the others waiting in the next
      # step's all-reduce: not checked there.
      self._weight_counts, self._calls_unread = guard.subnormal, self._calls_unread + 1
    # The output has the input's structure, shapes and layout: the next call knows it.
    self._known = host_inputs.KnownState(new_leaves, treedef, layout_key, strong=True)
    return treedef.unflatten(new_leaves), metrics

  def lower(
      self,
      state: TrainState,
      batch: Any,
      weights: jax.Array | None = None,
      rng: jax.Array | None = None,
      *,
      has_more: jax.Array | None = None,
  ) -> jax.stages.Lowered:
    """The `jax.stages.Lowered` of the program a call with these inputs runs (validated and placed alike)."""
    program, args, *_ = self._prepare(state, batch, weights, rng, has_more)
    with mesh_context(self.mesh):
      return program.lower(*args)


def _program(jitted: Callable, treedef: Any, per_device: Callable, donate: bool, limit: int | None,
             traced: Callable[[], None]) -> Callable:
  """The step's one program per layout: `jitted` (the step) on the state given as its flat list of leaves (of
  structure `treedef`), its new state as a flat list too (the host flattened the state once and rebuilds the
  new one without flattening it again), its metrics, and the guards' state after the step
  (`jaxdp.runtime.host_inputs.Guard`). The inner jit is inlined: one dispatch per call."""

  def run(leaves, batch, weights, rng, has_more, guard):
    traced()
    new_state, metrics, flag = jitted(treedef.unflatten(leaves), batch, weights, rng, has_more)
    return jax.tree.leaves(new_state), metrics, host_inputs.update_guard(guard, flag, weights, limit, per_device)

  return jax.jit(run, donate_argnums=(0,) if donate else ())


def _per_device_weights(mesh: Mesh, sharding: NamedSharding) -> Callable[[jax.Array], tuple]:
  """`per_device(weights) -> (zero_rows, subnormal)`, one int32 per device of the data axes, split like the
  weights: whether the device has a row of weight 0 (padding), and how many of its weights lie in (0,
  float32's smallest normal), which the devices read as 0 (read from the bits). No collective: traced into
  the step's own program, summed on the host when a later call reads it."""

  def count(w):
    if not jax.dtypes.issubdtype(w.dtype, np.floating):
      return jnp.zeros((1,), jnp.int32)
    if w.dtype == np.float64:  # 64-bit mode: such values are normal in float64
      return jnp.sum((w > 0) & (w < _checks.SMALLEST_WEIGHT), dtype=jnp.int32)[None]
    if w.dtype == jnp.bfloat16:  # float32's exponent range: its bits are float32's upper half
      bits = lax.bitcast_convert_type(w, jnp.uint16).astype(jnp.uint32) << np.uint32(16)
    elif w.dtype == np.float32:
      bits = lax.bitcast_convert_type(w, jnp.uint32)
    else:  # float16: every value is a normal float32 (8-bit floats are not checked)
      return jnp.zeros((1,), jnp.int32)
    exponent, mantissa, sign = np.uint32(0x7F800000), np.uint32(0x007FFFFF), np.uint32(0x80000000)
    return jnp.sum(((bits & exponent) == 0) & ((bits & mantissa) != 0) & ((bits & sign) == 0), dtype=jnp.int32)[None]

  def local(w):
    rows = w.reshape(w.shape[0], -1)
    zero_rows = (jnp.any(jnp.all(rows == 0, axis=1)) if w.shape[0] else jnp.asarray(False)).astype(jnp.int32)
    return zero_rows[None], count(w)

  spec = P(sharding.spec[0])
  return jax.shard_map(local, mesh=mesh, in_specs=sharding.spec, out_specs=(spec, spec), check_vma=False)


@accepts_legacy_keywords("make_train_step", ("loss_fn", "optimizer", "layout"))
def make_train_step(
    loss_fn: Callable[..., jax.Array],
    optimizer: optax.GradientTransformation,
    layout: DataParallel | Mesh | None = None,
    *,
    reduction: Any = None,
    precision: Any = None,
    accum_steps: int = 1,
    example_ids: Any = None,
    max_consecutive_skips: int | None = 10,
    donate: bool = True,
    check_replicas: bool = False,
) -> CompiledStep:
  """Builds the jitted step that runs `train_step` on every device of the layout's data axes.

  Args:
    loss_fn: `loss_fn(params, batch)` returning per-example losses `[b]`
      or per-token losses `[b, t]`, or a `jaxdp.LossOutput` (see
      `jaxdp.core.loss`).
    optimizer: an optax `GradientTransformation`.
    layout: a `jaxdp.DataParallel` (`jaxdp.data_parallel`: the
      mesh, its data axes, the ZeRO stage, layer stacks, a pipeline, the
      backend), a `Mesh` (`data_parallel(mesh)`), or `None` (every
      device on one `"data"` axis). Only the data axes (and a pipeline's
      stage axis) are manual in the step; the compiler partitions any other
      axis as the parameters' shardings say, and the batch is replicated
      over them. At ZeRO stages 1-3 the optimizer sees whole leaves (the
      update runs on the global arrays, partitioned as the state is
      sharded), so every optax optimizer gives stage 0's numbers. Any state
      of the right structure is accepted: one laid out otherwise (another
      stage, device count or mesh) is moved into this layout first.
    reduction: a `jaxdp.reductions.Reduction` (default
      `jaxdp.reductions.mean`, exact); see `jaxdp.train_step`.
    precision: a `jaxdp.Precision` (default: the params' dtypes, no
      loss scaling); a policy with `loss_scaling` needs the state made by
      `jaxdp.init_state(..., precision=)`, and `metrics["loss_scale"]`
      reports the scale each step used.
    accum_steps: gradient accumulation: each device's slice is split into
      this many contiguous micro-batches, scanned, and reduced once per step.
    example_ids: layout-invariant dropout (see `jaxdp.core.randomness`):
      the key of each row's global id in a dict batch (e.g. `"id"`) or a
      callable `batch -> [b]` integer ids. `loss_fn` then gets
      `fold_in(rng, state.step)` on every replica and micro-batch, and
      `jaxdp.adapters.nnx.Dropout` / `jaxdp.adapters.linen.Dropout` draw each
      row's mask from its id: the same masks on any mesh, split and
      `accum_steps`, and as one device's. A library's own `Dropout`
      (linen's, nnx's) is refused with it.
    max_consecutive_skips: a step whose gradient or loss is NaN/Inf on any
      replica is skipped by every replica (`metrics["skipped"]`). After
      this many such steps in a row the next call raises
      `FloatingPointError` (before running anything), and so does every
      call until `step.reset_nonfinite_guard()`. `None` never raises.
      The check reads earlier steps' flags once they are done and never
      waits for the previous step's, so dispatch stays asynchronous: the
      error comes one call after the limit is reached when the steps keep
      up, at the latest three calls after.
    donate: donate the input state's buffers to the output state.
    check_replicas: add `metrics["replica_divergence"]` (see
      `jaxdp.replica_divergence`), computed in the graph over every
      mesh axis that holds copies of a leaf: the data axes, a model axis
      for a leaf not split over it, `"replica"` for a hybrid ZeRO chunk.

  Returns:
    A `CompiledStep` `step(state, batch, weights=None, rng=None) ->
    (state, metrics)`; with `rng` (a PRNG key) `loss_fn` is called as
    `loss_fn(params, batch, key)` with a key per replica, step and
    micro-batch (one key for all with `example_ids`).
  """
  layout = as_layout(layout)
  config = step_config(layout, reduction, precision, accum_steps, example_ids)
  check_step(layout, config.reduction, config.precision)
  check_stages_used(layout)
  _check_step_arguments(loss_fn, optimizer, max_consecutive_skips, donate, check_replicas)
  return _built_train_step(config, layout, loss_fn, optimizer, donate=donate, check_replicas=check_replicas,
                           max_consecutive_skips=max_consecutive_skips)


def _check_step_arguments(loss_fn, optimizer, max_consecutive_skips: Any, donate: Any, check_replicas: Any) -> None:
  """Checks `make_train_step`'s arguments beyond the layout, reduction and precision."""
  check_loss_fn(loss_fn)
  check_optimizer(optimizer)
  if max_consecutive_skips is not None:
    check_int(max_consecutive_skips, "max_consecutive_skips", 1, "or None to never stop on skipped steps.")
  for name, flag in (("donate", donate), ("check_replicas", check_replicas)):
    if not isinstance(flag, (bool, np.bool_)):  # donate="no" would donate
      raise TypeError(f"{name} must be True or False, got {flag!r}.")


def _built_train_step(settings: StepConfig, layout_value: DataParallel, loss_fn, optimizer, *, donate: bool,
                      check_replicas: bool, max_consecutive_skips: int | None) -> CompiledStep:
  """The `CompiledStep` of checked arguments: it builds one jitted step per state layout."""
  axis_name, reduction = settings.axis_name, settings.mode
  mesh, backend, pipeline = layout_value.mesh, layout_value.backend, layout_value.pipeline
  # Typed on any number of devices, so that a program that fails at scale fails on one device too. Under
  # "none" every replica keeps its own update, which the types would refuse to return as one state.
  check_vma = reduction != "none"
  values = dict(layout=axis_name, reduction=settings.reduction, precision=settings.precision,
                accum_steps=settings.accum_steps, example_ids=settings.example_ids)

  def replica_step(state, batch, weights, rng, has_more):
    new_state, metrics = train_step(loss_fn, optimizer, state, batch, weights, rng=rng, has_more=has_more, **values)
    if reduction == "none":
      # Each replica's metrics are its own, and the host reads device 0's: the non-finite guard must see a NaN
      # on any replica (one 4-byte all-reduce), else a replica stuck on non-finite steps goes unnoticed.
      metrics["nonfinite"] = lax.pmax(metrics["nonfinite"], axis_name)
    if check_replicas and backend == "pmap":  # pmap's mesh has the data axis only
      metrics["replica_divergence"] = replica_divergence(new_state, axis_name)
    return new_state, metrics

  def build(layout: Layout):
    if backend == "pmap":
      return jax.jit(_with_guard_flag(_pmap_over(replica_step, mesh, axis_name)), donate_argnums=(0,) if donate else ())
    if settings.zero_stage == 0 and pipeline is None:
      mapped = _shard_map_over(replica_step, mesh, axis_name, layout, check_vma=check_vma)
    else:  # a pipeline at every stage: the grad norm, clipping and the skip see every stage's layers
      mapped = global_update_step(settings, loss_fn, optimizer, mesh, layout, check_vma=check_vma,
                                  pipeline=pipeline)
    if check_replicas:
      mapped = _with_divergence(mapped, layout, mesh)
    # The outputs keep the layout exactly (model-axis splits included), so the next call needs no placement.
    return jax.jit(
        _with_guard_flag(mapped), donate_argnums=(0,) if donate else (),
        out_shardings=(layout.shardings(mesh), replicated(mesh), replicated(mesh)),
    )

  return CompiledStep(build, loss_fn, optimizer, layout_value, settings, max_consecutive_skips=max_consecutive_skips,
                      donate=donate)


def _manual_specs(layout: Layout, axis_name: str) -> TrainState:
  """The state's specs as `shard_map` sees them with only the data axis manual."""
  specs = jax.tree.map(lambda s: data_part(s, axis_name), layout.specs)
  # The compression state names the data axes only (each error split over all of them): kept whole.
  return specs._replace(compression=layout.specs.compression)


def _shard_map_over(replica_step, mesh: Mesh, axis_name: str, layout: Layout, *, check_vma: bool):
  """The whole step per replica (stage 0): `shard_map` over the data axis, other axes left to the compiler."""
  specs = _manual_specs(layout, axis_name)
  batch_spec = split_along(mesh, axis_name).spec
  return jax.shard_map(
      replica_step,
      mesh=mesh,
      in_specs=(specs, batch_spec, batch_spec, P(), batch_spec),
      out_specs=(specs, P()),
      axis_names=set(axis_names(axis_name)),
      # "none" returns replicas that differ on purpose, which the check would reject.
      check_vma=check_vma,
  )


def _with_guard_flag(step):
  """`step` returning `(state, metrics, flag)`: `flag` a buffer of its own with `metrics["nonfinite"]`."""

  def flagged(*args):
    new_state, metrics = step(*args)
    return new_state, metrics, metrics["nonfinite"]

  return flagged


def _with_divergence(step, layout: Layout, mesh: Mesh):
  """`step` with `metrics["replica_divergence"]` of its new state, over every mesh axis that holds copies."""

  def checked(*args):
    new_state, metrics = step(*args)
    return new_state, {**metrics, "replica_divergence": divergence_over_mesh(new_state, layout.specs, mesh)}

  return checked


def global_update_step(settings: StepConfig, loss_fn, optimizer, mesh: Mesh, layout: Layout, *, check_vma: bool,
                       pipeline: pipelining.Pipeline | None = None, group_axis: str | None = None):
  """ZeRO stages 1-3 (and any stage with a pipeline): the reduced gradient per replica (and stage), then the
  update on the global (sharded) arrays.

  `group_axis` (DiLoCo's replica groups, `jaxdp.runtime.diloco`): every leaf of the state (laid out by `layout`
  within a group) has a leading dimension of the groups, split over that mesh axis, and the batch's rows are
  split over it before the data axes; each group runs this step on its own entry and rows (its reductions
  stay within the group), the update is vmapped over the groups, and the metrics get the leading dimension.
  """
  axis_name, stage = settings.axis_name, layout.zero_stage
  specs = _manual_specs(layout, axis_name)
  batch_spec = split_along(mesh, axis_name).spec
  grouped = _grouped(group_axis)
  is_spec = lambda x: isinstance(x, P)  # noqa: E731
  if group_axis is not None:
    batch_spec = P((group_axis, *axis_names(axis_name)))
  # Full specs (model axes too): the data-axis gather and scatter then run per model shard.
  params_split = layout.split_specs if stage == 3 else None
  grads_split = layout.split_specs if stage >= 2 else None
  params_specs, grad_specs, manual, run = specs.params, layout.grad_specs, set(axis_names(axis_name)), sharded_gradient_step
  if pipeline is not None:
    # Manual over the stage axis too: each stage sees its block of the stacks; the loss's scan_layers pipelines it.
    stage_axis = pipeline.axis_name
    manual.add(stage_axis)
    kept = (stage_axis, zero_axis(axis_name))
    params_specs = jax.tree.map(lambda s: manual_part(s, kept), layout.specs.params)
    grad_specs = jax.tree.map(lambda s: manual_part(s, kept), layout.split_specs if stage >= 2 else layout.specs.params)
    if grads_split is not None:  # the scatter's specs as a stage sees its block: no stage axis
      grads_split = jax.tree.map(lambda s: model_part(s, stage_axis), grads_split)
    if params_split is not None:  # stage 3: the gather's specs, likewise
      params_split = jax.tree.map(lambda s: model_part(s, stage_axis), params_split)
    run = _pipelined(pipeline, mesh, axis_name, layout)
  if group_axis is not None:
    manual.add(group_axis)
  # Stacked leaves gathered one layer at a time inside the loss: layer-wise ZeRO-3, and a ZeRO-3 pipeline with
  # gather="layer"; a ZeRO-3 pipeline with gather="step" gathers the stage's block once, before the schedule.
  stacked = layout.layers if pipeline is None or (stage == 3 and pipeline.gather == "layer") else None

  def per_replica(state, batch, weights, rng, has_more):
    if group_axis is not None:  # this group's entry
      state = jax.tree.map(lambda x: x[0], state)
      if rng is not None and settings.example_ids is None:  # the groups' rows differ: so do their keys
        rng = jax.random.fold_in(rng, lax.axis_index(group_axis))
    reduced = run(
        settings, loss_fn, state, batch, weights, rng=rng, has_more=has_more, params_split=params_split,
        grads_split=grads_split, divide=False, stacked=stacked,
    )
    return reduced if group_axis is None else jax.tree.map(lambda x: x[None], reduced)

  state_specs = jax.tree.map(grouped, TrainState(params_specs, None, P(), P(), P(), compression=specs.compression),
                             is_leaf=is_spec)
  reduced_specs = jax.tree.map(grouped, ReducedGradient(grad_specs, P(), P(), P(), P(), P(), P(),
                                                        compression=specs.compression), is_leaf=is_spec)
  gradient = jax.shard_map(
      per_replica,
      mesh=mesh,
      in_specs=(state_specs, batch_spec, batch_spec, P(), batch_spec),
      out_specs=reduced_specs,
      axis_names=manual,
      check_vma=check_vma,
  )
  if pipeline is not None and pipeline.repeats > 1:
    gradient = _in_circular_order(gradient, pipeline, mesh, layout, grad_specs, group_axis)
  gather = None
  # The update is computed split where the gradient (stage 2) or the optimizer state is split (XLA slices the
  # replicated parameters); at stage 1 an optimizer without state (SGD) updates the replicated parameters and
  # has nothing to gather.
  state_split = any(data_dim(spec, axis_name) is not None for spec in jax.tree.leaves(
      layout.specs.opt_state, is_leaf=lambda x: isinstance(x, P)))
  if stage == 2 or (stage == 1 and state_split):
    # The updated parameters, computed split, are gathered by jaxdp in flat buckets (without bucket_bytes,
    # the small leaves in one all-gather): XLA would place one all-gather per leaf.
    split_shardings = jax.tree.map(lambda s: NamedSharding(mesh, grouped(s)), layout.split_specs, is_leaf=is_spec)

    def gather_group(params):
      if group_axis is None:
        return gather_params(params, layout.split_specs, axis_name, settings.bucket_bytes)
      gathered = gather_params(jax.tree.map(lambda x: x[0], params), layout.split_specs, axis_name,
                               settings.bucket_bytes)
      return jax.tree.map(lambda x: x[None], gathered)

    gather = jax.shard_map(
        gather_group, mesh=mesh,
        in_specs=(jax.tree.map(lambda s: grouped(data_part(s, axis_name)), layout.split_specs, is_leaf=is_spec),),
        out_specs=jax.tree.map(grouped, specs.params, is_leaf=is_spec),
        axis_names=set(axis_names(axis_name)) | ({group_axis} if group_axis else set()), check_vma=check_vma,
    )
  finish = functools.partial(finish_step, optimizer, loss_scaling=settings.loss_scaling)
  if group_axis is not None:  # each group's update on its own entry, every leaf whole within the group
    finish = jax.vmap(finish, spmd_axis_name=group_axis)

  def step(state, batch, weights, rng, has_more):
    reduced = gradient(state._replace(opt_state=None), batch, weights, rng, has_more)
    if gather is not None:  # the update reads and writes the parameters split (a slice of the replicated ones)
      state = state._replace(params=constrain(state.params, split_shardings))
    new_state, metrics = finish(state, reduced)
    if gather is not None:
      new_state = new_state._replace(params=gather(constrain(new_state.params, split_shardings)))
    return new_state, metrics

  return step


def _grouped(group_axis: str | None) -> Callable[[P], P]:
  """A spec of one group's leaf -> the spec of the leaf with the groups' leading dimension over `group_axis`."""
  return (lambda spec: spec) if group_axis is None else (lambda spec: P(group_axis, *spec))


def _pipelined(pipeline: pipelining.Pipeline, mesh: Mesh, axis_name: Any, layout: Layout) -> Callable:
  """`run_gradient_step` with the loss's `jaxdp.scan_layers` running `pipeline` over the stacks,
  and a check that the loss did run every stack through it."""
  stages = mesh.shape[pipeline.axis_name]

  gathered = layout.zero_stage == 3 and pipeline.gather == "step"  # the loss sees the stage's block gathered
  split = jax.tree.leaves(layout.split_specs, is_leaf=lambda s: isinstance(s, P))

  def as_seen(x, spec):
    dim = data_dim(spec, axis_name) if gathered else None
    shape = list(x.shape)
    if dim is not None:
      shape[dim] *= data_size(mesh, zero_axis(axis_name))
    return tuple(shape)

  def run(settings, loss_fn, state, *args, **kwargs):
    local = [as_seen(x, spec) for x, spec, is_layer in zip(jax.tree.leaves(state.params), split,
                                                           jax.tree.leaves(layout.layers)) if is_layer]
    with pipelining.running(pipeline, stages, [shape[0] * stages for shape in local], axis_names(axis_name),
                            local, layout.layers) as record:
      return sharded_gradient_step(settings, pipelining.checked_loss(loss_fn, record), state, *args, **kwargs)

  return run


def _in_circular_order(gradient: Callable, pipeline: pipelining.Pipeline, mesh: Mesh, layout: Layout,
                       grad_specs: Any, group_axis: str | None = None) -> Callable:
  """`gradient` on the stacks permuted into the circular assignment, its gradient permuted back (after the
  groups' leading dimension, with `group_axis`)."""
  stages, repeats = mesh.shape[pipeline.axis_name], pipeline.repeats
  lead, grouped = (0 if group_axis is None else 1), _grouped(group_axis)

  def permuted(state, *args):
    def to_circular(x, is_layer, spec, dim=0):
      if not is_layer:
        return x
      dim += lead
      x = jnp.moveaxis(pipelining.circular_order(jnp.moveaxis(x, dim, 0), stages, repeats), 0, dim)
      return constrain(x, NamedSharding(mesh, grouped(spec)))

    params = jax.tree.map(to_circular, state.params, layout.layers, layout.specs.params)
    compression = _per_layer_factors(state.compression, layout.specs.compression, to_circular, lead)
    reduced = gradient(state._replace(params=params, compression=compression), *args)

    def to_natural(g, is_layer, spec, dim=0):
      if not is_layer:
        return g
      dim += lead
      g = jnp.moveaxis(pipelining.natural_order(jnp.moveaxis(g, dim, 0), stages, repeats), 0, dim)
      return constrain(g, NamedSharding(mesh, grouped(spec)))

    compression = _per_layer_factors(reduced.compression, layout.specs.compression, to_natural, lead)
    return reduced._replace(grads=jax.tree.map(to_natural, reduced.grads, layout.layers, grad_specs),
                            compression=compression)

  return permuted


def _per_layer_factors(compression: Any, specs: Any, reorder: Callable, lead: int = 0) -> Any:
  """`compression` with `reorder(x, True, spec, layer_dim)` applied to the factors and errors of the stacks
  PowerSGD compresses layer by layer (`q` `[L, n, r]`, error `[N, L, ...]`, after `lead` leading dimensions),
  which follow their layers."""
  if not isinstance(compression, PowerSGDState):
    return compression
  per_layer = lambda x: x.ndim == 3 + lead  # noqa: E731
  q = jax.tree.map(lambda x, spec: reorder(x, per_layer(x), spec, 0), compression.q, specs.q)
  error = jax.tree.map(lambda x, e, spec: reorder(e, per_layer(x), spec, 1), compression.q, compression.error,
                       specs.error)
  return compression._replace(q=q, error=error)


def _pmap_over(replica_step, mesh: Mesh, axis_name: str):
  """The same step through `jax.pmap`: global batch reshaped to `[n, b, ...]`."""
  n = mesh.shape[axis_name]
  devices = list(mesh.devices.flat)
  # pmap mis-flattens in_axes against a None argument, so each combination of absent arguments has its own map.
  maps = {}

  def mapped(rng_given: bool, has_more_given: bool):
    if (rng_given, has_more_given) not in maps:
      def replica(state, batch, weights, *rest):
        rest = list(rest)
        rng = rest.pop(0) if rng_given else None
        has_more = rest.pop(0) if has_more_given else None
        return replica_step(state, batch, weights, rng, has_more)

      in_axes = (None, 0, 0) + ((None,) if rng_given else ()) + ((0,) if has_more_given else ())
      maps[rng_given, has_more_given] = jax.pmap(
          replica, axis_name, in_axes=in_axes, out_axes=(None, None), devices=devices
      )
    return maps[rng_given, has_more_given]

  def split_leading(x):
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])

  @functools.wraps(replica_step)
  def step(state, batch, weights, rng, has_more):
    batch, weights = jax.tree.map(split_leading, (batch, weights))
    extra = [x for x in (rng, has_more) if x is not None]
    return mapped(rng is not None, has_more is not None)(state, batch, weights, *extra)

  return step
