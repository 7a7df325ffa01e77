"""flax's support in jaxdp's core, registered through :func:`jaxdp.loss.register_model_support`.

Imported by the core as soon as a program has imported flax (see
:mod:`jaxdp.integrations`): from then on every training step refuses flax
linen's ``BatchNorm`` statistics over padding rows, errors in a ``loss_fn``
get flax-specific notes, and :func:`jaxdp.init_state` unboxes linen's
``nn.with_partitioning`` parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
from flax.core import meta

from jaxdp.batchnorm import training_batch_guards
from jaxdp.loss import ModelSupport, register_model_support

NNX_LOSS_ATTRIBUTE = "jaxdp_nnx_loss"
"""Set on the losses :func:`jaxdp.nnx.loss` makes: their missing model state is reported by ``merge``."""

BEFORE_STEP_ATTRIBUTE = "jaxdp_before_train_step"
"""Set on the losses :func:`jaxdp.nnx.loss` makes: the check that their Module has not changed mode."""


def tracing(train: bool) -> contextlib.AbstractContextManager:
  """The BatchNorm guards while a training step traces ``loss_fn`` (its batch may hold padding rows)."""
  return training_batch_guards() if train else contextlib.nullcontext()


def notes(error: BaseException, loss_fn: Callable, core_notes: list) -> list[str]:
  """The core's notes for an error raised in ``loss_fn``, with flax's advice on a missing model state."""
  if getattr(loss_fn, NNX_LOSS_ATTRIBUTE, False):  # jaxdp.nnx's merge reports a missing model state itself
    return [note for note in core_notes if "model_state=None" not in note]
  return [
      note + (" For flax linen: model_state=variables['batch_stats']; for nnx, the state from jaxdp.nnx.split."
              if "model_state=None" in note else "")
      for note in core_notes
  ]


def unbox(params: Any) -> tuple[Any, Any]:
  """``(params, specs)``: flax partitioning boxes (``nn.with_partitioning``'s ``Partitioned``) removed, and
  the specs they carried (``None`` when there are no boxes)."""
  is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
  if not any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
    return params, None
  return meta.unbox(params), meta.get_partition_spec(params)


def before_step(loss_fn: Callable) -> Callable[[], None] | None:
  """The check a loss made by :func:`jaxdp.nnx.loss` carries, run before every compiled step."""
  return getattr(loss_fn, BEFORE_STEP_ATTRIBUTE, None)


register_model_support(ModelSupport(tracing=tracing, notes=notes, unbox=unbox, before_step=before_step))
