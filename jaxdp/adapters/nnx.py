"""flax nnx models in jaxdp: from an `nnx.Module` to a state and a loss, and back.

jaxdp's steps are pure functions over pytrees; an nnx Module is a mutable
object graph. This module converts between the two in three calls:

```python
definition, params, model_state = jaxdp.adapters.nnx.split(model)
state = jaxdp.init_state(params, optimizer, mesh, model_state=model_state)
loss_fn = jaxdp.adapters.nnx.loss_fn(definition, my_loss)   # my_loss(model, batch, *, weights, ...) -> losses
...                                                # jaxdp.make_train_step(loss_fn, optimizer, mesh)
jaxdp.adapters.nnx.update(model, state)                     # back to the Module, for evaluation or export
```

With tensor parallelism, annotate the Module's weights with flax's
partitioning metadata (`nnx.with_partitioning(init, (None, "model"))`) and
pass `param_specs=jaxdp.adapters.nnx.partition_specs(model)` to `init_state`: each
parameter keeps that split over the model axes, and ZeRO adds its own over
the data axis.

* `params` are the `nnx.Param` variables (what the optimizer updates);
  `model_state` is every other variable (`nnx.BatchStat` running
  statistics, counters), or `None` if there is none. RNG streams
  (`nnx.Rngs` held by `Dropout`) are neither: jaxdp reseeds them in every
  step from the step's per-replica, per-step key, so dropout differs between
  replicas, steps and micro-batches and the same seed reproduces a run. With
  `make_train_step(..., example_ids="id")` the key is the same on every
  replica and micro-batch, and `Dropout` (a drop-in for
  `nnx.Dropout`) draws each example's mask from its id: the same masks on
  any layout (see `jaxdp.core.randomness`); flax's own `nnx.Dropout` is
  then refused.
* The loss is called on a Module rebuilt inside the traced step (so
  BatchNorm may update its statistics: no "Cannot mutate BatchStat from a
  different trace level"), in `model.train()` mode in the training step and
  `model.eval()` mode in the evaluation step; layers frozen at
  `split` stay frozen with `keep_frozen=True` (a model with frozen
  layers needs that choice). What the call sows (`nnx.Intermediate`) is
  dropped.
* flax's own `nnx.BatchNorm` is refused: it puts zero-weight padding rows
  into its statistics unless every call passes a `mask`, and even with a
  mask it averages the devices' means with equal weight, which is not the
  global batch statistic when devices hold different numbers of real rows.
  Use `jaxdp.adapters.nnx.BatchNorm` (same arguments) instead.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxdp.core import randomness
from jaxdp.adapters.batchnorm import BatchNorm
from jaxdp.adapters import flax_support
from jaxdp.adapters.flax_support import BEFORE_STEP_ATTRIBUTE, NNX_LOSS_ATTRIBUTE
from jaxdp.core.loss import LossOutput, declared_keywords, scalar_mean_message
from jaxdp.sharding.layerwise import gather as _gather_leaves
from jaxdp.sharding.layout import gather_state
from jaxdp.core.state import TrainState

__all__ = ["BatchNorm", "Definition", "Dropout", "loss_fn", "merge", "partition_specs", "split", "stack_blocks",
           "unstack_blocks", "update"]

_USER_KEYWORDS = ("weights", "rngs", "train", "axis_name")


class Definition(NamedTuple):
  """The static part of a split Module: its graph definition and its RNG streams.

  Attributes:
    graphdef: the `nnx.GraphDef`.
    rng_state: the `nnx.RngState` variables (keys and counts), replaced by
      per-replica keys in every training step.
    streams: the names of the RNG streams (e.g. `("dropout",)`).
    frozen: `(path, attribute)` of the mode flags that training keeps as
      they were at `split` (`keep_frozen=True`).
    modes: the mode flags of the Module given to `split` (weakly
      held): a training step refuses to run once `model.eval()` or
      `model.train()` changed them to a mode the step does not run.
  """

  graphdef: Any
  rng_state: Any
  streams: tuple[str, ...]
  frozen: tuple[tuple[tuple, str], ...] = ()
  modes: Any = None  # a _ModeWatch of the Module given to split


class _ModeWatch:
  """The mode flags of the Module given to `split`, so that a training step refuses a change to them.

  The steps run the Module rebuilt from the state, never that object: `model.eval()` on it after the split
  would otherwise be ignored in silence. Only weak references are kept (the Module may be freed).
  """

  def __init__(self, model: nnx.Module, kept: tuple[tuple[tuple, str], ...]):
    self.nodes = []
    for path, node in nnx.iter_graph(model):
      flags = {f: getattr(node, f) for f in _MODE_FLAGS if isinstance(getattr(node, f, None), bool)}
      if isinstance(node, nnx.Module) and flags:
        # The value training runs with: True for a layer kept frozen (and flax's own BatchNorm), else False.
        training = {f: (tuple(path), f) in kept or (_is_flax_batchnorm(node) and f == "use_running_average")
                    for f in flags}
        self.nodes.append((weakref.ref(node), "/".join(map(str, path)) or "<root>", flags, training))

  def check(self) -> None:
    """Raises `ValueError` if a flag now differs from its value at the split and from what training runs."""
    changed = []
    for ref, path, flags, training in self.nodes:
      node = ref()
      for flag, at_split in flags.items():
        now = at_split if node is None else getattr(node, flag, at_split)
        if now != at_split and now != training[flag]:
          changed.append(f"{path}.{flag}={now}")
    if changed:
      raise ValueError(
          f"the Module given to jaxdp.adapters.nnx.split changed mode since ({', '.join(changed[:4])}"
          f"{', ...' if len(changed) > 4 else ''}: model.eval() or a mode flag set after the split). jaxdp's steps "
          "never read that object: the training step runs the Module in training mode (layers frozen at the split "
          "with keep_frozen=True stay frozen), make_eval_step in evaluation mode. Call model.train() before "
          "training again (model.eval() is only needed for your own code on the object, after "
          "jaxdp.adapters.nnx.update(model, state)); to train in this mode from now on, split again and build a step for "
          "it, with the same state: definition, _, _ = jaxdp.adapters.nnx.split(model, keep_frozen=True), then "
          "jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, fn), optimizer, mesh). Nothing ran and nothing "
          "was donated."
      )


class Dropout(nnx.Dropout):
  """flax nnx's `Dropout` with one mask per example, drawn from the example's id: the same on any layout.

  The same arguments, call and RNG stream as `nnx.Dropout`. In a step built
  with `example_ids` (see `jaxdp.core.randomness`), or inside
  `jaxdp.use_example_ids`, row `r` of the input (axis 0 is the
  batch) is masked with `fold_in(key, id_r)`, `key` the layer's draw from
  its stream (the same on every replica there), so an example's mask does
  not depend on the device count, split or `accum_steps`. Without ids it
  is `nnx.Dropout`. `broadcast_dims` holding axis 0 shares one mask
  between all rows, as flax's (drawn from the layer's key alone).
  """

  def __call__(self, inputs, *, deterministic: bool | None = None, rngs: Any = None) -> jax.Array:
    """Applies a random dropout mask to `inputs` (see `nnx.Dropout`)."""
    ids = randomness.current_example_ids()
    deterministic = self.deterministic if deterministic is None else deterministic
    if ids is None or deterministic is None or deterministic or self.rate in (0.0, 1.0):
      return super().__call__(inputs, deterministic=deterministic, rngs=rngs)  # flax's result, or its error
    rngs = self.rngs if rngs is None else rngs
    if isinstance(rngs, nnx.Rngs):
      key = rngs[self.rng_collection]()
    elif isinstance(rngs, nnx.RngStream):
      key = rngs()
    elif isinstance(rngs, jax.Array):
      key = rngs
    else:
      return super().__call__(inputs, deterministic=deterministic, rngs=rngs)  # flax's error for a missing key
    return randomness.dropout(inputs, self.rate, self.broadcast_dims, key, ids)


def _flax_dropout_layers(model: nnx.Module) -> list[str]:
  """The paths of flax's own `nnx.Dropout` layers of `model` that would draw a mask (jaxdp's not listed)."""
  return ["/".join(map(str, path)) or "<root>" for path, node in nnx.iter_graph(model)
          if isinstance(node, nnx.Dropout) and not isinstance(node, Dropout) and node.rate != 0.0
          and node.deterministic is not True]


def _is_flax_batchnorm(node: Any) -> bool:
  """Whether `node` is flax's own `nnx.BatchNorm` (jaxdp's subclass is not)."""
  return isinstance(node, nnx.BatchNorm) and not isinstance(node, BatchNorm)


def _flax_batchnorm_layers(model: nnx.Module) -> list[tuple[str, nnx.BatchNorm]]:
  """`(path, layer)` of every flax `nnx.BatchNorm` in `model` (jaxdp's own are not listed)."""
  return [("/".join(map(str, path)) or "<root>", node) for path, node in nnx.iter_graph(model) if _is_flax_batchnorm(node)]


_MODE_FLAGS = ("use_running_average", "deterministic")  # what model.train() and model.eval() set


def _frozen_flags(model: nnx.Module) -> list[tuple[tuple, str]]:
  """`(path, attribute)` of each mode flag set to its evaluation value (flax's own BatchNorm aside)."""
  return [(tuple(path), flag) for path, node in nnx.iter_graph(model)
          if isinstance(node, nnx.Module) and not _is_flax_batchnorm(node)
          for flag in _MODE_FLAGS if getattr(node, flag, None) is True]


def split(model: nnx.Module, *, allow_flax_batchnorm: bool = False,
          keep_frozen: bool | None = None) -> tuple[Definition, Any, Any]:
  """`(definition, params, model_state)` of `model` for `jaxdp.init_state` and `loss_fn`.

  Args:
    model: an `nnx.Module`; it is not modified.
    allow_flax_batchnorm: accept flax's `nnx.BatchNorm` layers as frozen
      ones: `loss_fn` keeps them on their running averages in training
      too (where `model.train()` would switch them to batch statistics,
      padding rows included). By default they are refused with a
      `ValueError`: see the module docstring.
    keep_frozen: what the training step does with layers that are in
      evaluation mode now (`use_running_average=True` or
      `deterministic=True`: a BatchNorm or Dropout frozen for fine-tuning,
      or a model after `model.eval()`). `True`: they stay so in training
      (every other layer trains), as a one-device program that never calls
      `model.train()`. `False`: training switches every layer to
      training mode (`model.train()`, what a one-device loop that calls it
      does). `None` (default): a model with such layers is refused with a
      `ValueError` naming them, since either choice would silently give
      the other program's numbers.

  Returns:
    `definition` (a `Definition`), `params` (an `nnx.State` of
    the `nnx.Param` arrays) and `model_state` (an `nnx.State` of every
    other variable except RNG streams, or `None` if there is none).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}.")
  flax_bn = [] if allow_flax_batchnorm else [path for path, _ in _flax_batchnorm_layers(model)]
  if flax_bn:
    raise ValueError(
        f"model has flax nnx.BatchNorm layers ({', '.join(flax_bn[:4])}): their training statistics include "
        "jaxdp's zero-weight padding rows, and across devices they average per-device means with equal weight, "
        "which is not the global batch's statistic for uneven splits. Replace them with jaxdp.adapters.nnx.BatchNorm "
        "(same arguments; in a jaxdp step it takes the weights of its rows from the step), or pass "
        "allow_flax_batchnorm=True if they only run on their running averages."
    )
  if keep_frozen not in (None, True, False):
    raise TypeError(f"keep_frozen must be True, False or None, got {keep_frozen!r}.")
  frozen = _frozen_flags(model)
  if frozen and keep_frozen is None:
    named = ", ".join(f"{'/'.join(map(str, path)) or '<root>'}.{flag}" for path, flag in frozen[:6])
    raise ValueError(
        f"model has layers in evaluation mode ({named}{', ...' if len(frozen) > 6 else ''} are True). Say what "
        "training does with them: jaxdp.adapters.nnx.split(model, keep_frozen=True) keeps them frozen while the rest "
        "trains (fine-tuning; a one-device program that never calls model.train()), keep_frozen=False switches "
        "every layer to training mode in the training step (model.train(), e.g. after model.eval())."
    )
  if jax.tree.leaves(nnx.state(model, nnx.Intermediate)):
    # Values sown before the split (an eager call to check shapes) are no state to train: a copy without them.
    model = nnx.clone(model)
    nnx.pop(model, nnx.Intermediate)
  graphdef, params, rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
  streams = tuple(sorted({stream for stream, _ in _stream_paths(model)}))
  model_state = rest if jax.tree.leaves(rest) else None
  kept = tuple(frozen) if keep_frozen else ()
  return Definition(graphdef, rng_state, streams, kept, _ModeWatch(model, kept)), params, model_state


def partition_specs(model_or_params: Any) -> Any:
  """The `PartitionSpec` of every parameter, as `jaxdp.init_state`'s `param_specs`.

  Reads the partitioning metadata of each `nnx.Param`
  (`nnx.with_partitioning(init, (None, "model"))`, or
  `out_sharding=`/`kernel_metadata=` given to a layer) with
  `nnx.get_partition_spec`, so flax's logical axis rules apply when set; a
  parameter without metadata gets `PartitionSpec()` (replicated over the
  model axes).

  Args:
    model_or_params: an `nnx.Module`, or the `params` that `split`
      returned for it (an `nnx.State` of `nnx.Param` variables; abstract
      ones from `nnx.eval_shape` work too).

  Returns:
    A tree of the structure of `split`'s `params`, one
    `PartitionSpec` per parameter, to pass as
    `jaxdp.init_state(params, optimizer, mesh, param_specs=...)`. The specs
    name model axes only; the mesh must have every axis they name, and
    `init_state` refuses a spec that names the data axis.
  """
  if isinstance(model_or_params, nnx.Module):
    _, params, _, _ = nnx.split(model_or_params, nnx.Param, nnx.RngState, ...)
  elif isinstance(model_or_params, nnx.State):
    params = model_or_params
  else:
    raise TypeError(
        "partition_specs takes an nnx.Module or the params nnx.State that jaxdp.adapters.nnx.split returns, got "
        f"{type(model_or_params).__name__}."
    )
  return nnx.get_partition_spec(params)


def _stream_paths(model: nnx.Module):
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.RngStream):
      yield node.key.tag, path


def merge(definition: Definition, params: Any, model_state: Any = None) -> nnx.Module:
  """The Module of `params` and `model_state` (inverse of `split`)."""
  # Fresh variables, created in the caller's trace: ones that come from an outer trace (the stored RNG
  # state; a model state closed over by jax.grad) cannot be updated in this one ("Cannot mutate BatchStat
  # from a different trace level").
  fresh = lambda tree: jax.tree.map(lambda x: x, tree)  # noqa: E731
  states = [fresh(params), fresh(definition.rng_state)] + ([] if model_state is None else [fresh(model_state)])
  return nnx.merge(definition.graphdef, *states)


def _as_output(out: Any, rows: int | None) -> tuple[jax.Array, Any]:
  """`(losses, metrics)` from what the user's function returned (`rows`: this device's, for messages)."""
  if isinstance(out, LossOutput):
    if out.model_state is not None:
      raise ValueError(
          "the nnx loss returned a model_state; jaxdp.adapters.nnx.loss_fn reads the new state off the Module itself, "
          "so return losses, (losses, metrics) or LossOutput(losses, metrics=...)."
      )
    return out.losses, out.metrics
  if isinstance(out, tuple):
    if len(out) == 2 and isinstance(out[1], dict):
      return out
    problems = []
    if out and np.shape(out[0]) == () and hasattr(out[0], "dtype"):  # upstream's (mean_loss, logits)
      problems.append(scalar_mean_message("its first item is", rows))
    if len(out) == 2 and not isinstance(out[1], dict):
      problems.append(
          f"its second item is {_what(out[1])}, not a dict: extra outputs (like logits) go into metrics "
          "as a dict of per-example values, e.g. {'accuracy': logits.argmax(-1) == labels}, reduced like the loss"
      )
    raise TypeError(
        f"the nnx loss returned a tuple of {len(out)} items" + (": " + "; ".join(problems) if problems else "")
        + ". Return losses, or (losses, {name: values}) with per-example losses and values."
    )
  return out, None


def _what(x: Any) -> str:
  return f"an array of shape {np.shape(x)}" if hasattr(x, "dtype") else f"a {type(x).__name__}"


def loss_fn(definition: Definition, fn: Callable[..., Any]) -> Callable[..., LossOutput]:
  """A jaxdp `loss_fn` that runs `fn` on the Module rebuilt from the step's params and model state.

  Args:
    definition: from `split`.
    fn: `fn(model, batch, **keywords)` returning per-example (or per-token)
      losses, `(losses, {name: values})` with metrics of the losses'
      shape, or a `jaxdp.LossOutput` without model state. It may
      declare these keywords: `weights` (this replica's row weights, 0 for
      padding; jaxdp.adapters.nnx.BatchNorm takes them from the step itself),
      `rngs` (an `nnx.Rngs` of the per-replica key, `None` in
      evaluation), `train` and `axis_name`.

  Returns:
    `loss(params, batch, rng=None, *, model_state, weights, axis_name, train)`
    for `jaxdp.make_train_step`, `jaxdp.train_step` and
    `jaxdp.make_eval_step`.
  """
  if not isinstance(definition, Definition):
    raise TypeError(f"definition must come from jaxdp.adapters.nnx.split(model), got {type(definition).__name__}.")
  if not callable(fn):
    raise TypeError(f"fn must be callable as fn(model, batch), got {type(fn).__name__}.")
  declared = declared_keywords(fn, _USER_KEYWORDS)

  def loss(params, batch, rng=None, *, model_state=None, weights=None, axis_name=None, train=True):
    try:
      model = merge(definition, params, model_state)
    except Exception as e:  # flax's own message counts leaves; say which argument is missing
      if model_state is not None:
        raise
      raise ValueError(
          f"the nnx model cannot be rebuilt from the step's params without model state ({type(e).__name__}: "
          f"{str(e).splitlines()[0] if str(e) else ''}). If the model has model state (e.g. BatchNorm statistics), "
          "build the state with jaxdp.init_state(params, optimizer, mesh, model_state=model_state), model_state "
          "from jaxdp.adapters.nnx.split(model); otherwise check that the params come from this model's split."
      ) from e
    if train:
      check_modes()  # at trace time (train_step in your own shard_map); make_train_step also checks every call
      model.train()
      # train() switches every BatchNorm to batch statistics; flax's own are only admitted (split's
      # allow_flax_batchnorm) as layers that run on their running averages, so they stay on them.
      for _, bn in _flax_batchnorm_layers(model):
        bn.use_running_average = True
      if definition.frozen:  # split(keep_frozen=True): the layers frozen then stay frozen
        nodes = dict(nnx.iter_graph(model))
        for path, flag in definition.frozen:
          setattr(nodes[path], flag, True)
    else:
      model.eval()
    flax_dropout = _flax_dropout_layers(model) if train and randomness.current_example_ids() is not None else []
    if flax_dropout:
      raise ValueError(
          f"model has flax nnx.Dropout layers ({', '.join(flax_dropout[:4])}) in a jaxdp step with example_ids, "
          "where the key is the same on every replica: they would drop the same units on every device (correlated "
          "dropout). Use jaxdp.adapters.nnx.Dropout (the same arguments), which draws each example's mask from its id, or "
          "build the step without example_ids (a key per replica)."
      )
    if rng is not None and definition.streams:
      keys = jax.random.split(rng, len(definition.streams))
      # 'match_shape': a stream of layers stacked with nnx.vmap + nnx.split_rngs holds a key per layer (shape
      # (L,)); the default 'scalars_only' refuses it. The step's key is split into one key per layer.
      nnx.reseed(model, policy="match_shape", **dict(zip(definition.streams, keys)))
    elif train and definition.streams:
      raise ValueError(
          f"the model draws random numbers (RNG streams {', '.join(definition.streams)}) but the step got no "
          "key; pass rng=jax.random.key(seed) to the step, step(state, batch, weights, rng=key) "
          "(train_step(..., rng=key) inside your own shard_map), so that every replica and step gets its own key."
      )
    available = {
        "weights": weights,
        "rngs": None if rng is None else nnx.Rngs(rng),
        "train": train,
        "axis_name": axis_name,
    }
    rows = None if weights is None else np.shape(weights)[0]
    losses, metrics = _as_output(fn(model, batch, **{k: available[k] for k in declared}), rows)
    # What the call sowed (nnx.Intermediate) is not model state: on one device it is read off the Module
    # (nnx.pop) and dropped; return it as a metric from fn to keep it.
    nnx.pop(model, nnx.Intermediate)
    _, _, _, new_state = nnx.split(model, nnx.Param, nnx.RngState, ...)
    return LossOutput(losses, new_state if model_state is not None else None, metrics)

  def check_modes() -> None:
    if definition.modes is not None:
      definition.modes.check()

  setattr(loss, BEFORE_STEP_ATTRIBUTE, check_modes)  # called by make_train_step's step on every call, before anything
  setattr(loss, NNX_LOSS_ATTRIBUTE, True)  # a missing model state is reported by merge above, not by a generic note
  return loss


def update(model: nnx.Module, state: TrainState) -> nnx.Module:
  """Writes `state`'s params and model state into `model` as ordinary single-device arrays.

  Works for every ZeRO stage and in multi-process runs (call it on every
  process): the state is gathered to the host (`jaxdp.gather_state`)
  and placed on the default device, so the Module can be called on host
  batches, passed to `nnx.jit` or saved like any other. Returns `model`.

  Raises:
    TypeError: `model` is not an `nnx.Module` or `state` not a
      `jaxdp.TrainState`.
    ValueError: the state's params (or model state) differ from the
      model's in structure, shape or dtype, naming the first leaf that
      differs; the model is left unchanged.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}.")
  if not isinstance(state, TrainState):
    raise TypeError(f"state must be a jaxdp.TrainState, got {type(state).__name__}.")
  _, params, _, _, rest = nnx.split(model, nnx.Param, nnx.RngState, nnx.Intermediate, ...)  # as split() sees it
  _check_matches(params, state.params, "state.params")
  _check_matches(rest if jax.tree.leaves(rest) else None, state.model_state, "state.model_state", subset=True)
  full = jax.tree.map(jnp.asarray, gather_state(state._replace(opt_state=None)))
  if full.model_state is None:
    nnx.update(model, full.params)
  else:
    nnx.update(model, full.params, full.model_state)
  return model


def _path(path: tuple) -> str:
  """`path` as `['l']['kernel']`, without an nnx Variable's `.value` (an nnx State and a pure dict agree)."""
  return jax.tree_util.keystr(tuple(k for k in path if getattr(k, "name", None) != "value"))


def _check_matches(expected: Any, got: Any, name: str, subset: bool = False) -> None:
  """Raises `ValueError` naming the first leaf of `got` whose presence, shape or dtype is not `expected`'s
  (the model's own variables, as `split` returns them): written into the model, it would replace them.
  `subset`: `got` may lack some of `expected`'s leaves (those are left as they are)."""
  if expected is None or got is None:
    return  # what nnx.update does with one side only is flax's (a state without model state writes params only)
  want = {_path(p): x for p, x in jax.tree_util.tree_leaves_with_path(expected)}
  have = {_path(p): x for p, x in jax.tree_util.tree_leaves_with_path(got)}
  for path in [*(p for p in want if not subset or p in have), *(p for p in have if p not in want)]:
    if path not in have or path not in want:
      where = "the state" if path in want else "the model"
      raise ValueError(f"{name}{path} is missing from {where}: the state was built for another model (its variables "
                       "differ); nothing was written into the model.")
    a, b = want[path], have[path]
    if np.shape(a) != np.shape(b) or np.dtype(a.dtype) != np.dtype(b.dtype):
      raise ValueError(
          f"{name}{path} has shape {np.shape(b)} and dtype {np.dtype(b.dtype)}, the model's has {np.shape(a)} and "
          f"{np.dtype(a.dtype)}: the state was trained for another model (or its params were changed); nothing was "
          "written into the model."
      )


def gather(layer: nnx.Module) -> nnx.Module:
  """One layer of a stack (`nnx.vmap`) with its whole parameters, inside `nnx.scan` over the stack.

  Layer-wise ZeRO-3 (`jaxdp.sharding.layerwise`): call it on the scan body's layer, `jaxdp.adapters.nnx.gather(layer)(x)`.
  Inside a jaxdp step at stage 3 with `layers=` naming the stack, each parameter split over the data axis
  is all-gathered; elsewhere the layer comes back unchanged. The result is a new Module sharing the layer's
  other state (RNG streams, statistics); its gathered parameters are not written back to the stack.
  """
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  return nnx.merge(graphdef, _gather_leaves(params), rest)



def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def stack_blocks(blocks: Any) -> nnx.Module:
  """A Python list of identical nnx blocks as one stacked block: what `layers=` and `jaxdp.scan_layers` take.

  Returns a module of the blocks' class whose every variable has a leading layer axis of size `N`
  (block `i` at index `i`), the module that `nnx.vmap` over the block's constructor makes; the
  partitioning metadata (`nnx.with_partitioning`) gets the layer axis unsplit. Set it in the model in
  place of the list (`model.blocks = stack_blocks(model.blocks)`), `split` the model, and run the
  stack with `jaxdp.scan_layers` over `nnx.split(model.blocks)`'s state (see docs/porting-nnx.md).

  Args:
    blocks: a list (or `nnx.List`) of modules of one class with identical variables (structure,
      shapes, dtypes).

  Raises:
    ValueError: an empty list, or blocks of different graphs, shapes or dtypes (the first that differs named).
    TypeError: an entry that is not an `nnx.Module`.
  """
  blocks = list(blocks) if not isinstance(blocks, nnx.Module) or isinstance(blocks, nnx.List) else None
  if not blocks:
    raise ValueError("blocks must be a non-empty list of nnx modules (e.g. model.blocks).")
  bad = [i for i, b in enumerate(blocks) if not isinstance(b, nnx.Module)]
  if bad:
    raise TypeError(f"blocks[{bad[0]}] is a {type(blocks[bad[0]]).__name__}, not an nnx.Module.")
  split = [nnx.split(b) for b in blocks]
  names = [f"blocks[{i}]" for i in range(len(blocks))]
  for (graphdef, _), name in zip(split[1:], names[1:]):
    if graphdef != split[0][0]:
      raise ValueError(f"{name} is not the same graph as blocks[0] (another class, layer or attribute); only "
                       "identical blocks stack.")
  states = [state for _, state in split]
  flax_support.check_identical(states, names, _is_variable)
  stacked = jax.tree.map(flax_support.stack_leaf, *states, is_leaf=_is_variable)
  return nnx.merge(split[0][0], stacked)


def unstack_blocks(stacked: nnx.Module) -> list[nnx.Module]:
  """The inverse of `stack_blocks`: a stacked block as the list of its `N` layers, each a block of its own.

  For the original model (`model.blocks = nnx.List(unstack_blocks(model.blocks))`): its checkpoints and
  its inference code. The layers' values are those of the stack at index `i`.

  Raises:
    ValueError: variables without a common leading (layer) axis.
  """
  if not isinstance(stacked, nnx.Module):
    raise TypeError(f"stacked must be an nnx.Module (from stack_blocks or nnx.vmap), got {type(stacked).__name__}.")
  graphdef, state = nnx.split(stacked)
  n = flax_support.stack_length(state, _is_variable, "stacked")
  return [nnx.merge(graphdef, jax.tree.map(lambda x: flax_support.unstack_leaf(x, i), state, is_leaf=_is_variable))
          for i in range(n)]
