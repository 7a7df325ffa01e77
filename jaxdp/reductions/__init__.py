"""Gradient reductions as values: DDP's communication hooks, done functionally.

A `Reduction` is a pair of pure functions, as an optax
`GradientTransformation` is:

* `init(params, layout) -> state`: one replica's state (`None` for none);
* `reduce(sums, state, axis_name) -> (summed, state)`: per replica, inside
  the step's `shard_map`, this replica's weighted gradient sums (a pytree
  like the params, float32 at least) in, their sum over the data axes
  `axis_name` out (or an approximation of it: a compressed reduction).

jaxdp does the rest around `reduce`, whatever it is: the exact sums of the
loss, weights and metrics, the model state, and the normalisation chosen by
the mode (`mean`: `Σ ∇(w·l) / Σ w` over every device, the exact gradient
of the global batch; `rank_mean`: DDP's mean of local means; `sum`;
`none`: no communication). Pieces compose with `chain`: at most one
mode (default `mean`), `bucketed` for jaxdp's own all-reduce, and
at most one reduction that replaces that all-reduce (`powersgd`, or a
user's own). A stateful reduction's state is per replica: jaxdp keeps one
copy per replica in `TrainState.compression` (its leaves stacked on a
leading axis split over the data axes) and hands `reduce` this replica's.

Example (a user's reduction: the sums cast to bfloat16 for the all-reduce):

```python
def bf16_sum():
  def reduce(sums, state, axis_name):
    cast = jax.tree.map(lambda g: g.astype(jnp.bfloat16), sums)
    summed = jax.lax.psum(cast, axis_name)
    return jax.tree.map(lambda s, g: s.astype(g.dtype), summed, sums), state
  return jaxdp.reductions.Reduction(lambda params, layout: None, reduce)

step = jaxdp.make_train_step(loss_fn, opt, dp, reduction=bf16_sum())
```

`examples/int8_reduction.py` is a complete one with per-block scales and
error feedback.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxdp.core.checks import check_int
from jaxdp.reductions.compression import (
    PowerSGD,
    check_compression,
    check_compression_state,
    init_compression,
    powersgd_reduce,
)
from jaxdp.reductions.compression import powersgd as powersgd_settings

MODES = ("mean", "rank_mean", "sum", "none")
"""The normalisations a reduction can end in (`mean`, `rank_mean`, `sum`, `none`)."""


class Reduction(NamedTuple):
  """A gradient reduction: `init(params, layout) -> state`, `reduce(sums, state, axis_name) -> (summed, state)`.

  Build a user reduction as `Reduction(init, reduce)`; jaxdp's own pieces
  (`mean`, `bucketed`, `powersgd`, ...) and `chain`
  also set `options`, which tell the compiled step which fused path to
  run (it computes exactly what `reduce` says).

  Attributes:
    init: `init(params, layout)`: one replica's initial state (a pytree,
      or `None`); `layout` is the step's `jaxdp.DataParallel`.
    reduce: `reduce(sums, state, axis_name)`: per replica, this replica's
      gradient sums and state in, the sums over `axis_name` (all-reduced,
      or approximated) and the new state out.
    options: `None` for a user's reduction; for jaxdp's pieces a tuple of
      `(name, value)` pairs (`mode`, `bucket_bytes`, `compression`, and
      in a chain `user`: the user's piece).
  """

  init: Callable[[Any, Any], Any]
  reduce: Callable[[Any, Any, Any], tuple[Any, Any]]
  options: tuple | None = None


class Resolved(NamedTuple):
  """A reduction as the step runs it (what `resolve` reads from a chain).

  Attributes:
    mode: one of `MODES`.
    bucket_bytes: jaxdp's all-reduce in buckets of about this many bytes, or `None` (one).
    compression: `jaxdp.reductions.compression.PowerSGD` settings, or `None`.
    user: the user's `Reduction` that replaces jaxdp's all-reduce, or `None`.
  """

  mode: str = "mean"
  bucket_bytes: int | None = None
  compression: PowerSGD | None = None
  user: Reduction | None = None

  @property
  def stateful(self) -> bool:
    return self.compression is not None or self.user is not None


def _no_state(params: Any, layout: Any = None) -> None:
  del params, layout
  return None


def _psum(sums: Any, state: Any, axis_name: Any) -> tuple[Any, Any]:
  return jax.lax.psum(sums, axis_name), state


def _keep(sums: Any, state: Any, axis_name: Any) -> tuple[Any, Any]:
  del axis_name
  return sums, state


def _mode(name: str) -> Reduction:
  return Reduction(_no_state, _keep if name == "none" else _psum, (("mode", name),))


def mean() -> Reduction:
  """The exact reduction (the default): the gradient of the global weighted mean `Σ w·l / Σ w`, whatever the
  split of examples or tokens over the devices. The gradient sums are all-reduced once and divided by the
  all-reduced `Σ w`."""
  return _mode("mean")


def rank_mean() -> Reduction:
  """PyTorch DDP's reduction: the mean over replicas of each replica's local weighted mean. With uneven
  per-replica weights it is not the global-batch gradient (a replica with zero weight still counts)."""
  return _mode("rank_mean")


def sum() -> Reduction:  # noqa: A001 (the reduction's name, as jaxdp.reductions.sum)
  """The all-reduced sum of the local weighted sums, undivided."""
  return _mode("sum")


def none() -> Reduction:
  """No communication of the gradient: each replica steps on its own local mean (independent replicas; only
  at ZeRO stage 0)."""
  return _mode("none")


def bucketed(bucket_bytes: int) -> Reduction:
  """jaxdp's all-reduce of the gradient in buckets of about `bucket_bytes` bytes, in reverse layer order, one
  all-reduce each (DDP's `bucket_cap_mb`); `0`: one per leaf. The same sums, bitwise on CPU. At ZeRO stages
  1-3 the parameters' all-gathers and the gradient's reduce-scatter are cut the same way."""
  bucket_bytes = check_int(bucket_bytes, "bucket_bytes", 0, "the bucket size in bytes (0: one per leaf).")
  return Reduction(_no_state, _psum, (("bucket_bytes", bucket_bytes),))


def powersgd(rank: int = 2, *, start_iter: int = 10, min_compression_rate: float = 2.0, seed: int = 0) -> Reduction:
  """PowerSGD (Vogels et al., 2019): each large matrix leaf's sum as a rank-`rank` approximation with error
  feedback and a warm-started `Q`; the other leaves exactly. The first `start_iter` steps are exact. See
  `jaxdp.reductions.compression` for the arguments; its state is `jaxdp.reductions.compression.PowerSGDState`."""
  settings = powersgd_settings(rank, start_iter=start_iter, min_compression_rate=min_compression_rate, seed=seed)
  return from_powersgd(settings)


def from_powersgd(settings: PowerSGD) -> Reduction:
  """The `Reduction` of checked PowerSGD `settings` (`jaxdp.reductions.compression.powersgd`)."""
  check_compression(settings)

  def reduce(sums, state, axis_name):
    return powersgd_reduce(sums, state, settings, axis_name)

  return Reduction(_no_state, reduce, (("compression", settings),))


def _pieces(reduction: Any) -> list[Reduction]:
  """The pieces of a (nested) chain, flattened; a PowerSGD settings value counts as its reduction."""
  if isinstance(reduction, PowerSGD):
    return [from_powersgd(reduction)]
  if not isinstance(reduction, Reduction):
    raise TypeError(
        f"reduction must be a jaxdp.reductions.Reduction (jaxdp.reductions.mean(), rank_mean(), sum(), none(), "
        f"bucketed(b), powersgd(r), a chain(...) of them, or your own Reduction(init, reduce)), got "
        f"{type(reduction).__name__} {reduction!r}."
    )
  for name, fn in (("init", reduction.init), ("reduce", reduction.reduce)):
    if not callable(fn):
      raise TypeError(f"Reduction.{name} must be callable, got {type(fn).__name__}.")
  if reduction.options is None:
    return [reduction]
  options = dict(reduction.options)
  if "pieces" in options:
    return list(options["pieces"])
  return [reduction]


def _fold(pieces: list[Reduction]) -> Resolved:
  """The chain's settings; refuses what does not compose (each message names the pieces)."""
  found: dict = {}
  for piece in pieces:
    if piece.options is None:
      items = (("user", piece),)
    else:
      items = piece.options
    for name, value in items:
      if name in found or (name in ("compression", "user") and ({"compression", "user"} & set(found))):
        other = name if name in found else ({"compression", "user"} & set(found)).pop()
        raise ValueError(
            f"the reduction chain holds two pieces that each set its {_what(name)} ({_what(other)} already set): "
            "a chain has at most one mode (mean, rank_mean, sum, none), one bucketed() and one reduction that "
            "replaces the all-reduce (powersgd or your own)."
        )
      found[name] = value
  resolved = Resolved(**found)
  if resolved.stateful and resolved.mode not in ("mean", "sum"):
    which = "powersgd(...)" if resolved.compression is not None else "a user reduction"
    raise ValueError(
        f"{which} with reduction={resolved.mode!r}: it replaces the all-reduce of the local weighted sums, which 'none' "
        "does not have and 'rank_mean' replaces by per-replica means; chain it with mean() (or sum())."
    )
  if resolved.user is not None and resolved.bucket_bytes is not None:
    raise ValueError(
        "bucketed() cuts jaxdp's own all-reduce, which a user reduction replaces; bucket inside your reduce, or "
        "drop bucketed() from the chain."
    )
  return resolved


def _what(name: str) -> str:
  return {"mode": "mode", "bucket_bytes": "bucket size", "compression": "all-reduce",
          "user": "all-reduce"}.get(name, name)


def chain(*reductions: Reduction) -> Reduction:
  """One reduction from pieces, in any order: at most one mode (default `mean`), at most one
  `bucketed`, at most one reduction that replaces the all-reduce (`powersgd` or a user's
  `Reduction`). Checked here, once; `ValueError` for pieces that do not compose."""
  pieces = [p for r in reductions for p in _pieces(r)]
  resolved = _fold(pieces)

  def init(params, layout):
    return _init(resolved, params, layout)

  def reduce(sums, state, axis_name):
    if resolved.user is not None:
      return resolved.user.reduce(sums, state, axis_name)
    if resolved.compression is not None:
      return from_powersgd(resolved.compression).reduce(sums, state, axis_name)
    return _keep(sums, state, axis_name) if resolved.mode == "none" else _psum(sums, state, axis_name)

  return Reduction(init, reduce, (("pieces", tuple(pieces)),))


def resolve(reduction: Any) -> Resolved:
  """The `Resolved` settings of `reduction` (`None`: `mean`); `TypeError`/`ValueError` as
  `chain` raises them."""
  if reduction is None:
    return Resolved()
  if isinstance(reduction, Resolved):
    return reduction
  return _fold(_pieces(reduction))


def _init(resolved: Resolved, params: Any, layout: Any) -> Any:
  replicas = layout.replicas
  if resolved.compression is not None:  # a pipeline's stacks are compressed layer by layer (within a stage)
    return init_compression(params, resolved.compression, replicas, _stage_stacks(params, layout))
  if resolved.user is None:
    return None
  one = resolved.user.init(params, layout)
  # One copy per replica, stacked on a leading axis that the data axes split (each replica reads its own).
  return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (replicas, *jnp.shape(x))), one)


def _stage_stacks(params: Any, layout: Any) -> Any:
  stage_stacks = getattr(layout, "stage_stacks", None)  # a jaxdp.DataParallel's; None: no pipeline
  return None if stage_stacks is None else stage_stacks(params)


def init_state(reduction: Any, params: Any, layout: Any) -> Any:
  """The state of `reduction` for `params` on `layout` (a `jaxdp.DataParallel`), as
  `TrainState.compression` holds it: PowerSGD's `PowerSGDState`, a user
  reduction's state stacked per replica, or `None`."""
  return _init(resolve(reduction), params, layout)


def check_state(state: Any, params: Any, reduction: Any, layout: Any, name: str = "state.compression") -> None:
  """Raises `ValueError` unless `state` is what `init_state` makes for `params`, `reduction` and
  `layout` (shapes and structure only; nothing is read)."""
  resolved = resolve(reduction)
  if resolved.user is None:
    check_compression_state(state, params, resolved.compression, layout.replicas, name,
                            _stage_stacks(params, layout))
    return
  expected = jax.eval_shape(lambda p: _init(resolved, p, layout), params)
  got = jax.tree.map(lambda x: (tuple(jnp.shape(x)), jnp.result_type(x)), state)
  want = jax.tree.map(lambda x: (tuple(x.shape), x.dtype), expected)
  if jax.tree.structure(got) != jax.tree.structure(want) or jax.tree.leaves(got) != jax.tree.leaves(want):
    raise ValueError(
        f"{name} is not the state the step's reduction makes for these params on {layout.replicas} replicas "
        f"(structure {jax.tree.structure(got)}, shapes {jax.tree.leaves(got)[:4]}...; expected "
        f"{jax.tree.leaves(want)[:4]}...). Make the state with jaxdp.init_state(..., reduction=) with the same "
        "reduction and layout."
    )


from jaxdp.reductions import onebit  # noqa: E402  (after Reduction: onebit builds one)
from jaxdp.reductions.onebit import onebit_adam  # noqa: E402
