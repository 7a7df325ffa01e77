"""Host-side validation of step inputs: shapes and structure only, never values.

Runs before anything is traced, executed or donated, so a bad call leaves the
caller's state usable. Results are cached per input signature by the caller.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np

from jaxdp.loss import check_loss_fn
from jaxdp.sharding import ZERO_STAGES, abstract_zero_state, is_flat_shards
from jaxdp.state import TrainState


def check_int(value: Any, name: str, minimum: int, fix: str = "") -> int:
  """``value`` as a Python int (not a bool), or a ``ValueError`` naming ``name``, the bound and the fix."""
  try:
    as_int = None if isinstance(value, bool) else operator.index(value)
  except TypeError:
    as_int = None
  if as_int is None or as_int < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}" + (f"; {fix}" if fix else "."))
  return as_int


def _abstract(x: Any) -> tuple:
  return (np.shape(x), str(getattr(x, "dtype", type(x).__name__)))


def signature(*trees: Any) -> tuple:
  """A hashable key for the structure, shapes and dtypes of ``trees``."""
  leaves, treedef = jax.tree.flatten(trees)
  return treedef, tuple(_abstract(x) for x in leaves)


def _full_struct(x: Any) -> jax.ShapeDtypeStruct:
  """The abstract full leaf, also of a ZeRO-sharded one."""
  if is_flat_shards(x):
    return jax.ShapeDtypeStruct(x.shape, x.flat.dtype)
  return _struct(x)


def _struct(x: Any, leading: int | None = None) -> jax.ShapeDtypeStruct:
  shape = np.shape(x)
  if leading is not None:
    shape = (leading, *shape[1:])
  return jax.ShapeDtypeStruct(shape, jax.dtypes.result_type(x) if not hasattr(x, "dtype") else x.dtype)


def batch_size(batch: Any, name: str = "batch") -> int:
  """The common leading size of every leaf of ``batch``."""
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
    raise TypeError(f"{name} must be a jaxdp.TrainState, got {type(state).__name__}; build it with jaxdp.init_state(params, optimizer, mesh).")


def _layout(state_or_abstract: Any) -> tuple:
  return signature(state_or_abstract.params, state_or_abstract.opt_state)


def _check_layout(state, params, optimizer, n_replicas: int, zero_stage: int) -> None:
  """The state must have the layout ``init_state(..., zero_stage)`` builds for this optimizer and mesh."""
  layouts = {}
  for stage in ZERO_STAGES:
    try:
      layouts[stage] = _layout(abstract_zero_state(params, optimizer, n_replicas, stage))
    except Exception as e:
      if stage == zero_stage:
        raise ValueError(
            f"optimizer.init fails on state.params ({type(e).__name__}: {e}); state.params is not a valid parameter tree."
        ) from e
  actual = _layout(state)
  if actual == layouts[zero_stage]:
    return
  # A stateless optimizer (plain SGD) has the same layout at stages 0-2, so only a real difference is refused.
  matches = [stage for stage, layout in layouts.items() if layout == actual]
  if matches:
    raise ValueError(
        f"state has the layout of zero_stage={matches[0]} but the step was built with zero_stage={zero_stage}; "
        f"build the state with jaxdp.init_state(..., zero_stage={zero_stage}), or convert it without losing the "
        f"optimizer state: jaxdp.place_state(jaxdp.gather_state(state), optimizer, mesh, zero_stage={zero_stage})."
    )
  expected = abstract_zero_state(params, optimizer, n_replicas, zero_stage)
  if signature(expected.params) != signature(state.params):
    raise ValueError(
        f"state.params does not have the zero_stage={zero_stage} layout for a mesh axis of {n_replicas} devices; "
        "rebuild the state with jaxdp.init_state on this mesh."
    )
  raise ValueError(
      "state.opt_state does not match optimizer.init(state.params) in structure, shape or dtype; "
      "the state was built for other params or another optimizer. Rebuild it with jaxdp.init_state."
  )


def check_step_inputs(
    loss_fn, optimizer, state, batch, weights, rng=None, *, n_replicas: int, accum_steps: int = 1, zero_stage: int = 0
) -> None:
  """Raises ``TypeError``/``ValueError`` naming the argument at fault and the fix.

  ``loss_fn`` itself is not run here: it may use collectives (exact
  BatchNorm statistics), which only exist inside the mapped step. What it
  returns is checked while the step is traced (:func:`jaxdp.loss.call_loss`),
  which still happens before anything runs or is donated.
  """
  check_state(state)
  check_loss_fn(loss_fn, with_model_state=state.model_state is not None)
  params = jax.tree.map(_full_struct, state.params, is_leaf=is_flat_shards)
  _check_layout(state, params, optimizer, n_replicas, zero_stage)
  total = batch_size(batch)
  if total % n_replicas:
    raise ValueError(
        f"batch has leading size {total}, which does not split evenly over {n_replicas} devices; "
        "pad it (e.g. with jaxdp.shard_uneven(per_device_batches, mesh), which adds zero-weight rows) "
        f"to a multiple of {n_replicas}."
    )
  if (total // n_replicas) % accum_steps:
    raise ValueError(
        f"batch has {total // n_replicas} rows per device ({total} over {n_replicas} devices), which do not "
        f"split into accum_steps={accum_steps} micro-batches; make the batch a multiple of {n_replicas * accum_steps}."
    )
  if weights is not None and (np.ndim(weights) not in (1, 2) or np.shape(weights)[0] != total):
    raise ValueError(
        f"weights has shape {np.shape(weights)} but the batch has {total} rows; pass one weight per example "
        f"[{total}] (or per token [{total}, t]), 0 for padding, or weights=None for all ones."
    )
  if np.shape(state.step) != ():
    raise ValueError(f"state.step must be a scalar, got shape {np.shape(state.step)}.")
