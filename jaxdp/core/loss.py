"""The loss protocol: what jaxdp hands to `loss_fn` and what `loss_fn` may return.

`loss_fn(params, batch)` (or `loss_fn(params, batch, rng)` when the step
is given a PRNG key) returns unreduced losses: per-example `[b]` or
per-token `[b, t]`. jaxdp does the weighting and the reduction.

A real program needs more, so `loss_fn` may also declare any of these
keyword parameters, and jaxdp fills in the ones it declares (by name, or all
of them through `**kwargs`; the way optax passes extra arguments):

* `model_state`: this replica's non-trainable model state
  (`jaxdp.TrainState.model_state`, e.g. BatchNorm statistics);
* `weights`: this replica's weights for the rows (micro-batch) being
  evaluated, as given to the step (`[b]` or `[b, t]`; zero marks
  padding), or all ones `[b]` when the step got `weights=None`. Pass them
  to anything that computes across rows (BatchNorm's `mask`) so that
  padding never enters it;
* `axis_name`: the data-parallel axis the step runs over;
* `train`: `True` in the training step, `False` in the evaluation step
  (dropout off, BatchNorm on its running statistics).

and return a `LossOutput` instead of a bare array, to hand back the
new model state and named per-example (or per-token) metrics, which the step
reduces with the loss's weights into exact global weighted means.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import sys
from typing import Any, Callable, ContextManager, Iterable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.core.carries import promoting_carries
from jaxdp.core.integrations import LIBRARIES

LOSS_KEYWORDS = ("model_state", "weights", "axis_name", "train")
"""The keyword arguments jaxdp passes to a `loss_fn` that declares them."""


RESERVED_METRICS = ("loss", "weight", "grad_norm", "nonfinite", "skipped", "has_more", "replica_divergence")
"""Names the steps use in `metrics` themselves; a `loss_fn` metric may not take them."""


class LossOutput(NamedTuple):
  """What `loss_fn` may return instead of a bare array of losses.

  Attributes:
    losses: per-example `[b]` or per-token `[b, t]` losses, unreduced.
    model_state: the new model state (same structure, shapes and dtypes as
      the `model_state` it was given), or `None` for a model without
      state. A `loss_fn` given a model state must return one (return the
      input unchanged if the model does not update it).
    metrics: `{name: values}` with values of the losses' shape, e.g.
      `{"accuracy": logits.argmax(-1) == labels}`; reduced like the loss
      (exact global weighted mean under `reduction="mean"`).
  """

  losses: jax.Array
  model_state: Any = None
  metrics: Mapping[str, Any] | None = None


class ModelSupport(NamedTuple):
  """What a model library's integration adds to the core, registered with `register_model_support`.

  Attributes:
    tracing: `tracing(train) -> context manager`, entered around every
      `loss_fn` call the steps trace (e.g. guards that refuse statistics
      over padding rows while `train`).
    notes: `notes(error, loss_fn, notes) -> [str]`: the notes to add to an
      error raised inside `loss_fn`, given the core's `notes` (a list of
      str) for it: the library may add its own advice or drop a note that
      its own `loss_fn` makes redundant.
    unbox: `unbox(params) -> (params, specs)`: the library's metadata boxes
      removed from `params` and the partition specs they carried
      (`specs=None` when there are no boxes).
    before_step: `before_step(loss_fn) -> check`: a check that
      `jaxdp.make_train_step`'s step calls with no arguments on every
      call, before anything runs, or `None` for none.
    check_params: `check_params(params, name)`: raises for the library's
      objects given where a parameter tree goes (e.g. a whole model), naming
      the call that fixes it; `None` for none.
    check_optimizer: `check_optimizer(optimizer, name)`: raises for the
      library's objects given where an optax transformation goes (called
      only for what is not one); `None` for none.
    example_ids: `example_ids() -> context manager`, entered while a
      training step with `example_ids` traces `loss_fn` (e.g. the
      refusal of a library's own Dropout, which would draw one mask for
      every replica); `None` for none.
  """

  tracing: Callable[[bool], ContextManager] | None = None
  notes: Callable[[BaseException, Callable, list], Iterable[str]] | None = None
  unbox: Callable[[Any], tuple[Any, Any]] | None = None
  before_step: Callable[[Callable], Callable[[], None] | None] | None = None
  check_params: Callable[[Any, str], None] | None = None
  check_optimizer: Callable[[Any, str], None] | None = None
  example_ids: Callable[[], ContextManager] | None = None


_SUPPORT: list[ModelSupport] = []


def register_model_support(support: ModelSupport) -> None:
  """Adds `support` to what every later `model_support` returns (once per integration module)."""
  _SUPPORT.append(support)


def model_support() -> tuple[ModelSupport, ...]:
  """The registered `ModelSupport`, after importing the integration of every loaded library.

  A library in `jaxdp.core.integrations.LIBRARIES` that the program has
  imported gets its integration imported here, so that its guards hold even
  in a program that never imports that integration itself.
  """
  for library, module in LIBRARIES.items():
    if library in sys.modules and module not in sys.modules:
      importlib.import_module(module)
  return tuple(_SUPPORT)


@contextlib.contextmanager
def _supported_call(train: bool):
  with contextlib.ExitStack() as stack:
    for support in model_support():
      if support.tracing is not None:
        stack.enter_context(support.tracing(train))
    yield


# The data axis of the jaxdp step whose loss_fn is being traced (None outside one, or on one device):
# jaxdp.BatchNorm and masked_moments synchronise over it by default, whatever the mesh calls it.
_STEP_AXIS: contextvars.ContextVar = contextvars.ContextVar("jaxdp_step_axis", default=None)


def step_axis() -> Any:
  """The data axis (a name or a tuple) of the jaxdp step whose `loss_fn` is being traced, else `None`."""
  return _STEP_AXIS.get()


@contextlib.contextmanager
def in_step(axis_name: Any):
  """Traces what runs inside as part of a jaxdp step over `axis_name` (see `step_axis`).

  Loops in it accept initial carries made from constants (`jaxdp.core.carries.promoting_carries`).
  """
  token = _STEP_AXIS.set(axis_name)
  try:
    with promoting_carries():
      yield
  finally:
    _STEP_AXIS.reset(token)


# The row weights of the loss_fn call being traced (this replica's, of the current micro-batch): jaxdp's BatchNorm
# and masked_moments take them when no mask is given, as its Dropout takes the example ids.
_STEP_WEIGHTS: contextvars.ContextVar = contextvars.ContextVar("jaxdp_step_weights", default=None)


def step_weights() -> jax.Array | None:
  """The weights (`[b]` or `[b, t]`, 0 = padding) of the rows the jaxdp step's `loss_fn` is traced on, else
  `None`: this replica's, of the current micro-batch under `accum_steps`; all ones when the step got none."""
  return _STEP_WEIGHTS.get()


@contextlib.contextmanager
def using_step_weights(weights: Any):
  """Within this context, `step_weights` returns `weights` (`None` clears them)."""
  token = _STEP_WEIGHTS.set(weights)
  try:
    yield
  finally:
    _STEP_WEIGHTS.reset(token)


def declared_keywords(fn: Callable, names: tuple[str, ...]) -> frozenset:
  """The `names` that `fn` accepts as keyword arguments (all of them if it takes `**kwargs`)."""
  try:
    parameters = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # a callable without an inspectable signature takes none of them
    return frozenset()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return frozenset(names)
  keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  return frozenset(p.name for p in parameters if p.kind in keyword_kinds and p.name in names)


def loss_keywords(loss_fn: Callable) -> frozenset:
  """The names of `LOSS_KEYWORDS` that `loss_fn` accepts as keyword arguments."""
  return declared_keywords(loss_fn, LOSS_KEYWORDS)


def _positional(loss_fn: Callable) -> tuple[list, bool] | None:
  """`loss_fn`'s named positional parameters and whether it takes `*args`; `None` without a signature."""
  try:
    parameters = list(inspect.signature(loss_fn).parameters.values())
  except (TypeError, ValueError):
    return None
  positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  named = [p for p in parameters if p.kind in positional]
  return named, any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)


def _requires_rng(loss_fn: Callable) -> bool:
  """Whether `loss_fn` has a third positional parameter without a default (its key)."""
  named, _ = _positional(loss_fn) or ([], False)
  # A third parameter jaxdp fills by keyword (def loss_fn(params, batch, weights)) is not a key.
  return len(named) >= 3 and named[2].default is inspect.Parameter.empty and named[2].name not in loss_keywords(loss_fn)


def _accepts_rng(loss_fn: Callable) -> bool:
  """Whether `loss_fn` can take a key as a third positional argument (one not filled by a jaxdp keyword)."""
  found = _positional(loss_fn)
  if found is None:  # no signature to judge by: let the call say
    return True
  named, var_positional = found
  if len(named) >= 3:
    return named[2].name not in loss_keywords(loss_fn)
  return var_positional


def check_loss_fn(loss_fn: Any, *, with_model_state: bool = False) -> None:
  """Raises `TypeError` unless `loss_fn` is callable and, `with_model_state`, accepts `model_state`."""
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}; pass loss_fn(params, batch) -> losses.")
  if with_model_state and "model_state" not in loss_keywords(loss_fn):
    raise TypeError(
        "state.model_state is not None but loss_fn takes no model_state argument; declare it "
        "(def loss_fn(params, batch, *, model_state): ...) and return "
        "jaxdp.LossOutput(losses, model_state=new_model_state), or build the state without model_state."
    )


def call_loss(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    rng: jax.Array | None,
    *,
    model_state: Any,
    weights: jax.Array,
    axis_name: str | None,
    train: bool,
) -> LossOutput:
  """Calls `loss_fn` with the arguments it declares and checks what it returns.

  Returns a `LossOutput` whose `metrics` is a dict (possibly empty)
  and whose `model_state` has the structure, shapes and dtypes of the
  input's. Checks run while tracing, on abstract values, inside the mapped
  context (so a `loss_fn` that uses collectives is fine).
  """
  available = {"model_state": model_state, "weights": weights, "axis_name": axis_name, "train": train}
  keywords = {k: available[k] for k in loss_keywords(loss_fn)}
  args = (params, batch) if rng is None else (params, batch, rng)
  if rng is None and _requires_rng(loss_fn):
    raise TypeError(
        f"loss_fn takes a PRNG key as its third argument ({_positional(loss_fn)[0][2].name!r}) without a default, and "
        "this call has none: evaluation (make_eval_step) and a step called without rng= call loss_fn(params, batch). Give "
        "it a default (def loss_fn(params, batch, rng=None, ...)) and run without dropout when it is None, or pass "
        "rng=jax.random.key(...) to the training step. Nothing ran and nothing was donated."
    )
  if rng is not None and not _accepts_rng(loss_fn):
    raise TypeError(
        "rng= was passed to the step, but loss_fn takes no PRNG key: jaxdp passes the key as loss_fn's third "
        "positional argument. Declare it (def loss_fn(params, batch, rng, ...), each replica and micro-batch gets "
        "its own key), or call the step without rng=. Nothing ran and nothing was donated."
    )
  try:
    with in_step(axis_name), using_step_weights(weights), _supported_call(train):
      out = loss_fn(*args, **keywords)
  except Exception as e:  # the user's own error, unchanged: only say where it happened
    where = ("the training step was traced on one device's slice of the batch (or one micro-batch of it under "
             "accum_steps; " if train else "the evaluation step was traced on one device's slice of the batch (")
    e.add_note(
        f"jaxdp: raised inside loss_fn while {where}{np.shape(weights)[0]} rows), called with params of structure "
        f"{_structure(params)}; nothing ran and nothing was donated."
    )
    if rng is None and "rng" in f"{type(e).__name__} {e}".lower():  # "Dropout_0 needs PRNG", "rngs"
      e.add_note(_missing_key_note(loss_fn, train))
    if "carry input and carry output must have equal types" in str(e):
      e.add_note(
          "jaxdp: a loop carry that starts the same on every device becomes per-device in the loop. jaxdp casts "
          "such an initial carry when the loop body's output varies directly; one that varies only through another "
          f"carry, an iteration later, needs jaxdp.as_varying(initial_value, {axis_name!r}) (it returns the value "
          "unchanged outside a step, so the same loss runs on one device)."
      )
    notes = []
    if model_state is None and "model_state" in keywords:
      # A loss may take None for a stateless model; one that needs state got None because the state has none.
      notes.append(
          "jaxdp: loss_fn was called with model_state=None: the state was built without model state. If the "
          "model has some (BatchNorm statistics), pass it where the state is made: jaxdp.init_state(params, "
          "optimizer, mesh, model_state=...), and CheckpointManager.restore(..., model_state=...) when resuming."
      )
    for support in model_support():
      if support.notes is not None:
        notes = list(support.notes(e, loss_fn, notes))
    for note in notes:
      e.add_note(note)
    raise
  if isinstance(out, LossOutput):
    losses, new_state, metrics = out
  elif isinstance(out, tuple):
    rows = np.shape(weights)[0]
    if out and np.shape(out[0]) == () and hasattr(out[0], "dtype") and rows:  # upstream's (mean_loss, logits)
      raise TypeError(
          f"loss_fn returned a {type(out).__name__} of {len(out)} items whose first, the loss, is "
          + _SCALAR_MEAN.format(rows=rows) + ". Extra outputs go into jaxdp.LossOutput(losses, metrics={name: "
          "values}) as per-example values (e.g. {'accuracy': logits.argmax(-1) == labels}), reduced like the loss."
      )
    raise TypeError(
        f"loss_fn returned a {type(out).__name__} of {len(out)} items; return the per-example losses, or "
        "jaxdp.LossOutput(losses, model_state=..., metrics={...}) for model state and metrics (per-example values, "
        "e.g. {'accuracy': logits.argmax(-1) == labels}; not the logits themselves)."
    )
  else:
    losses, new_state, metrics = out, None, None
  _check_losses(losses, np.shape(weights)[0])
  metrics = _check_metrics(metrics, losses)
  if model_state is not None or new_state is not None:
    _check_model_state(model_state, new_state)
  return LossOutput(losses, new_state, metrics)


def _missing_key_note(loss_fn: Callable, train: bool) -> str:
  """What to do about an error that asks for a PRNG key, raised inside a `loss_fn` called without one."""
  if not train:
    return ("jaxdp: loss_fn was called without a PRNG key (rng=None): evaluation (make_eval_step) passes none; run "
            "without dropout there (train=False, or rng is None: deterministic=True / model.eval()).")
  if not _accepts_rng(loss_fn):
    return ("jaxdp: loss_fn was called without a PRNG key, and it takes none: declare one as its third argument "
            "(def loss_fn(params, batch, rng=None, ...), handed to the model, e.g. rngs={'dropout': rng}) and call "
            "the step with it, step(state, batch, weights, rng=key); each replica and step then gets its own key.")
  return ("jaxdp: loss_fn was called without a PRNG key (rng=None): the step was called without rng=; a model with "
          "dropout needs step(state, batch, weights, rng=key) (train_step(..., rng=key) inside your own shard_map).")


_SCALAR_MEAN = ("a scalar (shape ()), a mean, where per-example losses [b] (or per-token losses [b, t]) belong, "
                "b={rows} (this device's rows); return the unreduced losses: jaxdp computes the weighted mean itself, "
                "over every device, with the weights")


def scalar_mean_message(subject: str, rows: int | None) -> str:
  """`"<subject> a scalar ... where per-example losses belong ..."`: the message for a mean returned as the loss."""
  return f"{subject} " + _SCALAR_MEAN.format(rows="the batch's rows" if rows is None else rows)


def _check_losses(losses: Any, rows: int) -> None:
  shape, dtype = np.shape(losses), getattr(losses, "dtype", None)
  if shape == () and dtype is not None and rows:
    raise ValueError(scalar_mean_message("loss_fn returned", rows) + ".")
  if dtype is None or len(shape) not in (1, 2) or shape[0] != rows:
    raise ValueError(
        f"loss_fn must return per-example losses [b] or per-token losses [b, t] with b={rows} rows "
        f"(this device's slice), but it returned {_describe(losses)}; return the unreduced losses, jaxdp "
        "does the weighting."
    )
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"loss_fn returned losses of dtype {dtype}; losses must be floating point to be differentiated "
        "(cast them, e.g. losses.astype(jnp.float32))."
    )


def _check_metrics(metrics: Any, losses: jax.Array) -> dict:
  if metrics is None:
    return {}
  if not isinstance(metrics, Mapping):
    raise TypeError(f"LossOutput.metrics must be a dict {{name: values}}, got {type(metrics).__name__}.")
  checked = {}
  for name, values in metrics.items():
    if not isinstance(name, str) or name in RESERVED_METRICS or not name:
      raise ValueError(
          f"metric name {name!r} is not allowed; use a non-empty string other than "
          f"{', '.join(map(repr, RESERVED_METRICS))}, which the step reports itself."
      )
    if np.shape(values) != np.shape(losses):
      raise ValueError(
          f"metric {name!r} has shape {np.shape(values)} but the losses have shape {np.shape(losses)}; return one "
          "value per example (or per token), unreduced, so the step can weight it like the loss."
      )
    checked[name] = jnp.asarray(values)
  return checked


def _structure(tree: Any, limit: int = 300) -> str:
  text = str(jax.tree.map(lambda x: f"{getattr(x, 'dtype', '?')}{list(np.shape(x))}", tree))
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(x: Any) -> str:
  return f"shape {np.shape(x)}, dtype {getattr(x, 'dtype', type(x).__name__)}"


def _check_model_state(given: Any, returned: Any) -> None:
  if given is None:
    raise ValueError(
        "loss_fn returned a model_state but the state has none; build the state with "
        "jaxdp.init_state(params, optimizer, mesh, model_state=initial_model_state)."
    )
  if returned is None:
    raise ValueError(
        "loss_fn was given a model_state but returned none; return jaxdp.LossOutput(losses, "
        "model_state=new_model_state) (the input unchanged if the model does not update it), else the "
        "model's statistics would silently never change."
    )
  given_leaves, given_tree = jax.tree_util.tree_flatten_with_path(given)
  returned_leaves, returned_tree = jax.tree_util.tree_flatten_with_path(returned)
  if given_tree != returned_tree:
    raise ValueError(
        f"loss_fn returned a model_state of another structure than it was given:\n  given:    {given_tree}\n"
        f"  returned: {returned_tree}\nreturn the updated state with the input's structure."
    )
  for (path, a), (_, b) in zip(given_leaves, returned_leaves):
    if np.shape(a) != np.shape(b) or jnp.result_type(a) != jnp.result_type(b):
      raise ValueError(
          f"loss_fn returned model_state{jax.tree_util.keystr(path)} with {_describe(b)}, but it was given "
          f"{_describe(a)}; keep every leaf's shape and dtype."
      )
