"""Host-side validation of step inputs: shapes and structure only, never values.

Runs before anything is traced, executed or donated, so a bad call leaves the
caller's state usable. Results are cached per input signature by the caller.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import jax
import numpy as np

from jaxdp.core.loss import check_loss_fn, model_support
from jaxdp.core.state import TrainState


def check_int(value: Any, name: str, minimum: int, fix: str = "") -> int:
  """`value` as a Python int (not a bool), or a `ValueError` naming `name`, the bound and the fix."""
  try:
    as_int = None if isinstance(value, bool) else operator.index(value)
  except TypeError:
    as_int = None
  if as_int is None or as_int < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}" + (f"; {fix}" if fix else "."))
  return as_int


def check_optimizer(optimizer: Any, name: str = "optimizer") -> None:
  """Raises `TypeError` unless `optimizer` is an optax `GradientTransformation` (has `init` and `update`)."""
  if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
    return
  for support in model_support():  # a model library's own optimizer object (flax's nnx.Optimizer)
    if support.check_optimizer is not None:
      support.check_optimizer(optimizer, name)
  if callable(optimizer):
    what = getattr(optimizer, "__qualname__", type(optimizer).__name__)
    raise TypeError(
        f"{name} is the function {getattr(optimizer, '__module__', '') or ''}.{what} itself, not an optimizer; "
        f"call it, e.g. {name}=optax.adam(learning_rate=1e-3)."
    )
  raise TypeError(f"{name} must be an optax.GradientTransformation (init, update), got {type(optimizer).__name__}.")


def check_params(params: Any, name: str = "params") -> None:
  """Refuses what a model library's integration recognises as a natural mistake where a parameter tree goes (flax:
  an nnx Module, an nnx State with RNG variables, a linen variables dict), with the jaxdp call that fixes it."""
  for support in model_support():
    if support.check_params is not None:
      support.check_params(params, name)


def check_has_more(has_more: Any) -> None:
  """Refuses `has_more` counts that are not integers (a fractional one was truncated silently) or, on the host,
  negative; called where `has_more` enters a step (shapes are the step's own check)."""
  if has_more is None:
    return
  dtype = getattr(has_more, "dtype", None)
  dtype = np.asarray(has_more).dtype if dtype is None else np.dtype(dtype)
  if not (np.issubdtype(dtype, np.integer) or dtype == np.bool_):
    raise ValueError(
        f"has_more must hold integer counts (int32, one per device, as jaxdp.StreamingPipeline yields them), got "
        f"dtype {dtype}: a fractional count would be truncated. Pass whole counts, e.g. np.asarray(counts, "
        "np.int32). Nothing ran and nothing was donated."
    )
  if not isinstance(has_more, jax.Array):  # host values (a jax.Array is not read: that would wait for the device)
    values = np.asarray(has_more)
    if values.size and values.min() < 0:
      raise ValueError(f"has_more holds negative counts ({values.min()}); counts are >= 0 (1 where a process's "
                       "stream has more examples, else 0). Nothing ran and nothing was donated.")


# The batches jaxdp padded (split_batch, shard_uneven, the pipelines), by the id of each of their arrays. Such a
# batch is correct only with its weights (0 on the padding rows), and a jax.Array cannot carry them (it takes no
# attributes and cannot be subclassed; a wrapper would change what the user's batch is), so a step given one
# without weights recognises it by identity. Weak references: an entry goes with its array and keeps nothing
# alive; a global because the batch may reach any step or process-wide helper (as _donated below).
_padded: dict[int, weakref.ref] = {}


def mark_padded(batch: Any) -> None:
  """Records the arrays of `batch` as jaxdp-padded: a step refuses them without weights."""
  for leaf in jax.tree.leaves(batch):
    if isinstance(leaf, jax.Array):
      key = id(leaf)
      _padded[key] = weakref.ref(leaf, lambda _, key=key: _padded.pop(key, None))


def check_padded_weights(batch: Any, weights: Any) -> None:
  """Refuses a batch that `jaxdp.split_batch`, `jaxdp.shard_uneven` or a pipeline padded, given without
  its weights: its padding rows would train as real rows (`weights=None` means all ones). Identity checks only,
  and none when weights are given."""
  if weights is not None or not _padded:
    return
  for leaf in jax.tree.leaves(batch):
    ref = _padded.get(id(leaf))
    if ref is not None and ref() is leaf:
      raise ValueError(
          "weights is None, but batch was padded by jaxdp.split_batch, jaxdp.shard_uneven or a jaxdp pipeline, "
          "whose padding rows have weight 0: without its weights the step would count them as real rows (None "
          "means weight 1 for every row). Pass the weights that came with it: batch, weights = "
          "jaxdp.split_batch(data, mesh); step(state, batch, weights). Nothing ran and nothing was donated."
      )


def check_float_dtype(dtype: Any, name: str, examples: str = "jnp.bfloat16, jnp.float16 or jnp.float32") -> Any:
  """`dtype` as a numpy floating dtype (`None` passes through), or a `ValueError` naming `name`."""
  if dtype is None:
    return None
  try:
    resolved = np.dtype(dtype)
  except TypeError:
    resolved = None
  if resolved is None or not jax.dtypes.issubdtype(resolved, np.floating):
    raise ValueError(f"{name}={dtype!r} is not a floating dtype; use e.g. {examples}.")
  return resolved


def check_reduce_dtype(dtype: Any, name: str) -> Any:
  """A floating dtype with float32's exponent range (`None` passes), or a `ValueError` naming `name`.

  The gradient is reduced as weighted *sums* (divided by the global weight after the all-reduce, so that the
  mean is exact): float16's range (65,504) overflows on them at ordinary batch sizes, and every step would
  be skipped as non-finite. bfloat16 has float32's range with half the bytes.
  """
  resolved = check_float_dtype(dtype, name, "jnp.bfloat16 or jnp.float32")
  if resolved is not None and jax.numpy.finfo(resolved).nmant < jax.numpy.finfo(jax.numpy.bfloat16).nmant:
    # float8_e8m0fnu has float32's range but no sign and no mantissa: every gradient would be skipped.
    raise ValueError(
        f"{name}={dtype!r} has {jax.numpy.finfo(resolved).nmant} mantissa bits, fewer than bfloat16's 7: the "
        "gradient would not survive the reduction. Use jnp.bfloat16 (half the bytes) or float32."
    )
  if resolved is not None and jax.numpy.finfo(resolved).maxexp < jax.numpy.finfo(np.float32).maxexp:
    raise ValueError(
        f"{name}={dtype!r} has a narrower range than float32 (largest {float(jax.numpy.finfo(resolved).max):.6g}); "
        "jaxdp reduces the gradient as weighted sums, divided by the global weight only after the all-reduce, and "
        "these overflow it. Use jnp.bfloat16 (float32's range, half the bytes) or float32."
    )
  return resolved


def as_array(x: Any) -> Any:
  """`x`, or a numpy array of it if it is a list or tuple: `weights=[1, 0, 1]` is one array, not a pytree."""
  return np.asarray(x) if isinstance(x, (list, tuple)) else x


# Arrays a donating step was given, by id. Donation does not always delete the buffer: on CPU a live numpy
# view of it (np.asarray(state.params[...])) makes XLA keep it, so is_deleted() alone would let such a state
# run again from stale values on one backend and be refused on another.
_donated: dict[int, weakref.ref] = {}


def mark_donated(leaves: list) -> None:
  """Records the arrays of `leaves` as consumed by a donating step, whether or not XLA deleted them."""
  for leaf in leaves:
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      key = id(leaf)
      _donated[key] = weakref.ref(leaf, lambda _, key=key: _donated.pop(key, None))


def is_donated(leaf: Any) -> bool:
  """Whether `leaf` is an array an earlier step consumed (deleted, or recorded by `mark_donated`)."""
  if not isinstance(leaf, jax.Array):
    return False
  ref = _donated.get(id(leaf))
  return (ref is not None and ref() is leaf) or leaf.is_deleted()


def check_not_donated(state: Any, leaves: list | None = None, name: str = "state") -> None:
  """Raises `ValueError` if any array of `state` was donated (deleted) by an earlier step.

  `leaves`: `jax.tree.leaves(state)` when the caller has them (the key
  paths, slower to build, are then made only for the error message).
  `name`: how the caller's argument is called, for the message.
  """
  leaves = jax.tree.leaves(state) if leaves is None else leaves
  if not any(is_donated(leaf) for leaf in leaves):
    return
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if is_donated(leaf):
      raise ValueError(
          f"{name}{jax.tree_util.keystr(path)} was donated to an earlier step (its buffer is consumed, even where "
          "a live view of it kept XLA from deleting it); a step consumes the state it is given. Pass the state "
          "that step returned (state, metrics = step(state, ...)), or build the step with donate=False to keep "
          "inputs alive."
      )


def unshared_buffers(state: Any) -> Any:
  """`state` with every array that appears twice (the same buffer in two leaves) copied.

  Donation hands each input buffer to the output once; a buffer reached from
  two leaves (`TrainState.create({"a": z, "b": z}, opt)`) cannot be donated
  twice, which XLA reports as a crash rather than an error.
  """
  leaves, treedef = jax.tree.flatten(state)
  seen: set = set()
  out = []
  for leaf in leaves:
    key = buffer_key(leaf)
    if key is not None and key in seen:
      leaf = leaf.copy()
    elif key is not None:
      seen.add(key)
    out.append(leaf)
  return jax.tree.unflatten(treedef, out)


def buffer_key(leaf: Any) -> Any:
  if not isinstance(leaf, jax.Array):
    return None
  try:
    return tuple(shard.data.unsafe_buffer_pointer() for shard in leaf.addressable_shards)
  except Exception:  # no pointer for this kind of buffer: fall back to the object's identity
    return id(leaf)


def check_rng(rng: Any) -> None:
  """Raises `ValueError` unless `rng` is `None`, a typed PRNG key or raw `uint32` key data."""
  if rng is None:
    return
  dtype = getattr(rng, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if np.shape(rng) == ():
      return
    raise ValueError(
        f"rng must be one PRNG key, got an array of {list(np.shape(rng))} keys; pass a single key, e.g. "
        "rng=jax.random.key(0) (jaxdp derives per-replica, per-step keys from it)."
    )
  # Raw key data: uint32 of the shape the default PRNG implementation's keys have (e.g. [2] for threefry).
  if dtype is not None and np.dtype(dtype) == np.uint32 and np.shape(rng) == _raw_key_shape():
    return
  raise ValueError(
      f"rng must be a PRNG key, e.g. rng=jax.random.key(0) (or jax.random.PRNGKey(0)), got "
      f"{type(rng).__name__} {getattr(rng, 'dtype', '')}{list(np.shape(rng))}; pass a key, the same on every call "
      "and process (jaxdp derives per-replica, per-step keys from it), or rng=None."
  )


def _raw_key_shape() -> tuple[int, ...]:
  return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def check_params_dtypes(params: Any, name: str = "state.params") -> None:
  """Raises `TypeError` if a parameter is not floating point (or complex): it cannot be differentiated."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    # Not getattr(leaf, "dtype", np.asarray(leaf).dtype): the default would copy every parameter to the host (and
    # fail for one split across processes).
    dtype = np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
    if not (jax.dtypes.issubdtype(dtype, np.floating) or jax.dtypes.issubdtype(dtype, np.complexfloating)):
      raise TypeError(
          f"{name}{jax.tree_util.keystr(path)} has dtype {dtype}; parameters are differentiated, so they must be "
          "floating point. Cast it (e.g. .astype(np.float32)), or keep integer values in model_state."
      )


def _abstract(x: Any) -> tuple:
  return (np.shape(x), str(getattr(x, "dtype", type(x).__name__)))


def signature(*trees: Any) -> tuple:
  """A hashable key for the structure, shapes and dtypes of `trees`."""
  leaves, treedef = jax.tree.flatten(trees)
  return treedef, tuple(_abstract(x) for x in leaves)


def batch_size(batch: Any, name: str = "batch") -> int:
  """The common leading size of every leaf of `batch`."""
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError(f"{name} has no arrays; pass a pytree of arrays with a leading batch axis.")
  sizes = {}
  for path, leaf in leaves:
    shape = np.shape(leaf)
    if len(shape) == 0:
      raise ValueError(f"{name}{jax.tree_util.keystr(path)} is a scalar; every leaf needs a leading batch axis.")
    sizes.setdefault(shape[0], jax.tree_util.keystr(path))
  if len(sizes) > 1:
    detail = ", ".join(f"{p or '<root>'}: {s}" for s, p in sizes.items())
    raise ValueError(f"{name} leaves disagree on the leading (batch) size ({detail}); give every leaf the same leading size.")
  return next(iter(sizes))


def check_state(state: Any, name: str = "state") -> None:
  if not isinstance(state, TrainState):
    kind = type(state)
    advice = ""
    if kind.__module__.startswith("flax"):
      advice = (" A flax TrainState's batch_stats go to model_state=, its tx to init_state and the step, and its "
                "apply_fn into loss_fn.")
    elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], TrainState):
      advice = f" This is a (state, metrics) pair: unpack the step's result, {name}, metrics = step(...)."
    raise TypeError(
        f"{name} must be a jaxdp.TrainState, got {kind.__module__}.{kind.__qualname__}; build it with "
        f"jaxdp.init_state(params, optimizer, mesh, model_state=...).{advice}"
    )


def check_opt_state(state, optimizer, name: str = "state") -> None:
  """`state.opt_state` must be what `optimizer.init(state.params)` builds (structure, shapes, dtypes).

  Shardings are not checked: the step places the state in its own layout
  (any ZeRO stage, device count or mesh shape holds the same arrays).
  """
  try:
    expected = jax.eval_shape(optimizer.init, state.params)
  except Exception as e:  # the user's optimizer and params: any failure means they do not fit
    raise ValueError(
        f"optimizer.init fails on {name}.params ({type(e).__name__}: {e}); {name}.params is not a valid parameter tree."
    ) from e
  if signature(expected) != signature(state.opt_state):
    raise ValueError(
        f"{name}.opt_state does not match optimizer.init({name}.params) in structure, shape or dtype"
        f"{_first_difference(expected, state.opt_state, name + '.opt_state')}; the state was built for other params "
        "or another optimizer: rebuild it with jaxdp.init_state, or give the leaf its init's shape and dtype."
    )


def _first_difference(expected: Any, got: Any, name: str) -> str:
  """`": <name>[path] is a Python float where init gives float32[]..."` for the first leaf that differs."""
  expected_leaves, expected_def = jax.tree_util.tree_flatten_with_path(expected)
  got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
  if expected_def != got_def:
    return " (its tree structure is not the one init gives)"
  for (path, want), (_, have) in zip(expected_leaves, got_leaves):
    if _abstract(want) != _abstract(have):
      # E.g. an inject_hyperparams value set to a Python float (one device's optax takes it): say how to set it.
      fix = f"; set it as jnp.asarray(value, jnp.{want.dtype})" if np.shape(have) == want.shape else ""
      return (f": {name}{jax.tree_util.keystr(path)} is {_describe(have)} where init gives "
              f"{want.dtype}{list(want.shape)}{fix}")
  return ""


def _describe(x: Any) -> str:
  if not hasattr(x, "dtype"):
    return f"a Python {type(x).__name__}"
  return f"{x.dtype}{list(np.shape(x))}"


def check_batch_split(batch: Any, weights: Any, n_replicas: int, accum_steps: int = 1) -> None:
  """The batch must split evenly over the devices (and micro-batches); weights must have its rows."""
  total = batch_size(batch)
  if total % n_replicas:
    raise ValueError(
        f"batch has leading size {total}, which does not split evenly over {n_replicas} devices; "
        "split it with jaxdp.split_batch(batch, mesh, weights=weights), which pads the shorter devices with "
        "weight-0 rows (jaxdp.shard_uneven does the same for per-device portions you already have), or pad it "
        f"yourself to a multiple of {n_replicas}."
    )
  if (total // n_replicas) % accum_steps:
    raise ValueError(
        f"batch has {total // n_replicas} rows per device ({total} over {n_replicas} devices), which do not "
        f"split into accum_steps={accum_steps} micro-batches; make the batch a multiple of {n_replicas * accum_steps} "
        f"rows (jaxdp.split_batch and jaxdp.shard_uneven pad every device to its largest portion: pass rows= a "
        f"multiple of {accum_steps}; "
        f"a jaxdp.DataPipeline pads to per_device_batch: choose it a multiple of {accum_steps}, keeping the global "
        "batch with fewer devices or another per-device size)."
    )
  if weights is not None and (np.ndim(weights) not in (1, 2) or np.shape(weights)[0] != total):
    raise ValueError(
        f"weights has shape {np.shape(weights)} but the batch has {total} rows; pass one weight per example "
        f"[{total}] (or per token [{total}, t]), 0 for padding, or weights=None for all ones."
    )


def check_weights_dtype(weights: Any) -> None:
  """Refuses weights that are a PRNG key (typed, or raw uint32 key data): `step(state, batch, key)` puts the key
  in the weights' place, and raw key data of a 2-row batch would silently become the example weights."""
  dtype = getattr(weights, "dtype", None)
  if dtype is None:
    return
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or (
      isinstance(weights, jax.Array) and np.dtype(dtype) == np.uint32 and np.shape(weights) == _raw_key_shape()):
    raise TypeError(
        f"weights has dtype {dtype}, that of a PRNG key: the step's third positional argument is weights. Pass the "
        "key by name, step(state, batch, rng=key) (or step(state, batch, weights, key)), and weights as floats "
        "(or None for all ones)."
    )


def check_batch_values(batch: Any, name: str, *, dtypes: bool = True, ranges: bool = True) -> None:
  """Refuses host leaves the devices cannot hold as given: strings and objects (`dtypes`: a property of the
  signature, checked once per signature by the steps), and 64-bit integers out of 32-bit range (`ranges`: of
  the values, checked every call).

  Without `jax_enable_x64` JAX stores int64 as int32 (uint64 as uint32), wrapping larger values silently:
  token or example ids above 2**31 would reach the model as other ids. JAX arrays are left alone (they hold
  only what JAX can).
  """
  wide = jax.dtypes.canonicalize_dtype(np.int64) != np.int64  # 64-bit mode off
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if isinstance(leaf, jax.Array):
      continue
    leaf = np.asarray(leaf)
    where = f"{name}{jax.tree_util.keystr(path)}"
    # jax.dtypes knows bfloat16 and the other ml_dtypes as numbers; datetimes and timedeltas it cannot hold.
    if dtypes and (not (jax.dtypes.issubdtype(leaf.dtype, np.number) or leaf.dtype == np.bool_)
                   or leaf.dtype.kind in "mM"):
      raise ValueError(
          f"{where} has dtype {leaf.dtype}, which a JAX array cannot hold; encode it as numbers in the batch "
          "(e.g. strings as integer ids)."
      )
    if ranges and wide and leaf.dtype in (np.int64, np.uint64) and leaf.size:
      narrow = np.iinfo(np.int32 if leaf.dtype == np.int64 else np.uint32)
      if leaf.min() < narrow.min or leaf.max() > narrow.max:
        raise ValueError(
            f"{where} holds {leaf.dtype} values outside {narrow.dtype}'s range (min {leaf.min()}, max {leaf.max()}); "
            f"without jax_enable_x64 JAX stores them as {narrow.dtype}, wrapping them silently. Map them into that "
            "range (e.g. ids to a vocabulary index), or enable 64-bit mode (jax.config.update('jax_enable_x64', True))."
        )


SMALLEST_WEIGHT = float(np.finfo(np.float32).tiny)  # float32's smallest normal number


def subnormal_weights_message(name: str, count: int, what: str, after: str) -> str:
  return (
      f"{name} has {count} values in (0, {SMALLEST_WEIGHT:.3g}), below float32's smallest normal number, which "
      f"accelerators and XLA's CPU backend flush to 0: {what}. Scale the weights up (only their ratios matter "
      f"under reduction='mean') or set those to 0. {after}"
  )


def check_weight_values(weights: Any, name: str = "weights") -> None:
  """Refuses host weights in (0, float32's smallest normal): the devices would read them as 0, and their rows
  would silently count as padding (a batch of only such weights: a skipped step). Checked in the weights' own
  dtype, every call; JAX arrays are left alone (reading them would wait for the device)."""
  if weights is None or isinstance(weights, jax.Array):
    return
  w = np.asarray(weights)
  if not jax.dtypes.issubdtype(w.dtype, np.floating) or not w.size:
    return
  w = w if w.dtype in (np.float32, np.float64) else w.astype(np.float64)  # bfloat16 reaches below it too
  count = int(np.count_nonzero((w > 0) & (w < SMALLEST_WEIGHT)))
  if count:
    raise ValueError(subnormal_weights_message(
        name, count, "their rows would count as padding (a batch of only such weights, a skipped step)",
        "Nothing ran and nothing was donated."))


def check_step_inputs(
    loss_fn, optimizer, state, batch, weights, rng=None, *, n_replicas: int, accum_steps: int = 1
) -> None:
  """Raises `TypeError`/`ValueError` naming the argument at fault and the fix.

  `loss_fn` itself is not run here: it may use collectives (exact
  BatchNorm statistics), which only exist inside the mapped step. What it
  returns is checked while the step is traced (`jaxdp.core.loss.call_loss`),
  which still happens before anything runs or is donated.
  """
  check_state(state)
  check_loss_fn(loss_fn, with_model_state=state.model_state is not None)
  check_optimizer(optimizer)
  check_rng(rng)
  check_params_dtypes(state.params)
  check_opt_state(state, optimizer)
  check_weights_dtype(weights)
  check_batch_values(batch, "batch", ranges=False)  # the values: every call (CompiledStep._prepare)
  check_batch_split(batch, weights, n_replicas, accum_steps)
  if np.shape(state.step) != ():
    raise ValueError(f"state.step must be a scalar, got shape {np.shape(state.step)}.")
