"""Layer-wise ZeRO-3: each layer's parameters gathered inside the loop over layers, dropped after use.

At ZeRO stage 3 every parameter is split over the data axis. By default the
step all-gathers all of them before the forward pass and keeps them until the
backward pass ends, so the peak per device still holds the whole model. For a
model whose repeated layers are stacked on a leading axis (`nnx.vmap`,
`nn.scan`, a stacked pytree under `lax.scan`), name the stacks with
`layers=` (`jaxdp.make_train_step`, `jaxdp.init_state`): those
leaves then reach `loss_fn` still split (along a dimension of one layer,
never the layer axis), and the loop body calls `gather` on its layer's
slice. Inside a jaxdp step that is an all-gather over the data axis of that
layer alone; its transpose in the backward pass is a reduce-scatter of that
layer's gradient, inside the backward loop, so the gradient of a stacked leaf
leaves the loss already summed over the replicas and split (the step only
divides it by the global weight). Outside a jaxdp step, and for leaves that
are not split, `gather` returns its argument: the same model code runs
on one device.

Memory: wrap the loop body in `jax.checkpoint` with
`policy=jaxdp.gather_policy(reshard_after_forward)`. With `True` (the
default, FSDP2's) the gathered layer is dropped after its forward use and
gathered again in the backward pass; with `False` it is kept for the
backward pass (less traffic, one gathered layer per layer alive). Without
`jax.checkpoint` autodiff keeps every gathered layer as a residual. The
setting is the model's, in its checkpoint policy, as FSDP2 sets it per
module: JAX caches a checkpointed body's trace and partial evaluation, so a
setting read from the step while tracing could be a stale one.

Prefetch: `scan_layers` runs the loop itself, gathering layer l + 1
while layer l computes (and layer l − 1 in the backward pass).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jaxdp.core.precision import summed_in
from jaxdp.sharding import pipelining
from jaxdp.sharding.layout import data_dim, key_name, one_layer_spec, per_model_shard, zero_axis

GATHERED = "jaxdp_gathered"
"""The `checkpoint_name` of a layer's gathered parameters (see `gather_policy`)."""


class _Stacked(NamedTuple):
  path: tuple  # the leaf's key names in the params
  shape: tuple  # one layer's shape on this device (the slice when split)
  dtype: Any
  dim: int | None  # the dimension of one layer split over the data axis, or None
  spec: P  # one layer's full spec (model axes kept), for the gather per model shard
  index: int = -1  # the leaf's place among the params' leaves


class _Gathering(NamedTuple):
  leaves: tuple[_Stacked, ...]
  axis_name: Any
  reduce_dtype: Any = None  # the gradient's communication dtype (the step's precision), or None: its own
  # Per entry of `leaves`: None, or the zeros `[L, *one gathered layer]` through which that stack's local
  # gradient leaves the loss whole (PowerSGD or a user's reduction takes it; see `sinking`).
  sinks: tuple = ()


_ACTIVE: contextvars.ContextVar[_Gathering | None] = contextvars.ContextVar("jaxdp_gathering", default=None)


@contextlib.contextmanager
def gathering(params: Any, specs: Any, stacked: Any, axis_name: Any, reduce_dtype: Any = None):
  """While tracing a step's loss: `gather` gathers the slices of the stacked leaves of `params`.

  `params`: this device's params as the loss gets them; `specs`: their full specs; `stacked`: the
  params' tree of bools from `jaxdp.sharding.layout.layer_mask` (`None`: nothing stacked);
  `reduce_dtype`: the dtype the gradient's reduce-scatter communicates in (the step's
  `Precision.reduce_dtype`), or `None`.
  """
  if stacked is None:
    yield
    return
  zero = zero_axis(axis_name)
  entries = []
  for index, ((path, x), spec, is_layer) in enumerate(zip(jax.tree_util.tree_leaves_with_path(params),
                                                          jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
                                                          jax.tree.leaves(stacked))):
    if not is_layer:
      continue
    dim = data_dim(spec, zero)
    if dim == 0:  # split along the layer axis (a layout made without layers=): not a layer's slice to gather
      continue
    layer_spec = one_layer_spec(spec, len(x.shape))
    entries.append(_Stacked(_names(path), tuple(x.shape[1:]), x.dtype,
                            None if dim is None else dim - 1, layer_spec, index))
  token = _ACTIVE.set(_Gathering(tuple(entries), axis_name, reduce_dtype, (None,) * len(entries)))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def sink_shapes(params: Any, specs: Any, stacked: Any, axis_name: Any) -> list:
  """Per leaf of `params` (flat): the shape of a stacked leaf gathered whole (`[L, *one layer]`, split over
  the model axes only) when `gathering` gathers it a layer at a time, else `None`."""
  zero = zero_axis(axis_name)
  shapes = []
  for x, spec, is_layer in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
                               jax.tree.leaves(stacked)):
    dim = data_dim(spec, zero) if is_layer else None
    if not dim:  # not stacked, not split, or split along the layer axis: not gathered a layer at a time
      shapes.append(None)
      continue
    shape = list(x.shape)
    shape[dim] *= lax.axis_size(zero)
    shapes.append(tuple(shape))
  return shapes


@contextlib.contextmanager
def sinking(params_sinks: list):
  """Inside `gathering`, while the loss is traced for its gradient: the stacked leaves with a sink (`params_sinks`,
  per leaf of the params given to `gathering`: zeros of `sink_shapes`' shape, or `None`) leave `scan_layers`'s
  backward pass whole, as the gradient of their sink, instead of reduce-scattered (their slice's gradient is
  zero there): PowerSGD and a user's reduction take a device's local gradient of a stack, which a reduce-scatter
  would sum."""
  active = _ACTIVE.get()
  if active is None:
    raise RuntimeError("jaxdp.sharding.layerwise.sinking outside gathering.")
  token = _ACTIVE.set(active._replace(sinks=tuple(params_sinks[entry.index] for entry in active.leaves)))
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
  candidates = [s for s in leaves if s.shape == tuple(x.shape)]  # any dtype: compute_dtype casts the slices
  for start in range(len(path)):
    tail = path[start:]
    found = [s for s in candidates if s.path[len(s.path) - len(tail):] == tail]
    if found:
      return found
  return []


def _plan(layer: Any, active: _Gathering) -> list:
  """Per leaf of one layer (arrays or shapes): `(dim, spec)` for a slice to gather, `None` for a whole leaf."""
  found = False

  def one(path, x):
    nonlocal found
    matches = _match(_names(path), x, active.leaves)
    if not matches:
      return None
    found = True
    dims = {(m.dim, m.spec, m.dtype) for m in matches}
    if len(dims) > 1:
      raise ValueError(
          f"jaxdp.gather: {jax.tree_util.keystr(path)} of shape {x.shape} matches stacked leaves split along "
          f"different dimensions ({', '.join('/'.join(map(str, m.path)) for m in matches)}); pass the layer with "
          "more of its key path (the whole layer's subtree), so that it names one stacked leaf."
      )
    dim, spec, dtype = dims.pop()
    return None if dim is None else (dim, spec, dtype)

  plan = [one(path, x) for path, x in jax.tree_util.tree_leaves_with_path(layer)]
  if not found and plan:
    shapes = ", ".join(f"{'/'.join(map(str, s.path))} {s.shape}" for s in active.leaves[:4])
    raise ValueError(
        "jaxdp.gather got no parameter of a stacked layer: pass one layer's parameters as the loop body sees "
        f"them (a slice of the stacks named by layers=: {shapes}, ...), with their key names."
    )
  return plan


def _sinks_of(layer: Any, active: _Gathering) -> list:
  """Per leaf of one layer: the sink of the stacked leaf it is a slice of (see `sinking`), or `None`."""
  leaves = jax.tree_util.tree_leaves_with_path(layer)
  if all(sink is None for sink in active.sinks):
    return [None] * len(leaves)
  sink_of = dict(zip(active.leaves, active.sinks))
  out = []
  for path, x in leaves:
    matches = _match(_names(path), x, active.leaves)
    sinks = [sink_of[m] for m in matches if sink_of[m] is not None]
    if sinks and len(matches) > 1:
      raise ValueError(
          f"scan_layers: {jax.tree_util.keystr(path)} of shape {x.shape} matches several stacked leaves "
          f"({', '.join('/'.join(map(str, m.path)) for m in matches)}), and the step's reduction takes one whole: pass "
          "the stack with more of its key path (the whole stack's subtree), so that each leaf names one."
      )
    out.append(sinks[0] if sinks else None)
  return out


def _each_planned(tree: Any, plan: list, active: _Gathering, collective: Callable) -> Any:
  """`collective(leaf, axis, dim)` over ZeRO's axis, per model shard, on the leaves `plan` splits.

  In the stacked leaf's own dtype (float32 master weights under `compute_dtype`): the gradient's
  reduce-scatter, the gather's transpose, then sums in float32 as every reduction of the step does.
  """
  zero = zero_axis(active.axis_name)

  def one(x, how):
    if how is None:
      return x
    dim, spec, dtype = how
    return per_model_shard(lambda y: collective(y.astype(dtype), zero, dim).astype(y.dtype), spec,
                           active.axis_name)(x)

  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten([one(x, how) for x, how in zip(leaves, plan)])


def _gathered(layer: Any, plan: list, active: _Gathering) -> Any:
  return _each_planned(layer, plan, active, lambda y, axis, dim: checkpoint_name(
      _all_gather(y, axis, dim, active.reduce_dtype), GATHERED))


def _all_gather(x: Any, axis: Any, dim: int, wire: Any) -> Any:
  """`lax.all_gather` whose transpose (the gradient's reduce-scatter) communicates in `wire` (`None`: as
  JAX transposes it, in the cotangent's dtype)."""
  if wire is None or not jnp.issubdtype(x.dtype, jnp.floating):
    return lax.all_gather(x, axis, axis=dim, tiled=True)

  @jax.custom_vjp
  def gathered(x):
    return lax.all_gather(x, axis, axis=dim, tiled=True)

  def backward(_, cotangent):
    summed = lax.psum_scatter(cotangent.astype(wire).astype(summed_in(wire)), axis, scatter_dimension=dim, tiled=True)
    return (summed.astype(wire).astype(cotangent.dtype),)

  gathered.defvjp(lambda x: (gathered(x), None), backward)
  return gathered(x)


def _scattered(cotangent: Any, plan: list, active: _Gathering) -> Any:
  """The transpose of `_gathered`: each gathered leaf's cotangent reduce-scattered back to its slice, in the
  step's `reduce_dtype` where it has one (as the step's other gradient collectives)."""
  wire = active.reduce_dtype

  def scatter(y, axis, dim):
    cast = wire is not None and jnp.issubdtype(y.dtype, jnp.floating)
    out = lax.psum_scatter(y.astype(wire).astype(summed_in(wire)) if cast else y, axis, scatter_dimension=dim,
                           tiled=True)
    return (out.astype(wire) if cast else out).astype(y.dtype)

  return _each_planned(cotangent, plan, active, scatter)


def gather(layer: Any) -> Any:
  """One layer's whole parameters from this device's slices, inside the loop over a stack of layers.

  `layer`: the parameters of one layer of a stack named by `layers=` (a subtree of one scan iteration:
  the loop body's slice of the stacked params, an nnx layer's `nnx.state(..., nnx.Param)`, a linen
  block's `params`). Inside a jaxdp step each leaf split over the data axis is all-gathered (named
  `GATHERED` for `gather_policy`); elsewhere (one device, stages 0-2, a plain program) the
  leaves come back as they are. Raises `ValueError` inside a step when `layer` is not one layer of a
  stack named by `layers=`.
  """
  active = _ACTIVE.get()
  if active is None or not active.leaves:
    return layer
  if any(sink is not None for sink in _sinks_of(layer, active)):
    raise ValueError(
        "jaxdp.gather in a loop of your own with PowerSGD (reduction=jaxdp.reductions.powersgd(...)) or a reduction "
        "of your own at layer-wise ZeRO-3: the reduction takes each device's local gradient of a stack, which only "
        "jaxdp.scan_layers hands out whole (a gather's transpose reduce-scatters it inside the backward pass). Run "
        "the stack with jaxdp.scan_layers, or use zero_stage=3 without layers=."
    )
  return _gathered(layer, _plan(layer, active), active)


def scan_layers(f: Callable, init: Any, layers: Any, xs: Any = None, *,
                reshard_after_forward: bool = True) -> tuple[Any, Any]:
  """`lax.scan` of `f(carry, layer, x) -> (carry, y)` over a stack of layers, each gathered ahead of its use.

  The functional route's loop with prefetch: inside a layer-wise step, layer `l + 1`'s all-gather is
  issued in iteration `l`, before `f` computes layer `l` (the loop carries the next layer's gathered
  parameters), so a GPU or TPU scheduler can overlap the two; the backward pass runs the layers in reverse,
  gathering layer `l - 1` while it recomputes and differentiates layer `l`, and reduce-scatters each
  layer's gradient there. Each layer's forward pass is recomputed in the backward pass (only each
  layer's input carry is kept); `reshard_after_forward=False` also keeps each gathered layer, so the
  backward pass gathers nothing. `layers`: the stacked params as `loss_fn` got them (leading layer
  axis); `xs`: per-layer inputs (leading layer axis) or `None`. Returns `(carry, ys)` as
  `lax.scan`. Elsewhere (one device, below stage 3, a plain program) it is `lax.scan` with the layers
  as they are, so the same model runs everywhere. The gradients of values `f` closes over (floating
  values being differentiated, which `jax.closure_convert` hoists) are summed over the layers.

  Inside a pipelined step (`make_train_step(..., pipeline=)`, see `jaxdp.sharding.pipelining`) it runs the
  stage's block of layers on microbatches of `init` instead (every leaf of `init` holding the device's
  rows on dim 0) and returns the whole stack's output on every stage; `f` must return `(carry, None)`
  there, and `xs` cover the whole stack (`[L, ...]`).
  """
  if not isinstance(reshard_after_forward, (bool, np.bool_)):
    raise TypeError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}.")
  pipelined = pipelining.active()
  scan = functools.partial(_scan_gathered, reshard_after_forward=reshard_after_forward)
  if pipelined is not None:  # a pipelined step: this stage's block of layers, one microbatch at a time
    # (at ZeRO-3 with gather="layer", each unit's block gathered a layer at a time, as below)
    if pipelined.pipeline.schedule == "1f1b":  # one part of the loss, as the 1F1B schedule traces it
      part = pipelining.run_part(f, init, layers, xs, pipelined, scan)
      if part is not None:
        return part
    return pipelining.run_stack(f, init, layers, xs, pipelined, scan=scan)
  return scan(f, init, layers, xs)


def _scan_gathered(f: Callable, init: Any, layers: Any, xs: Any, *, reshard_after_forward: bool,
                   in_loop: bool = False) -> tuple[Any, Any]:
  """`scan_layers` outside a pipeline (and on one work unit's block inside one): the layers gathered one at
  a time with prefetch inside a layer-wise ZeRO-3 step, a `lax.scan` elsewhere.

  `in_loop`: inside the pipeline's loop over work units, where the same layers are gathered again each
  unit: the gathers are tied to the unit's input, so that XLA does not hoist them out of that loop (which would
  hold the whole block gathered, as `gather="step"` does).
  """
  active = _ACTIVE.get()
  count = {np.shape(x)[0] for x in jax.tree.leaves(layers)}
  if len(count) != 1:
    raise ValueError(f"scan_layers: the stacked layers must share a leading layer axis, got sizes {sorted(count)}.")
  length = count.pop()
  slice_of = lambda tree, i: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
  # Row l of rolled(tree, -1) is layer l + 1 (the forward's prefetch; the last row, layer 0: one spare gather);
  # of rolled(tree, 1), layer l - 1 (the backward's).
  rolled = lambda tree, shift: jax.tree.map(lambda a: jnp.roll(a, shift, axis=0), tree)  # noqa: E731
  plan = None if active is None or not active.leaves else _plan(slice_of(layers, 0), active)
  if plan is None or all(how is None for how in plan):
    return lax.scan(lambda carry, lx: f(carry, lx[0], lx[1]), init, (layers, xs), length=length)
  # A leaf with a sink leaves the backward pass whole, as its sink's gradient (see `sinking`), not scattered.
  sinks = _sinks_of(slice_of(layers, 0), active)
  sunk = [sink is not None for sink in sinks]
  scatter_plan = [None if is_sunk else how for how, is_sunk in zip(plan, sunk)]

  # Closed-over values become arguments, so that custom_vjp can return their gradients (summed over layers).
  # (Traced on a gathered layer, as f sees it; that gather is dead code outside the custom_vjp below.)
  x0 = None if xs is None else slice_of(xs, 0)
  converted, consts = jax.closure_convert(f, init, _gathered(slice_of(layers, 0), plan, active), x0)

  def forward(init, layers, xs, consts):
    if in_loop:
      layers = lax.optimization_barrier((layers, init))[0]

    def body(state, inputs):
      carry, current = state
      next_slice, x = inputs
      upcoming = _gathered(next_slice, plan, active)  # issued before this layer's compute
      new_carry, y = converted(carry, current, x, *consts)
      return (new_carry, upcoming), (carry, current if not reshard_after_forward else None, y)

    first = _gathered(slice_of(layers, 0), plan, active)
    (carry, _), (carries, kept, ys) = lax.scan(body, (init, first), (rolled(layers, -1), xs), length=length)
    return (carry, ys), (carries, kept)

  @jax.custom_vjp
  def run(init, layers, xs, consts, sink_stacks):
    return forward(init, layers, xs, consts)[0]

  def run_fwd(init, layers, xs, consts, sink_stacks):
    out, (carries, kept) = forward(init, layers, xs, consts)
    return out, (carries, kept, layers, xs, consts, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in sink_stacks])

  def run_bwd(residuals, cotangent):
    carries, kept, layers, xs, consts, sink_types = residuals
    ct_carry, ct_ys = cotangent
    if in_loop:
      layers = lax.optimization_barrier((layers, ct_carry))[0]
    zero_consts = jax.tree.map(jnp.zeros_like, consts)

    def body(state, inputs):
      ct, current, ct_consts = state
      previous_slice, carry_l, kept_l, x_l, ct_y = inputs
      layer = current if reshard_after_forward else kept_l
      upcoming = _gathered(previous_slice, plan, active) if reshard_after_forward else current
      _, pullback = jax.vjp(lambda c, w, x, k: converted(c, w, x, *k), carry_l, layer, x_l, consts)
      ct_in, ct_layer, ct_x, ct_k = pullback((ct, ct_y))
      ct_consts = jax.tree.map(jnp.add, ct_consts, ct_k)
      whole, treedef = jax.tree.flatten(ct_layer)
      scattered = jax.tree.leaves(_scattered(ct_layer, scatter_plan, active))
      slices = jax.tree.leaves(previous_slice)  # this device's slice shapes (a sunk leaf's gradient there: 0)
      ct_slices = [jnp.zeros_like(x) if is_sunk else g for g, x, is_sunk in zip(scattered, slices, sunk)]
      ct_sinks = [g for g, is_sunk in zip(whole, sunk) if is_sunk]
      return (ct_in, upcoming, ct_consts), (treedef.unflatten(ct_slices), ct_x, ct_sinks)

    last = _gathered(slice_of(layers, length - 1), plan, active) if reshard_after_forward else None
    (ct_init, _, ct_consts), (ct_layers, ct_xs, ct_sinks) = lax.scan(
        body, (ct_carry, last, zero_consts), (rolled(layers, 1), carries, kept, xs, ct_ys), length=length, reverse=True)
    ct_sinks = [g.astype(t.dtype) for g, t in zip(ct_sinks, sink_types)]
    return ct_init, ct_layers, ct_xs, ct_consts, ct_sinks

  run.defvjp(run_fwd, run_bwd)
  return run(init, layers, xs, consts, [sink for sink in sinks if sink is not None])


def gather_policy(reshard_after_forward: bool = True, *_misuse: Any, **_misuse_keywords: Any) -> Callable[..., bool]:
  """The `jax.checkpoint` policy for a loop body that calls `gather`: FSDP2's `reshard_after_forward`.

  `True` (default): nothing is saved, the gathered layer is dropped after the forward pass and gathered
  again in the backward pass (3Ψ traffic per step with the gradient's reduce-scatter). `False`: the
  gathered parameters (and nothing else) are saved for the backward pass (2Ψ, one gathered layer kept per
  layer). Use it as `jax.checkpoint(body, policy=jaxdp.gather_policy())` (`nn.remat(..., policy=...)`,
  `nnx.remat(policy=...)`).
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
