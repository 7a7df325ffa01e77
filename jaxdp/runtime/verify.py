"""A verifier for the user's own program: is the layout's step one device's step, up to round-off?

A float32 run on several devices drifts from one device even when the layout
is exact: models with ReLUs, max-pools or argmaxes amplify the last bits of
a sum taken in another order (a 7.5e-8 difference after one step grew to
2.8e-4 in the loss by step 10 on a port of flax's MNIST CNN). A float32
comparison of two runs cannot tell that from a bug. `verify` runs the
two checks that can:

* **float64**: the user's step, on the layout and on one device, with the
  parameters, model state, batch and weights cast to float64 (inside
  `jax.enable_x64`, restored on return). Round-off is then about 1e-16
  relative, far below any real error;
* **teacher forcing**: at each step both steps start from the *same* state
  (one device's), so a difference cannot be inherited from earlier steps;
  the one-device run itself is carried forward.

It reports the largest relative difference, per step, of the loss, the
gradient (read from a step with `optax.sgd(1.0)` from the same state),
the parameters, the optimizer state and the model state. The verdict reads
the loss, the gradient and the model state, each leaf's difference relative
to its part's largest magnitude: past `rtol` it is a real divergence (a
layout bug, or a reduction that is not exact, e.g.
`reductions.rank_mean()` on uneven rows), with the first step and leaf.
Parameters and optimizer state that part by more while the gradient agrees
are round-off amplified by the optimizer (Adam normalises a gradient leaf
that is round-off itself, e.g. a bias before a BatchNorm, to a step of
about its learning rate), reported as such. The free-running float64
difference (each run on its own trajectory) is reported too.

Example:

```python
report = jaxdp.runtime.verify.verify(loss_fn, optax.adam(1e-3), dp, params, batches, steps=5)
print(report)            # "round-off: ..." or "divergence at step 1, params['w']: ..."
assert not report.diverged
```
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxdp.core.checks import check_int, check_optimizer
from jaxdp.reductions import resolve
from jaxdp.runtime.compiled import make_train_step
from jaxdp.sharding.layout import data_mesh, gather_state
from jaxdp.sharding.parallel import DataParallel, as_layout, data_parallel, init_state

PARTS = ("loss", "gradient", "params", "opt_state", "model_state")
"""What `verify` compares at each step."""

VERDICT_PARTS = ("loss", "gradient", "model_state")
"""The parts whose difference past `rtol` is a divergence; the others only report the optimizer's amplification."""

DEFAULT_RTOL = 1e-9
"""The largest relative difference `verify` calls round-off in float64 (about 5e6 float64 ulps: room for
sums over many elements and a few steps' amplification, far below a real error's 1e-6 and up)."""


class StepDifference(NamedTuple):
  """The largest relative differences of one step: per leaf `max |a - b|` over the largest magnitude of its
  part (all of the part's leaves, both runs), then the largest over the part's leaves.

  Attributes:
    loss, gradient, params, opt_state, model_state: the part's largest relative difference (0.0 if empty).
    leaf: the part and leaf path of the largest difference over `VERDICT_PARTS`, e.g. `"gradient['w']"`.
    amplified: the same over the parameters and optimizer state, e.g. `"params['b']"`.
  """

  loss: float
  gradient: float
  params: float
  opt_state: float
  model_state: float
  leaf: str
  amplified: str

  @property
  def worst(self) -> float:
    """The largest difference of the parts the verdict reads."""
    return max(self.loss, self.gradient, self.model_state)

  @property
  def worst_state(self) -> float:
    """The largest difference of the parameters and optimizer state."""
    return max(self.params, self.opt_state)


class Report(NamedTuple):
  """What `verify` found.

  Attributes:
    forced: one `StepDifference` per step, teacher-forced (both steps from one device's state) in float64.
    free: one per step, each run on its own trajectory in float64.
    rtol: the tolerance the verdict used.
    first: `(step, leaf)` of the first teacher-forced step and leaf of `VERDICT_PARTS` past `rtol`
      (steps count from 1), or `None`.
    amplified: `(step, leaf)` of the first teacher-forced step whose parameters or optimizer state part by
      more than `rtol` while its loss, gradient and model state agree (round-off the optimizer amplified), or
      `None`.
  """

  forced: list
  free: list
  rtol: float
  first: tuple | None
  amplified: tuple | None = None

  @property
  def diverged(self) -> bool:
    """Whether a teacher-forced float64 step differs from one device's by more than `rtol`: a real divergence."""
    return self.first is not None

  @property
  def worst(self) -> float:
    """The largest teacher-forced relative difference over every step and part."""
    return max((d.worst for d in self.forced), default=0.0)

  def __str__(self) -> str:
    free = max((max(d.worst, d.worst_state) for d in self.free), default=0.0)
    if self.first is None:
      text = (f"round-off: over {len(self.forced)} teacher-forced float64 steps the layout's loss, gradient and "
              f"model state match one device's to {self.worst:.2g} (relative; tolerance {self.rtol:.2g}); "
              f"running freely, the states part by {free:.2g}.")
      if self.amplified is not None:
        step, leaf = self.amplified
        d = self.forced[step - 1]
        text += (f" At step {step}, {leaf} parts by {d.worst_state:.2g} though the gradient agrees: the "
                 "optimizer amplifies round-off there (e.g. Adam normalising a gradient leaf that is round-off "
                 "itself), not a layout error.")
      return text
    step, leaf = self.first
    d = self.forced[step - 1]
    parts = ", ".join(f"{name} {getattr(d, name):.2g}" for name in PARTS)
    return (f"divergence at step {step}, {leaf}: from the same state, the layout's float64 step differs from one "
            f"device's by {d.worst:.2g} (relative; {parts}), past the tolerance {self.rtol:.2g}: not round-off. "
            "Check the layout, the reduction (rank_mean, compression) and the loss's weights.")


def _to_float64(tree: Any) -> Any:
  """Every floating leaf of `tree` as float64 numpy (complex as complex128); others as they are."""
  def cast(x):
    dtype = np.asarray(x).dtype if not hasattr(x, "dtype") else np.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
      return np.asarray(x, np.complex128)
    if jnp.issubdtype(dtype, jnp.floating):
      return np.asarray(x, np.float64)
    return x
  return jax.tree.map(cast, tree)


def _relative(a: Any, b: Any, scale: float) -> float:
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape:
    return math.inf
  if not a.size:
    return 0.0
  if not (jnp.issubdtype(a.dtype, jnp.inexact) or jnp.issubdtype(b.dtype, jnp.inexact)):
    return 0.0 if np.array_equal(a, b) else math.inf
  a, b = a.astype(np.complex128 if np.iscomplexobj(a) else np.float64), b.astype(np.complex128 if np.iscomplexobj(b)
                                                                                 else np.float64)
  if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
    return 0.0 if np.array_equal(a, b, equal_nan=True) else math.inf
  diff = float(np.max(np.abs(a - b)))
  return 0.0 if diff == 0.0 else diff / scale if scale > 0 else math.inf


def _part_scale(*trees: Any) -> float:
  magnitudes = [float(np.max(np.abs(np.asarray(x, np.complex128 if np.iscomplexobj(x) else np.float64))))
                for tree in trees for x in jax.tree.leaves(tree)
                if np.size(x) and jnp.issubdtype(np.asarray(x).dtype, jnp.inexact) and np.all(np.isfinite(x))]
  return max(magnitudes, default=0.0)


def _difference(parts: dict, ref_parts: dict) -> StepDifference:
  """`parts`/`ref_parts`: `{part: tree}` of the layout's and one device's (host values)."""
  worst, where = {name: 0.0 for name in PARTS}, {"verdict": ("loss", -1.0), "state": ("params", -1.0)}
  for name in PARTS:
    got, want = parts[name], ref_parts[name]
    scale = _part_scale(got, want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
      d = _relative(a, b, scale)
      worst[name] = max(worst[name], d)
      kind = "verdict" if name in VERDICT_PARTS else "state"
      if d > where[kind][1]:
        where[kind] = (f"{name}{jax.tree_util.keystr(path)}" if path else name, d)
  return StepDifference(*(worst[name] for name in PARTS), where["verdict"][0], where["state"][0])


def _parts(state: Any, metrics: dict, gradient: Any) -> dict:
  return {"loss": np.asarray(metrics["loss"]), "gradient": gradient, "params": state.params,
          "opt_state": state.opt_state, "model_state": state.model_state}


def _as_pairs(batches: Iterable, steps: int | None) -> list:
  pairs = []
  for item in batches:
    if steps is not None and len(pairs) == steps:
      break
    pairs.append(tuple(item) if isinstance(item, tuple) and len(item) == 2 else (item, None))
  if steps is not None and len(pairs) < steps:
    raise ValueError(f"batches holds {len(pairs)} batches, fewer than steps={steps}; pass at least as many "
                     "(a list of (batch, weights) pairs or of batches).")
  if not pairs:
    raise ValueError("batches is empty: pass the (batch, weights) pairs (or batches) of the steps to verify.")
  return pairs


def _enable_x64() -> Any:
  enable = getattr(jax, "enable_x64", None)
  if enable is None:  # older spellings
    from jax.experimental import enable_x64 as enable
  return enable(True)


def verify(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    layout: DataParallel | Mesh | None,
    params: Any,
    batches: Iterable,
    *,
    steps: int | None = None,
    model_state: Any = None,
    rng: jax.Array | None = None,
    rtol: float = DEFAULT_RTOL,
    **step_options: Any,
) -> Report:
  """Runs the user's step on `layout` and on one device, in float64 and teacher-forced; see the module.

  Args:
    loss_fn, optimizer: as for `jaxdp.make_train_step`.
    layout: the layout to verify (a `jaxdp.DataParallel`, a `Mesh`, or `None`: every device).
    params: the initial parameters (any float dtype: cast to float64 here).
    batches: an iterable of `(batch, weights)` pairs (or of batches, without weights), host arrays; their
      floating leaves are cast to float64.
    steps: how many of them to run (default: all).
    model_state: the model's initial state, as for `jaxdp.init_state`.
    rng: the PRNG key given to every step (dropout), or `None`. The masks are one device's only with
      layout-invariant dropout (`example_ids=` in `step_options`); per-replica masks are a real difference.
    rtol: the largest relative difference called round-off (default `DEFAULT_RTOL`).
    step_options: the other keywords of `jaxdp.make_train_step` (`reduction`, `precision`,
      `accum_steps`, `example_ids`), given to both steps alike.

  Returns:
    A `Report`; `str(report)` says round-off or divergence (the step and leaf).

  PowerSGD (`reduction=jaxdp.reductions.powersgd(...)`) is verified too: its result depends on the replicas'
  error feedback only through their sum, so one device's error is the sum of the layout's replicas' (teacher
  forcing gives the layout one device's error on its first replica, zeros on the others).

  Raises:
    ValueError: a user's reduction with a per-replica state (one device cannot hold it), PowerSGD with a
      pipeline (each stacked layer has its own factors there, a whole leaf on one device), or bad arguments.
  """
  check_optimizer(optimizer)
  layout = as_layout(layout)
  fixed = {"donate", "max_consecutive_skips", "check_replicas"} & set(step_options)
  if fixed:
    raise TypeError(f"verify sets {sorted(fixed)} itself (nothing donated, no guard); drop them from its keywords.")
  reduction, precision = step_options.get("reduction"), step_options.get("precision")
  if steps is not None:
    steps = check_int(steps, "steps", 1, "the number of steps to verify.")
  if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol > 0:
    raise ValueError(f"rtol must be a number > 0, got {rtol!r}; e.g. {DEFAULT_RTOL} for float64 round-off.")
  resolved = resolve(reduction)
  if resolved.user is not None and resolved.stateful:
    raise ValueError(
        "verify compares the layout's step with one device's, but this user reduction keeps a state per replica, "
        "which one device cannot hold: verify the layout with the exact reduction (reduction=None), and the "
        "reduction against its own reference."
    )
  if resolved.compression is not None and layout.pipeline is not None:
    raise ValueError(
        "verify with PowerSGD and a pipeline: a pipeline compresses each stacked layer with its own factors, one "
        "device each whole leaf, so the two steps would run different compressions. Verify the pipeline with the "
        "exact reduction (reduction=None)."
    )
  pairs = _as_pairs(batches, steps)
  one = data_parallel(data_mesh(list(layout.mesh.devices.flat)[:1]))
  with _enable_x64():
    options = dict(step_options, max_consecutive_skips=None, donate=False)
    step = make_train_step(loss_fn, optimizer, layout, **options)
    reference = make_train_step(loss_fn, optimizer, one, **options)
    # The gradient, read off a step of plain SGD at learning rate 1 from the same state: params - new params.
    sgd = optax.sgd(1.0)
    probe, probe_reference = (make_train_step(loss_fn, sgd, where, **options) for where in (layout, one))

    def gradient(run, state, batch, weights):
      before = state._replace(opt_state=sgd.init(state.params))
      after, _ = run(before, batch, weights, rng)
      return jax.tree.map(lambda p, q: np.asarray(p) - np.asarray(q), gather_state(before).params,
                          gather_state(after).params)

    def spread(state):  # one device's PowerSGD error as the layout's replicas': all of it on the first
      if state.compression is None:
        return state
      error = jax.tree.map(lambda e: np.concatenate([np.asarray(e), np.zeros((layout.replicas - 1, *np.shape(e)[1:]),
                                                                              np.asarray(e).dtype)]),
                           state.compression.error)
      return state._replace(compression=state.compression._replace(error=error))

    params, model_state = _to_float64(params), _to_float64(model_state)
    ref = init_state(params, optimizer, one, model_state=model_state, reduction=reduction, precision=precision)
    free = init_state(params, optimizer, layout, model_state=model_state, reduction=reduction, precision=precision)
    forced, running, first, amplified = [], [], None, None
    for k, (batch, weights) in enumerate(pairs):
      batch = _to_float64(batch)
      weights = None if weights is None else _to_float64(weights)
      ref_next, ref_metrics = reference(ref, batch, weights, rng)
      # Teacher forcing: the layout's step from one device's state (moved into the layout by the step).
      forced_next, forced_metrics = step(spread(ref), batch, weights, rng)
      ref_gradient = gradient(probe_reference, ref, batch, weights)
      want = _parts(gather_state(ref_next), ref_metrics, ref_gradient)
      forced.append(_difference(_parts(gather_state(forced_next), forced_metrics,
                                       gradient(probe, spread(ref), batch, weights)), want))
      # Running freely, each run's gradient is its own state's.
      free_gradient = gradient(probe, free, batch, weights)
      free, free_metrics = step(free, batch, weights, rng)
      running.append(_difference(_parts(gather_state(free), free_metrics, free_gradient), want))
      if first is None and forced[-1].worst > rtol:
        first = (k + 1, forced[-1].leaf)
      if amplified is None and forced[-1].worst <= rtol < forced[-1].worst_state:
        amplified = (k + 1, forced[-1].amplified)
      ref = ref_next
  return Report(forced, running, float(rtol), first, amplified)
