"""Data-parallel evaluation: exact global weighted metrics over padded, uneven batches.

The evaluation step calls the training `loss_fn` with `train=False` (if
it declares `train`) and no PRNG key, and reduces the loss and every metric
it returns with the same weighted sums as the training step
(`jaxdp.loss_sums`): one definition of each metric for training and
evaluation. Each real example counts once and padding (weight 0) never
counts, unlike PyTorch's `DistributedSampler`, which pads an evaluation set
by repeating examples.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxdp.core import checks as _checks
from jaxdp.runtime import host_inputs
from jaxdp.sharding import pipelining
from jaxdp.sharding.layerwise import gathering
from jaxdp.core.loss import check_loss_fn
from jaxdp.sharding.layout import (
    axis_names,
    data_part,
    data_dim,
    data_size,
    constrain,
    layer_mask,
    mesh_context,
    place,
    split_along,
)
from jaxdp.training.config import StepConfig, axis_of
from jaxdp.sharding.legacy import accepts_legacy_keywords
from jaxdp.sharding.parallel import DataParallel, as_layout, check_stages_used
from jaxdp.core.precision import as_precision
from jaxdp.training.reduction import cast_floating, loss_sums, reduce_scattered, safe_divide
from jaxdp.reductions import resolve, sum as sum_reduction
from jaxdp.core.state import TrainState
from jaxdp.training.step import gather_params


@accepts_legacy_keywords("eval_sums", ("loss_fn", "state", "batch", "weights"),
                         internal=lambda **kw: _legacy_sharded_eval(**kw),
                         internal_keywords=("params_split", "stacked", "reduction"))
def eval_sums(
    loss_fn: Callable[..., Any],
    state: TrainState,
    batch: Any,
    weights: jax.Array | None = None,
    *,
    layout: Any = "data",
    precision: Any = None,
) -> dict[str, jax.Array]:
  """Global sums `{"loss": Σ w·l, "weight": Σ w, name: Σ w·m}` of one batch, as seen by one replica.

  Call it inside `shard_map` over the data axes of `layout` (a
  `jaxdp.DataParallel` or the axis' name; batch split); one
  all-reduce. Dividing by `"weight"` gives the exact global weighted
  means; adding sums over batches first gives those of a whole dataset.
  `precision`: the forward pass in its `compute_dtype`, as the training
  step's (the floating params and batch leaves cast; the sums stay float32).
  """
  policy = as_precision(precision)
  return sharded_eval_sums(loss_fn, state, batch, weights, axis_name=axis_of(layout),
                           compute_dtype=policy.compute_dtype)


def _legacy_sharded_eval(loss_fn, state, batch, weights=None, *, layout="data", precision=None, reduction=None,
                         **splits):
  """`eval_sums(..., params_split=, stacked=, bucket_bytes=)` of jaxdp 0.1 (ZeRO's splits left the public
  signature; `bucket_bytes=` arrives translated into a reduction)."""
  return sharded_eval_sums(loss_fn, state, batch, weights, axis_name=axis_of(layout),
                           compute_dtype=as_precision(precision).compute_dtype,
                           bucket_bytes=resolve(reduction).bucket_bytes, **splits)


def sharded_eval_sums(
    loss_fn: Callable[..., Any],
    state: TrainState,
    batch: Any,
    weights: jax.Array | None = None,
    *,
    axis_name: Any = "data",
    params_split: Any = None,
    bucket_bytes: int | None = None,
    compute_dtype: Any = None,
    stacked: Any = None,
) -> dict[str, jax.Array]:
  """`eval_sums` with ZeRO's splits (what `make_eval_step` runs per replica).

  `params_split`: the params' tree of data-axis specs of parameters that
  arrive split over `axis_name` (ZeRO stage 3), gathered first: one
  all-gather per larger leaf and one for the small ones, or one per flat
  bucket of about `bucket_bytes`. `stacked`: the params' tree of bools
  marking the stacks of layers (layer-wise stage 3): those leaves stay split
  and the loss gathers them a layer at a time (`jaxdp.gather`).
  """
  specs = params_split
  if stacked is not None and params_split is not None:  # stacks of layers: gathered a layer at a time in the loss
    # (a stacked leaf placed split along its layer axis, by a layout without layers=, is gathered whole here)
    stacked = jax.tree.map(lambda spec, is_layer: bool(is_layer and (data_dim(spec, axis_name) or 0) > 0),
                           params_split, stacked, is_leaf=lambda x: isinstance(x, P))
    params_split = jax.tree.map(lambda spec, is_layer: P() if is_layer else spec, params_split, stacked,
                                is_leaf=lambda x: isinstance(x, P))
  params = gather_params(state.params, params_split, axis_name, bucket_bytes)
  params, batch = cast_floating((params, batch), compute_dtype)
  with gathering(params, specs, stacked, axis_name) if specs is not None else contextlib.nullcontext():
    local = loss_sums(
        loss_fn, params, batch, weights, model_state=state.model_state, axis_name=axis_name, train=False
    )
  # A fixed reduction without dtype or buckets: nothing to check.
  reduced = reduce_scattered(StepConfig(axis_name, resolve(sum_reduction())), local._replace(model_state=None))
  return {"loss": reduced.loss, "weight": reduced.weight, **reduced.metrics}


def means_from_sums(sums: dict[str, Any]) -> dict[str, Any]:
  """`{"loss": Σ w·l / Σ w, name: Σ w·m / Σ w, "weight": Σ w}` (0, not NaN, when `Σ w` is 0)."""
  weight = sums["weight"]
  means = safe_divide({k: v for k, v in sums.items() if k != "weight"}, weight)
  return {**means, "weight": weight}


class EvalStep:
  """A jitted data-parallel evaluation step; built by `make_eval_step`.

  `eval_step(state, batch, weights=None)` returns the global weighted
  means of one batch (`loss`, each metric, and `weight` = `Σ w`) as
  device scalars; `eval_step.evaluate(state, batches)` runs over an
  iterable of `(batch, weights)` (e.g. one pass of a
  `jaxdp.DataPipeline`) and returns the exact weighted means over all
  of it as Python floats, the per-batch float32 sums added in float64. A
  batch padded by `jaxdp.split_batch`, `jaxdp.shard_uneven` or a
  pipeline is refused without its weights, as the training step refuses it.
  """

  def __init__(self, build, *, loss_fn, mesh: Mesh, axis_name: str, gather_split: bool = False, layers: Any = None,
               pipeline: pipelining.Pipeline | None = None):
    self._build, self.loss_fn, self.mesh, self.axis_name = build, loss_fn, mesh, axis_name
    self.layers, self.pipeline = layers, pipeline
    self._gather_split = gather_split  # pmap takes the state unmapped: split parameters are gathered first
    # The host input layer's caches (jaxdp.runtime.host_inputs): checked once per signature, then only what values need.
    self._plans: dict = {}  # (state key, inputs' signature) -> the InputPlan of inputs validated once
    self._programs: dict = {}  # (the params' structure and data-axis splits, "sums" or "means") -> the program
    self._known = None  # the state the last call placed as it was given (KnownState): checked, on the mesh
    self._state_ids: dict = {}  # the params' structure, splits and state signature -> (id, splits id, splits)
    self._splits_ids: dict = {}  # the params' structure and splits -> a small int
    self._split = split_along(mesh, axis_name)  # the batch's sharding

  def _prepare(self, state, batch, weights, kind: str = "sums"):
    """Runs the host input layer (`jaxdp.runtime.host_inputs`) on one call's inputs: `(program, args)`."""
    weights = _checks.as_array(weights)
    _checks.check_padded_weights(batch, weights)  # identity lookups, and only without weights
    # Only the parts evaluation reads are flattened and known (not the optimizer state, often twice the params).
    leaves, treedef = jax.tree.flatten(_read_by_eval(state)) if isinstance(state, TrainState) else ([], None)
    split_key = host_inputs.known_state(self._known, leaves, treedef)  # the state the last call placed
    if split_key is None:
      _checks.check_state(state)
      host_inputs.check_state_donation(state, jax.tree.leaves(state))  # a deleted buffer can crash a program
      split_key, placed = self._enter_state(state)
      if all(map(operator.is_, jax.tree.leaves(_read_by_eval(placed)), leaves)):
        self._known = host_inputs.KnownState(leaves, treedef, split_key)  # placed as given: known next call
    else:
      placed = TrainState(state.params, None, state.step, state.model_state)
    _, inputs_key = host_inputs.input_signature(batch, weights)
    plan = self._plans.get((split_key[0], inputs_key))
    if plan is None:
      plan = self._plan(split_key, inputs_key, state, batch, weights)
    host_inputs.check_input_values(plan, batch, weights)  # each call: the values of host inputs only
    host_inputs.agree_across_processes({"state": state, "batch": batch, "weights": weights}, "evaluation inputs")
    batch, weights, _ = host_inputs.place_inputs(plan, (batch, weights, None), self._split)
    return self._program(split_key, kind, placed), (placed, batch, weights)

  def _enter_state(self, state):
    """A state not known yet: `(key, placed)`; its parameters stay where they are (a ZeRO-3 split is gathered
    inside), the optimizer state is not needed."""
    specs = jax.tree.map(lambda x: _current_spec(x, self.mesh), state.params)
    if self._gather_split:
      specs = jax.tree.map(lambda _: P(), specs)
    placed = TrainState(
        place(state.params, jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs)), None,
        place(state.step, NamedSharding(self.mesh, P())),
        place(state.model_state, NamedSharding(self.mesh, P())),
    )
    split = jax.tree.map(lambda s: data_part(s, self.axis_name), specs)
    # The params' structure too: two trees with the same specs in another structure need their own program.
    key = (jax.tree.structure(state.params), tuple(jax.tree.leaves(split)), _checks.signature(state))
    # A small int stands for the (long) key in every cache: hashed on each call.
    if key not in self._state_ids:
      splits_id = self._splits_ids.setdefault(key[:2], len(self._splits_ids))
      self._state_ids[key] = (len(self._state_ids), splits_id, key[:2])
    return self._state_ids[key], placed

  def _plan(self, split_key, inputs_key, state, batch, weights):
    """Validates inputs of a new signature (shapes and structure, never values) and returns their plan."""
    check_loss_fn(self.loss_fn, with_model_state=state.model_state is not None)
    _checks.check_batch_split(batch, weights, data_size(self.mesh, self.axis_name))
    _checks.check_batch_values(batch, "batch", ranges=False)
    _checks.check_weights_dtype(weights)
    if self.pipeline is not None:
      pipelining.check_stacks(state.params, self.layers, self.pipeline, self.mesh.shape[self.pipeline.axis_name])
      pipelining.check_rows(batch, self.pipeline, data_size(self.mesh, self.axis_name), 1)
    plan = host_inputs.plan_inputs(batch, weights, None, self._split)
    self._plans[split_key[0], inputs_key] = plan
    return plan

  def _program(self, split_key, kind: str, placed: TrainState):
    """The one program of a layout: the sums of a batch, or (`kind="means"`) their means too."""
    _, splits_id, splits = split_key  # the program follows the params' structure and splits, not their shapes
    key = (splits_id, kind)
    if key not in self._programs:
      sums = self._programs.get((splits_id, "sums"))
      if sums is None:
        sums = self._build(jax.tree.unflatten(*splits), layer_mask(placed.params, self.layers))
        self._programs[splits_id, "sums"] = sums
      self._programs[key] = sums if kind == "sums" else jax.jit(lambda *a: means_from_sums(sums(*a)))
    return self._programs[key]

  def sums(self, state: TrainState, batch: Any, weights: jax.Array | None = None) -> dict[str, jax.Array]:
    """The global sums of one batch (see `eval_sums`)."""
    program, args = self._prepare(state, batch, weights)
    return self._run(program, args, state)

  def __call__(self, state: TrainState, batch: Any, weights: jax.Array | None = None) -> dict[str, jax.Array]:
    program, args = self._prepare(state, batch, weights, "means")
    return self._run(program, args, state)

  def _run(self, program, args, state):
    try:
      with mesh_context(self.mesh):
        return program(*args)
    except RuntimeError as error:  # JAX refuses a deleted input before it runs anything
      host_inputs.raise_if_consumed(error, state)
      raise

  def lower(self, state: TrainState, batch: Any, weights: jax.Array | None = None) -> jax.stages.Lowered:
    """The step for these arguments, lowered (e.g. `.compile().as_text()` to read its collectives)."""
    program, args = self._prepare(state, batch, weights)
    with mesh_context(self.mesh):
      return program.lower(*args)

  def evaluate(self, state: TrainState, batches: Iterable[tuple[Any, Any]]) -> dict[str, float]:
    """Exact weighted means over every `(batch, weights)` of `batches` (Python floats).

    `weight` is the total `Σ w`. Batches are dispatched asynchronously;
    the sums are fetched once at the end.
    """
    pending = []
    for item in batches:
      if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], (int, np.integer)) and isinstance(
          item[1], tuple):
        raise TypeError(
            "batches yields (step, (batch, weights)) pairs, as DataPipeline.iterate does; pass the (batch, weights) "
            "pairs: evaluate(state, (b for _, b in pipeline.iterate(num_steps=pipeline.steps_per_epoch)))."
        )
      if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise TypeError(
            f"batches yields a {type(item).__name__}; pass (batch, weights) pairs (weights=None for all ones): "
            "evaluate(state, ((b, None) for b in batches))."
        )
      batch, weights = item
      pending.append(self.sums(state, batch, weights))
    if not pending:
      raise ValueError("batches is empty; pass at least one (batch, weights) pair.")
    host = jax.device_get(pending)
    totals = {k: np.sum([np.float64(s[k]) for s in host]) for k in host[0]}
    weight = totals.pop("weight")
    # 0 for an empty set (no weight); a NaN total (a NaN weight given to the step) stays NaN, never 0.
    return {**{k: 0.0 if weight == 0 else float(v / weight) for k, v in totals.items()}, "weight": float(weight)}


@accepts_legacy_keywords("make_eval_step", ("loss_fn", "layout"))
def make_eval_step(loss_fn: Callable[..., Any], layout: DataParallel | Mesh | None = None, *, reduction: Any = None,
                   precision: Any = None) -> EvalStep:
  """Builds the jitted evaluation step over every device of the layout's data axes.

  Args:
    loss_fn: the training `loss_fn` (see `jaxdp.core.loss`); it is called
      with `train=False` if it declares `train`, with the state's
      `model_state` if it declares `model_state`, and without a PRNG key.
    layout: a `jaxdp.DataParallel`, a `Mesh` or `None`, as for
      `jaxdp.make_train_step` (its ZeRO stage does not matter: the
      step takes a state of any stage). With `layers` a stage-3 state's
      stacked leaves are gathered a layer at a time by `jaxdp.gather`
      in the loss; with a `pipeline` the stacks run as that pipeline (the
      state may come from any layout: its stacks are moved onto the stage
      axis inside the step). Under `backend="pmap"` parameters split over
      the data axis are gathered onto every device before the call.
    reduction: the training step's reduction: of it only
      `jaxdp.reductions.bucketed` matters here (parameters split over
      the data axis are gathered in flat buckets of about that many bytes,
      one all-gather each, as the training step does); without it one
      all-gather for the leaves of up to `jaxdp.training.reduction.PACK_BYTES` and
      one per larger leaf. The gathered parameters are the same, bit for
      bit.
    precision: the training step's `jaxdp.Precision`: the forward
      pass in its `compute_dtype` (`None`: the params' own dtypes).

  Returns:
    An `EvalStep`. It takes a `jaxdp.TrainState` of any ZeRO
    stage and never changes it (nothing is donated).
  """
  check_loss_fn(loss_fn)
  layout = as_layout(layout)
  check_stages_used(layout)
  compute_dtype, bucket_bytes = as_precision(precision).compute_dtype, resolve(reduction).bucket_bytes
  mesh, axis_name, backend, layers, pipeline = (layout.mesh, layout.axis_name, layout.backend, layout.layers,
                                                layout.pipeline)
  batch_spec = split_along(mesh, axis_name).spec

  def build(params_split, stacked):
    if pipeline is not None:
      return _pipelined_eval(loss_fn, mesh, axis_name, pipeline, stacked, compute_dtype)

    def replica(s, b, w):
      return sharded_eval_sums(loss_fn, s, b, w, axis_name=axis_name, params_split=params_split,
                               bucket_bytes=bucket_bytes, compute_dtype=compute_dtype, stacked=stacked)

    if backend == "pmap":
      return _pmap_eval(replica, mesh, axis_name)
    state_specs = TrainState(params_split, None, P(), P())
    # Typed on any number of devices (check_vma), so that a program that fails at scale fails on one device too.
    return jax.jit(jax.shard_map(
        replica, mesh=mesh, in_specs=(state_specs, batch_spec, batch_spec), out_specs=P(),
        axis_names=set(axis_names(axis_name)), check_vma=True,
    ))

  return EvalStep(build, loss_fn=loss_fn, mesh=mesh, axis_name=axis_name, gather_split=backend == "pmap",
                  layers=layers, pipeline=pipeline)


def _pipelined_eval(loss_fn: Callable[..., Any], mesh: Mesh, axis_name: Any, pipeline: pipelining.Pipeline,
                    stacked: Any, compute_dtype: Any):
  """The evaluation step over the stage and data axes: the stacks split over the stages along their layer axis
  (in the circular assignment under `"circular"`), every other parameter whole on every device."""
  stage_axis, stages, repeats = pipeline.axis_name, mesh.shape[pipeline.axis_name], pipeline.repeats
  params_specs = jax.tree.map(lambda is_layer: P(stage_axis) if is_layer else P(), stacked)
  batch_spec = split_along(mesh, axis_name).spec

  def replica(state, batch, weights):
    local = [tuple(x.shape) for x, is_layer in zip(jax.tree.leaves(state.params), jax.tree.leaves(stacked)) if is_layer]
    with pipelining.running(pipeline, stages, [shape[0] * stages for shape in local], axis_names(axis_name),
                            local) as record:
      return sharded_eval_sums(pipelining.checked_loss(loss_fn, record), state, batch, weights, axis_name=axis_name,
                               compute_dtype=compute_dtype)

  mapped = jax.shard_map(
      replica, mesh=mesh, in_specs=(TrainState(params_specs, None, P(), P()), batch_spec, batch_spec), out_specs=P(),
      axis_names={stage_axis, *axis_names(axis_name)}, check_vma=True,
  )

  def run(state, batch, weights):
    def placed(x, is_layer, spec):
      x = pipelining.circular_order(x, stages, repeats) if is_layer and repeats > 1 else x
      return constrain(x, NamedSharding(mesh, spec))

    params = jax.tree.map(placed, state.params, stacked, params_specs)
    return mapped(state._replace(params=params), batch, weights)

  return jax.jit(run)


def _pmap_eval(replica, mesh: Mesh, axis_name: str):
  """The evaluation step through `jax.pmap`: the global batch reshaped to `[n, b, ...]`, the state unmapped."""
  n = mesh.shape[axis_name]
  mapped = jax.pmap(replica, axis_name, in_axes=(None, 0, 0), out_axes=None, devices=list(mesh.devices.flat))

  def run(state, batch, weights):
    split = lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:])  # noqa: E731
    return mapped(state, *jax.tree.map(split, (batch, weights)))

  return jax.jit(run)


def _read_by_eval(state: TrainState) -> tuple:
  """The parts of a state evaluation reads: its params, step and model state."""
  return state.params, state.step, state.model_state


def _current_spec(x: Any, mesh: Mesh) -> P:
  """Where a parameter lives now on `mesh` (its full spec), or `P()` when it is not placed on it."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.axis_names) == tuple(mesh.axis_names) and (
      sharding.mesh.devices.shape == mesh.devices.shape
  ):
    return sharding.spec
  return P()
