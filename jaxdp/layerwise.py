"""Layer-wise ZeRO-3: each layer's parameters gathered inside the loop over layers, dropped after use.

At ZeRO stage 3 every parameter is split over the data axis. By default the
step all-gathers all of them before the forward pass and keeps them until the
backward pass ends, so the peak per device still holds the whole model. For a
model whose repeated layers are stacked on a leading axis (``nnx.vmap``,
``nn.scan``, a stacked pytree under ``lax.scan``), name the stacks with
``layers=`` (:func:`jaxdp.make_train_step`, :func:`jaxdp.init_state`): those
leaves then reach ``loss_fn`` still split (along a dimension of one layer,
never the layer axis), and the loop body calls :func:`gather` on its layer's
slice. Inside a jaxdp step that is an all-gather over the data axis of that
layer alone; its transpose in the backward pass is a reduce-scatter of that
layer's gradient, inside the backward loop, so the gradient of a stacked leaf
leaves the loss already summed over the replicas and split (the step only
divides it by the global weight). Outside a jaxdp step, and for leaves that
are not split, :func:`gather` returns its argument: the same model code runs
on one device.

Memory: wrap the loop body in ``jax.checkpoint`` with
``policy=jaxdp.gather_policy(reshard_after_forward)``. With ``True`` (the
default, FSDP2's) the gathered layer is dropped after its forward use and
gathered again in the backward pass; with ``False`` it is kept for the
backward pass (less traffic, one gathered layer per layer alive). Without
``jax.checkpoint`` autodiff keeps every gathered layer as a residual. The
setting is the model's, in its checkpoint policy, as FSDP2 sets it per
module: JAX caches a checkpointed body's trace and partial evaluation, so a
setting read from the step while tracing could be a stale one.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxdp.layout import data_dim, key_name, one_layer_spec, per_model_shard, zero_axis

GATHERED = "jaxdp_gathered"
"""The ``checkpoint_name`` of a layer's gathered parameters (see :func:`gather_policy`)."""


class _Stacked(NamedTuple):
  path: tuple  # the leaf's key names in the params
  shape: tuple  # one layer's shape on this device (the slice when split)
  dtype: Any
  dim: int | None  # the dimension of one layer split over the data axis, or None
  spec: P  # one layer's full spec (model axes kept), for the gather per model shard


class _Gathering(NamedTuple):
  leaves: tuple[_Stacked, ...]
  axis_name: Any


_ACTIVE: contextvars.ContextVar[_Gathering | None] = contextvars.ContextVar("jaxdp_gathering", default=None)


@contextlib.contextmanager
def gathering(params: Any, specs: Any, stacked: Any, axis_name: Any):
  """While tracing a step's loss: :func:`gather` gathers the slices of the stacked leaves of ``params``.

  ``params``: this device's params as the loss gets them; ``specs``: their full specs; ``stacked``: the
  params' tree of bools from :func:`jaxdp.layout.layer_mask` (``None``: nothing stacked).
  """
  if stacked is None:
    yield
    return
  zero = zero_axis(axis_name)
  entries = []
  for (path, x), spec, is_layer in zip(jax.tree_util.tree_leaves_with_path(params),
                                       jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
                                       jax.tree.leaves(stacked)):
    if not is_layer:
      continue
    dim = data_dim(spec, zero)
    layer_spec = one_layer_spec(spec, len(x.shape))
    entries.append(_Stacked(_names(path), tuple(x.shape[1:]), x.dtype,
                            None if dim is None else dim - 1, layer_spec))
  token = _ACTIVE.set(_Gathering(tuple(entries), axis_name))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def _names(path: Any) -> tuple:
  # Key names as a user writes them, without the trailing 'value' of nnx's Variable boxes.
  names = tuple(key_name(k) for k in path)
  return names[:-1] if names and names[-1] == "value" else names


def _match(path: tuple, x: Any, leaves: tuple[_Stacked, ...]) -> list[_Stacked]:
  # A layer's leaf is named relative to its stack (the loop body sees one layer, under names of its own such as
  # linen's collection 'params'): the longest end of its key path that ends stacked leaves' paths, among those
  # of one layer's shape and dtype.
  candidates = [s for s in leaves if s.shape == tuple(x.shape) and s.dtype == x.dtype]
  for start in range(len(path)):
    tail = path[start:]
    found = [s for s in candidates if s.path[len(s.path) - len(tail):] == tail]
    if found:
      return found
  return []


def gather(layer: Any) -> Any:
  """One layer's whole parameters from this device's slices, inside the loop over a stack of layers.

  ``layer``: the parameters of one layer of a stack named by ``layers=`` (a subtree of one scan iteration:
  the loop body's slice of the stacked params, an nnx layer's ``nnx.state(..., nnx.Param)``, a linen
  block's ``params``). Inside a jaxdp step each leaf split over the data axis is all-gathered (named
  :data:`GATHERED` for :func:`gather_policy`); elsewhere (one device, stages 0-2, a plain program) the
  leaves come back as they are. Raises ``ValueError`` inside a step when ``layer`` is not one layer of a
  stack named by ``layers=``.
  """
  active = _ACTIVE.get()
  if active is None or not active.leaves:
    return layer
  zero = zero_axis(active.axis_name)
  found = False

  def one(path, x):
    nonlocal found
    matches = _match(_names(path), x, active.leaves)
    if not matches:
      return x
    found = True
    dims = {(m.dim, m.spec) for m in matches}
    if len(dims) > 1:
      raise ValueError(
          f"jaxdp.gather: {jax.tree_util.keystr(path)} of shape {x.shape} matches stacked leaves split along "
          f"different dimensions ({', '.join('/'.join(map(str, m.path)) for m in matches)}); pass the layer with "
          "more of its key path (the whole layer's subtree), so that it names one stacked leaf."
      )
    dim, spec = dims.pop()
    if dim is None:
      return x
    whole = per_model_shard(lambda y: lax.all_gather(y, zero, axis=dim, tiled=True), spec, active.axis_name)(x)
    return checkpoint_name(whole, GATHERED)

  out = jax.tree_util.tree_map_with_path(one, layer)
  if not found and jax.tree.leaves(layer):
    shapes = ", ".join(f"{'/'.join(map(str, s.path))} {s.shape}" for s in active.leaves[:4])
    raise ValueError(
        "jaxdp.gather got no parameter of a stacked layer: pass one layer's parameters as the loop body sees "
        f"them (a slice of the stacks named by layers=: {shapes}, ...), with their key names."
    )
  return out


def gather_policy(reshard_after_forward: bool = True, *_misuse: Any, **_misuse_keywords: Any) -> Callable[..., bool]:
  """The ``jax.checkpoint`` policy for a loop body that calls :func:`gather`: FSDP2's ``reshard_after_forward``.

  ``True`` (default): nothing is saved, the gathered layer is dropped after the forward pass and gathered
  again in the backward pass (3Ψ traffic per step with the gradient's reduce-scatter). ``False``: the
  gathered parameters (and nothing else) are saved for the backward pass (2Ψ, one gathered layer kept per
  layer). Use it as ``jax.checkpoint(body, policy=jaxdp.gather_policy())`` (``nn.remat(..., policy=...)``,
  ``nnx.remat(policy=...)``).
  """
  # Passed uncalled (policy=jaxdp.gather_policy), JAX calls it as a policy: (primitive, *avals, **params).
  if _misuse or _misuse_keywords or not isinstance(reshard_after_forward, (bool, np.bool_)):
    raise TypeError(
        f"reshard_after_forward must be True or False, got {type(reshard_after_forward).__name__}; call it: "
        "jax.checkpoint(body, policy=jaxdp.gather_policy()) (or gather_policy(reshard_after_forward=False))."
    )
  if reshard_after_forward:
    return jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint_policies.save_only_these_names(GATHERED)
