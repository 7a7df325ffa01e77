"""flax's support in jaxdp's core, registered through :func:`jaxdp.loss.register_model_support`.

Imported by the core as soon as a program has imported flax (see
:mod:`jaxdp.integrations`): from then on every training step refuses flax
linen's ``BatchNorm`` statistics over padding rows, errors in a ``loss_fn``
get flax-specific notes, and :func:`jaxdp.init_state` unboxes linen's
``nn.with_partitioning`` parameters.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import jax
from flax.core import meta

from jaxdp.batchnorm import training_batch_guards
from jaxdp.loss import ModelSupport, register_model_support

NNX_LOSS_ATTRIBUTE = "jaxdp_nnx_loss"
"""Set on the losses :func:`jaxdp.nnx.loss` makes: their missing model state is reported by ``merge``."""


def tracing(train: bool) -> contextlib.AbstractContextManager:
  """The BatchNorm guards while a training step traces ``loss_fn`` (its batch may hold padding rows)."""
  return training_batch_guards() if train else contextlib.nullcontext()


def notes(error: BaseException, loss_fn: Callable, called: Mapping) -> list[str]:
  """The notes for an error raised in a ``loss_fn`` of a flax model."""
  # A loss may take None for a stateless model; one that needs state got None because the state has none.
  if called["model_state"] is None and "model_state" in called["keywords"] and not getattr(
      loss_fn, NNX_LOSS_ATTRIBUTE, False):
    return [
        "jaxdp: loss_fn was called with model_state=None: the state was built without model state. If the "
        "model has some (BatchNorm statistics), pass it where the state is made: jaxdp.init_state(params, "
        "optimizer, mesh, model_state=variables['batch_stats']) for flax linen (from jaxdp.nnx.split for nnx), "
        "and CheckpointManager.restore(..., model_state=...) when resuming."
    ]
  return []


def unbox(params: Any) -> tuple[Any, Any]:
  """``(params, specs)``: flax partitioning boxes (``nn.with_partitioning``'s ``Partitioned``) removed, and
  the specs they carried (``None`` when there are no boxes)."""
  is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
  if not any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
    return params, None
  return meta.unbox(params), meta.get_partition_spec(params)


register_model_support(ModelSupport(tracing=tracing, notes=notes, unbox=unbox))
