"""flax's support in jaxdp's core, registered through `jaxdp.core.loss.register_model_support`.

Imported by the core as soon as a program has imported flax (see
`jaxdp.core.integrations`): from then on every training step refuses flax
linen's `BatchNorm` statistics over padding rows, errors in a `loss_fn`
get flax-specific notes, `jaxdp.init_state` unboxes linen's
`nn.with_partitioning` parameters, and a flax object where params or an
optax transformation go (an nnx Module or State, a linen variables dict, an
`nnx.Optimizer`) is refused naming the jaxdp call that fixes it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from typing import Any, Callable

import jax
import numpy as np
from flax.core import meta

from jaxdp.adapters.batchnorm import training_batch_guards
from jaxdp.core.loss import ModelSupport, register_model_support

NNX_LOSS_ATTRIBUTE = "jaxdp_nnx_loss"
"""Set on the losses `jaxdp.adapters.nnx.loss` makes: their missing model state is reported by `merge`."""

BEFORE_STEP_ATTRIBUTE = "jaxdp_before_train_step"
"""Set on the losses `jaxdp.adapters.nnx.loss` makes: the check that their Module has not changed mode."""


@contextlib.contextmanager
def tracing(train: bool):
  """While a jaxdp step traces `loss_fn`: the BatchNorm guards when training (its batch may hold padding
  rows), and flax's partitioning boxes applied without the step's manual axes (`annotations_in_step`)."""
  with annotations_in_step(), training_batch_guards() if train else contextlib.nullcontext():
    yield


@contextlib.contextmanager
def annotations_in_step():
  """linen's `nn.with_partitioning` boxes, where flax applies them inside a jaxdp step, name no manual axis.

  flax applies a box's spec as a `with_sharding_constraint` whenever a mesh is in context, and inside the
  step's `shard_map` one always is, its data axes manual: a box over `"data"` then fails (a manual axis, or
  a rank error where `nn.DenseGeneral` constrains its flattened kernel). jaxdp takes an annotation's data
  axis as the model's FSDP placement, which `zero_stage=` decides (`jaxdp.init_state` drops it
  too): here the box is applied over its other axes only (a model axis the compiler partitions is still
  constrained). Entered only while a step traces `loss_fn`; flax is unchanged outside it.
  """
  original = meta.Partitioned.unbox

  def unbox(self, apply_constraint=True):
    manual = _manual_axes()
    if apply_constraint and manual:
      names = [tuple(a for a in ((n,) if isinstance(n, str) else n or ()) if a not in manual) for n in self.names]
      names = [None if not n else n[0] if len(n) == 1 else n for n in names]
      while names and names[-1] is None:
        names.pop()
      self = self.replace(names=tuple(names))
    return original(self, apply_constraint)

  meta.Partitioned.unbox = unbox
  try:
    yield
  finally:
    meta.Partitioned.unbox = original


def _manual_axes() -> frozenset:
  try:
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)
  except (AttributeError, TypeError):  # a JAX without mesh information here
    return frozenset()


def notes(error: BaseException, loss_fn: Callable, core_notes: list) -> list[str]:
  """The core's notes for an error raised in `loss_fn`, with flax's advice on a missing model state."""
  if getattr(loss_fn, NNX_LOSS_ATTRIBUTE, False):  # jaxdp.adapters.nnx's merge reports a missing model state itself
    return [note for note in core_notes if "model_state=None" not in note]
  return [
      note + (" For flax linen: model_state=variables['batch_stats']; for nnx, the state from jaxdp.adapters.nnx.split."
              if "model_state=None" in note else "")
      for note in core_notes
  ]


def unbox(params: Any) -> tuple[Any, Any]:
  """`(params, specs)`: flax partitioning boxes (`nn.with_partitioning`'s `Partitioned`) removed, and
  the specs they carried (`None` when there are no boxes)."""
  is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
  if not any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
    return params, None
  return meta.unbox(params), meta.get_partition_spec(params)


def before_step(loss_fn: Callable) -> Callable[[], None] | None:
  """The check a loss made by `jaxdp.adapters.nnx.loss` carries, run before every compiled step."""
  return getattr(loss_fn, BEFORE_STEP_ATTRIBUTE, None)


# Collections a flax linen model's variables hold besides "params" (linen's own names): a variables dict passed
# where the params go would train them as parameters.
_LINEN_COLLECTIONS = ("batch_stats", "cache", "intermediates", "perturbations", "losses")


def check_params(params: Any, name: str) -> None:
  """Refuses the natural mistakes of a flax user where a parameter tree goes, naming the jaxdp call that fixes them:
  an nnx Module (or Optimizer), an nnx State with RNG or other non-parameter variables, and a linen variables dict
  holding collections besides `"params"`. The Module would otherwise be flattened, RNG counters and all."""
  nnx = sys.modules.get("flax.nnx")  # loaded if the caller has an nnx object at all
  if nnx is not None and isinstance(params, (nnx.Module, nnx.Optimizer)):
    raise TypeError(
        f"{name} is an nnx {'Optimizer' if isinstance(params, nnx.Optimizer) else 'Module'} "
        f"({type(params).__name__}), not a parameter tree; split the model first: definition, params, model_state = "
        f"jaxdp.adapters.nnx.split(model), then jaxdp.init_state(params, optax_transformation, mesh, model_state=model_state) "
        "and jaxdp.adapters.nnx.loss_fn(definition, ...) for the loss (see docs/porting-nnx.md)."
    )
  if nnx is not None and isinstance(params, nnx.State):
    kinds = {type(v).__name__ for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
             if isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param)}
    if kinds:
      raise TypeError(
          f"{name} is an nnx State holding {', '.join(sorted(kinds))} variables besides the nnx.Param ones (e.g. "
          f"nnx.state(model)): only parameters are trained. Pass the params of jaxdp.adapters.nnx.split(model), and its "
          "model_state as model_state= (RNG streams are reseeded by the step)."
      )
  if isinstance(params, Mapping) and "params" in params:
    others = [k for k in params if k in _LINEN_COLLECTIONS]
    if others:
      each = [f"variables[{k!r}]" for k in others]
      state = each[0] if len(others) == 1 else "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(others, each)) + "}"
      raise ValueError(
          f"{name} is a flax linen variables dict (collections {', '.join(map(repr, params))}): only "
          f"variables['params'] is trained, and the other collections would be updated by the optimizer as "
          f"parameters. Pass jaxdp.init_state(variables['params'], optimizer, mesh, model_state={state}) (see "
          "docs/porting-linen.md)."
      )


def check_optimizer(optimizer: Any, name: str) -> None:
  """Refuses flax's `nnx.Optimizer` where an optax transformation goes, naming the transformation it wraps."""
  nnx = sys.modules.get("flax.nnx")  # loaded if the caller has an nnx object at all
  if nnx is not None and isinstance(optimizer, nnx.Optimizer):
    raise TypeError(
        f"{name} is a flax nnx.Optimizer, which holds a model and its optimizer state; jaxdp keeps both in the "
        f"TrainState. Pass the optax GradientTransformation itself, the tx given to nnx.Optimizer ({name}=tx, e.g. "
        f"optax.adam(1e-3); this one's is {name}.tx), and the model's params from jaxdp.adapters.nnx.split(model)."
    )


def example_ids() -> contextlib.AbstractContextManager:
  """flax linen's own Dropout refused while a step with `example_ids` trains (it would draw one mask for every
  replica); a linen model can only be in use if `flax.linen` is imported."""
  if "flax.linen" not in sys.modules:
    return contextlib.nullcontext()
  from jaxdp.adapters.linen import refusing_flax_dropout  # imported only for a program that uses linen

  return refusing_flax_dropout()


register_model_support(ModelSupport(tracing=tracing, notes=notes, unbox=unbox, before_step=before_step,
                                    check_params=check_params, check_optimizer=check_optimizer,
                                    example_ids=example_ids))


# Stacks of identical blocks (jaxdp.adapters.linen.stack_blocks, jaxdp.adapters.nnx.stack_blocks).


def _signature(tree: Any, is_leaf: Callable | None) -> tuple:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  described = []
  for path, x in leaves:
    v = _value(x)
    described.append((jax.tree_util.keystr(path), tuple(np.shape(v)), str(getattr(v, "dtype", np.asarray(v).dtype))))
  return treedef, tuple(described)


def _value(x: Any) -> Any:
  return x.get_value() if hasattr(x, "get_value") else (x.unbox() if isinstance(x, meta.AxisMetadata) else x)


def check_identical(trees: list, names: list[str], is_leaf: Callable | None = None) -> None:
  """Refuses blocks that differ in structure, leaf shapes or dtypes, naming the first that differs from the first."""
  first = _signature(trees[0], is_leaf)
  for tree, name in zip(trees[1:], names[1:]):
    other = _signature(tree, is_leaf)
    if other != first:
      if other[0] != first[0]:
        why = f"its structure differs ({other[0]} vs {first[0]})"
      else:
        (path, *a), (_, *b) = next((o, f) for o, f in zip(other[1], first[1]) if o != f)
        why = f"its leaf {path} is {a[1]}{list(a[0])}, {names[0]}'s {b[1]}{list(b[0])}"
      raise ValueError(
          f"{name} is not identical to {names[0]}: {why}. Only identical blocks stack into one array per leaf "
          "(leading axis L); keep blocks that differ outside the stack."
      )


def stack_leaf(*xs: Any) -> Any:
  """One leaf of a stack: the blocks' values stacked on a new leading axis; flax partitioning boxes and nnx
  Variables keep their metadata, the layer axis added unsplit (`None`)."""
  first = xs[0]
  value = jax.numpy.stack([_value(x) for x in xs])
  if isinstance(first, meta.AxisMetadata):
    return first.replace_boxed(value).add_axis(0, {"partition_name": None})
  if hasattr(first, "get_value"):  # an nnx Variable
    sharding = first.get_metadata().get("out_sharding")
    extra = {} if sharding is None else {"out_sharding": (None, *sharding)}
    return first.replace(value, **extra)
  return value


def unstack_leaf(x: Any, i: int) -> Any:
  """Layer `i` of a stacked leaf (the inverse of `stack_leaf`)."""
  value = _value(x)[i]
  if isinstance(x, meta.AxisMetadata):
    return x.replace_boxed(value).remove_axis(0, {"partition_name": None})
  if hasattr(x, "get_value"):
    sharding = x.get_metadata().get("out_sharding")
    extra = {} if sharding is None else {"out_sharding": tuple(sharding[1:])}
    return x.replace(value, **extra)
  return value


def stack_length(tree: Any, is_leaf: Callable | None, what: str) -> int:
  """The common leading size of a stack's leaves (a `ValueError` naming `what` if there is none)."""
  sizes = {np.shape(_value(x))[0] if np.ndim(_value(x)) else None for x in jax.tree.leaves(tree, is_leaf=is_leaf)}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"{what} is not a stack: its leaves need one common leading (layer) axis, got sizes {sizes}.")
  return sizes.pop()
