"""Layout-invariant randomness: per-example keys from each example's global id.

By default a step gives each replica its own key, `fold_in(fold_in(rng,
step), axis_index)` (and `fold_in(·, i)` for micro-batch `i`), so a
dropout mask depends on where an example lands: no device count, split or
`accum_steps` reproduces another. With `make_train_step(...,
example_ids="id")` (or `train_step`, `gradient_step`,
`local_gradient`) the step instead

* gives `loss_fn` the same key on every replica and micro-batch,
  `fold_in(rng, state.step)`; flax's own rng machinery (linen's
  `make_rng`, nnx's streams, per layer and per `scan` iteration) derives
  each layer's key from it, the same everywhere;
* makes the ids of the rows being traced (`batch["id"]`, or
  `example_ids(batch)` for a callable) available while `loss_fn` runs:
  `jaxdp.adapters.nnx.Dropout` and `jaxdp.adapters.linen.Dropout` then draw row
  `r`'s mask from `fold_in(layer_key, id_r)`, and `example_keys`
  gives those keys to any other per-example randomness.

An example's mask then depends on its id, the step and the layer only: the
same on 1 or N devices, for any split, padding or `accum_steps`, and in the
plain one-device program that sets the ids with `use_example_ids`.
Ids must be unique among the real rows of a global batch (e.g. the index in
the dataset); a weight-0 padding row may repeat one.

The key is then the same on every replica: any randomness drawn from it
without the ids (flax's own `Dropout`, `jax.random.bernoulli(key,
shape=x.shape)`) repeats the same numbers on every device, correlated
noise that no test of the loss shows. flax's own `nnx.Dropout` and
`linen.Dropout` are refused in a step with `example_ids`; anything else
must draw per example, from `example_keys`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdp.core.loss import model_support

__all__ = ["current_example_ids", "example_keys", "use_example_ids"]

# The ids of the rows loss_fn is being traced on (a [b] integer array), or None outside such a step.
_IDS: contextvars.ContextVar = contextvars.ContextVar("jaxdp_example_ids", default=None)


def check_example_ids(example_ids: Any) -> None:
  """Raises `TypeError` unless `example_ids` is `None`, a key of a dict batch (a str) or a callable."""
  if example_ids is not None and not isinstance(example_ids, str) and not callable(example_ids):
    raise TypeError(
        f"example_ids must be None, the key of the ids in a dict batch (a str, e.g. 'id') or a callable "
        f"batch -> [b] integer ids, got {type(example_ids).__name__}."
    )


def ids_of(batch: Any, example_ids: str | Callable[[Any], Any]) -> jax.Array:
  """The `[b]` integer ids of `batch`'s rows: `batch[example_ids]` or `example_ids(batch)`."""
  check_example_ids(example_ids)
  if callable(example_ids):
    ids = example_ids(batch)
  elif not isinstance(batch, Mapping) or example_ids not in batch:
    keys = list(batch) if isinstance(batch, Mapping) else None
    raise ValueError(
        f"example_ids={example_ids!r} but the batch has no such key ("
        + (f"its keys: {keys}" if keys is not None else f"it is a {type(batch).__name__}, not a dict")
        + "); put each example's global id (e.g. its index in the dataset) in the batch under that key, or pass "
        "a callable batch -> [b] ids."
    )
  else:
    ids = batch[example_ids]
  ids = jnp.asarray(ids)
  rows = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.shape(x)}
  if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer) or (rows and ids.shape[0] not in rows):
    raise ValueError(
        f"the example ids have shape {ids.shape} and dtype {ids.dtype}; give one integer id per row, shape [b] "
        f"(b the batch's leading size{', here ' + str(max(rows)) if rows else ''})."
    )
  return ids


def _checked_ids(ids: Any, name: str) -> jax.Array:
  """`ids` as an array, or a `ValueError` unless they are `[b]` integers (a float id was truncated silently)."""
  ids = jnp.asarray(ids)
  if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(
        f"{name} must be [b] integer ids, one per row (e.g. each example's index in the dataset), got shape "
        f"{ids.shape} and dtype {ids.dtype}; cast whole-number ids with .astype(np.int32)."
    )
  return ids


@contextlib.contextmanager
def use_example_ids(ids: Any):
  """Within this context, `example_keys` and jaxdp's `Dropout` layers draw per example with `ids`.

  The steps enter it themselves around `loss_fn` when given `example_ids`;
  call it directly in a plain one-device program (the reference a
  data-parallel run must equal) or a hand-written step: `ids` `[b]`
  integers, one per row of the batch the model is called on. `None`
  clears the ids (jaxdp's layers then behave as flax's).
  """
  token = _IDS.set(None if ids is None else _checked_ids(ids, "ids"))
  try:
    yield
  finally:
    _IDS.reset(token)


def current_example_ids() -> jax.Array | None:
  """The ids set by `use_example_ids` (or by a step with `example_ids`), else `None`."""
  return _IDS.get()


def example_keys(key: jax.Array, ids: Any = None) -> jax.Array:
  """`[b]` keys, `fold_in(key, id)` for each row's id: per-example randomness that ignores the layout.

  Args:
    key: one key, the same on every replica (e.g. `self.make_rng("noise")`
      in linen, `rngs.noise()` in nnx, or the `rng` a step with
      `example_ids` gives `loss_fn`).
    ids: `[b]` integer ids; default the current ones (inside a step with
      `example_ids`, or `use_example_ids`).

  Returns:
    `[b]` keys: draw row `r`'s numbers from `keys[r]` (e.g. with
    `jax.vmap`).
  """
  ids = current_example_ids() if ids is None else _checked_ids(ids, "ids")
  if ids is None:
    raise ValueError(
        "example_keys needs the rows' ids: call it inside a step built with example_ids= (make_train_step(..., "
        "example_ids='id')), inside jaxdp.use_example_ids(ids), or pass ids=."
    )
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, ids)


def dropout(inputs: jax.Array, rate: float, broadcast_dims: Sequence[int], key: jax.Array,
            ids: jax.Array | None) -> jax.Array:
  """Inverted dropout of `inputs` (rows on axis 0), flax's formula; per-row masks from `fold_in(key, id)`.

  `ids=None`, or `broadcast_dims` holding the row axis (one mask shared by
  every row, drawn from `key` alone, the same everywhere): exactly flax's
  `Dropout` with `key`. `0 < rate < 1`.
  """
  keep_prob = 1.0 - rate
  shape = list(inputs.shape)
  for dim in broadcast_dims:
    shape[dim] = 1
  shared = inputs.ndim == 0 or any(dim % inputs.ndim == 0 for dim in broadcast_dims)  # one mask for all rows
  if ids is None or shared:
    mask = jax.random.bernoulli(key, p=keep_prob, shape=shape)
  else:
    if inputs.shape[0] != ids.shape[0]:
      raise ValueError(
          f"jaxdp's Dropout draws one mask per row of axis 0 from the example ids, but its input has shape "
          f"{inputs.shape} and there are {ids.shape[0]} ids: apply it to inputs whose leading axis is the batch "
          "(e.g. [b, t, d], not time-major [t, b, d]), or draw with jaxdp.example_keys yourself."
      )
    mask = jax.vmap(lambda k: jax.random.bernoulli(k, p=keep_prob, shape=shape[1:]))(example_keys(key, ids))
  mask = jnp.broadcast_to(mask, inputs.shape)
  return lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))


@contextlib.contextmanager
def per_example(batch: Any, example_ids: Any, *, train: bool):
  """Entered around `loss_fn` by the steps: the batch's ids (when `example_ids` is set) and, in training,
  flax linen's own `Dropout` refused (it would draw the same mask on every replica)."""
  if example_ids is None:
    yield
    return
  with contextlib.ExitStack() as stack:
    stack.enter_context(use_example_ids(ids_of(batch, example_ids)))
    if train:  # a model library's refusals (flax linen's own Dropout)
      for support in model_support():
        if support.example_ids is not None:
          stack.enter_context(support.example_ids())
    yield


def check_unique_ids(batch: Any, weights: Any, example_ids: Any) -> None:
  """Refuses host ids (`batch[example_ids]`, a numpy array) that repeat among the real rows (weight > 0) of a
  global batch: those rows would draw the same dropout masks. Ids on the devices are not read (that would wait
  for them); a callable's ids are computed inside the step."""
  if not isinstance(example_ids, str) or not isinstance(batch, Mapping):
    return
  ids = batch.get(example_ids)
  if not isinstance(ids, np.ndarray) or ids.ndim != 1 or isinstance(weights, jax.Array):
    return
  real = ids
  if weights is not None:
    w = np.asarray(weights)
    if w.shape[:1] != ids.shape:
      return  # the step's own shape check names this
    real = ids[np.any(w.reshape(w.shape[0], -1) > 0, axis=1)]
  values, counts = np.unique(real, return_counts=True)
  if np.any(counts > 1):
    raise ValueError(
        f"example_ids={example_ids!r}: the ids {values[counts > 1][:5].tolist()} repeat among the real rows "
        "(weight > 0) of this batch; rows with one id draw the same dropout masks. Give each example its own id "
        "(e.g. its index in the dataset); only padding rows (weight 0) may repeat one. Nothing ran and nothing "
        "was donated."
    )
