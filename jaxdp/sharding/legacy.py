"""The keyword API of jaxdp 0.1, translated into today's values at the edge (one place, with a warning).

Until this release the step's options were keywords, repeated in every entry
point (`make_train_step(..., zero_stage=3, layers="blocks",
grad_reduce_dtype=jnp.bfloat16, compression=jaxdp.powersgd(2))`). They are
now three values: the layout (`jaxdp.data_parallel`), the reduction
(`jaxdp.reductions`) and the precision policy (`jaxdp.precision`).
`accepts_legacy_keywords` wraps each entry point so that a call with
the old keywords still runs, with the same numbers bit for bit, after one
`DeprecationWarning` that names the replacement; nothing below the edge
knows the old keywords.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

_LAYOUT = ("axis_name", "zero_stage", "layers", "pipeline", "param_specs", "backend", "stage_axis")
_REDUCTION = ("bucket_bytes", "compression")
_PRECISION = ("compute_dtype", "grad_reduce_dtype", "reduce_dtype", "loss_scaling", "loss_scale")
# Entry points whose layout argument is per replica (an axis name is enough: no mesh is built).
_PER_REPLICA = ("train_step", "gradient_step", "local_gradient", "reduce_gradient", "eval_sums")
# DiLoCo's entry points: 0.1's outer_axis= is now implied by the layout (the mesh's one axis not a data axis).
_DILOCO = ("init_diloco_state", "abstract_diloco_state", "make_diloco_step", "restore_diloco")


def _layout(name: str, old: dict, layout: Any) -> Any:
  from jaxdp.sharding import pipelining
  from jaxdp.sharding.parallel import DataParallel, data_parallel

  if name in _PER_REPLICA:
    if set(old) - {"axis_name"}:
      raise TypeError(f"{name}() runs per replica: of the layout it takes the data axes only; got "
                      f"{', '.join(sorted(old))}.")
    return old.get("axis_name", layout if layout is not None else "data")
  if isinstance(layout, DataParallel):
    raise TypeError(f"{name}() was given a jaxdp.DataParallel and the keywords {', '.join(sorted(old))}, which it "
                    "holds: set them in jaxdp.data_parallel(...) only.")
  stage_axis = old.pop("stage_axis", None)
  if stage_axis is not None and old.get("pipeline") is None:
    old["pipeline"] = pipelining.pipeline(1, axis_name=stage_axis)  # the placement reads only its stage axis
  return data_parallel(layout, **old)


def _reduction(old: dict, reduction: Any) -> Any:
  from jaxdp import reductions

  pieces = []
  if isinstance(reduction, str):
    if reduction not in reductions.MODES:
      raise ValueError(f"reduction={reduction!r} is not supported; use one of "
                       f"{', '.join(map(repr, reductions.MODES))}.")
    pieces.append(getattr(reductions, reduction)())
  elif reduction is not None:
    pieces.append(reduction)
  if old.get("bucket_bytes") is not None:
    pieces.append(reductions.bucketed(old["bucket_bytes"]))
  if old.get("compression") is not None:
    from jaxdp.reductions.compression import check_compression

    check_compression(old["compression"])  # named as the caller named it
    pieces.append(old["compression"])
  return reductions.chain(*pieces) if pieces else None


def _precision(old: dict) -> Any:
  from jaxdp.core.checks import check_float_dtype, check_reduce_dtype
  from jaxdp.core.loss_scaling import LossScale, check_loss_scaling, static_loss_scale
  from jaxdp.core.precision import precision

  scaling = old.get("loss_scaling")
  check_loss_scaling(scaling)  # 0.1's loss_scaling= took a DynamicLossScale only (a number is a TypeError there)
  check_float_dtype(old.get("compute_dtype"), "compute_dtype")
  for name in ("grad_reduce_dtype", "reduce_dtype"):  # named as the caller named it
    check_reduce_dtype(old.get(name), name)
  given = old.get("loss_scale")
  if given is not None and scaling is None:  # init_state(loss_scale=scaling.init()): the state's first scale
    if not isinstance(given, LossScale):
      raise TypeError(f"loss_scale must be a jaxdp.LossScale (scaling.init()), got {type(given).__name__}.")
    scaling = static_loss_scale(float(given.scale))
  reduce_dtype = old.get("grad_reduce_dtype", old.get("reduce_dtype"))
  return precision(old.get("compute_dtype"), reduce_dtype, scaling)


def _check_outer_axis(given: Any, layout: Any) -> None:
  """Raises unless 0.1's `outer_axis=given` is the axis `layout` implies, as that call would have (a mesh that
  has no such single axis is left to the entry point's own error)."""
  from jaxdp.sharding.layout import axis_names
  from jaxdp.sharding.parallel import DataParallel

  if not isinstance(given, str):
    raise TypeError(f"outer_axis must name one mesh axis (a str, e.g. 'replica'), got {given!r}.")
  mesh, data = (layout.mesh, axis_names(layout.axis_name)) if isinstance(layout, DataParallel) else (layout, ("data",))
  if mesh is None:
    return
  if given in data:
    raise ValueError(
        f"outer_axis={given!r} is also one of the data axes {data}: DiLoCo needs an outer axis of its own, over "
        f"which the groups differ between syncs; pass axis_name without it, e.g. axis_name="
        f"{tuple(a for a in data if a != given) or 'data'!r}."
    )
  if given not in mesh.axis_names:
    raise ValueError(
        f"DiLoCo without an outer axis: mesh has axes {mesh.axis_names} but no {given!r} (outer_axis). Build a "
        f"mesh with both, e.g. jax.make_mesh((R, D), ({given!r}, {data[0]!r}), axis_types=(AxisType.Auto,) * 2)."
    )


def _replacement(name: str, old: dict) -> str:
  parts = []
  if "outer_axis" in old:
    parts.append("nothing for outer_axis=: the groups' axis is the mesh's one axis that is not a data axis "
                 "(jaxdp.runtime.diloco.outer_axis_of(layout))")
  if "mesh" in old:
    parts.append("layout=mesh (or a jaxdp.data_parallel(mesh, ...))")
  if set(old) & set(_LAYOUT):
    parts.append("the layout jaxdp.data_parallel(mesh, " + ", ".join(f"{k}=..." for k in old if k in _LAYOUT) + ")")
  if set(old) & {"bucket_bytes", "compression", "reduction"}:
    parts.append("reduction=jaxdp.reductions.chain(mean() or rank_mean()/sum()/none(), bucketed(b), powersgd(r))")
  if set(old) & set(_PRECISION):
    parts.append("precision=jaxdp.precision(compute_dtype=..., reduce_dtype=..., loss_scaling=...)")
  if "pipeline" in old and name in ("save", "restore"):
    parts = ["data= (the data pipeline to checkpoint)"]
  if "compression_state" in old:
    parts.append("the reduction's state as the second argument")
  return "; ".join(parts)


def translate(name: str, kwargs: dict, layout_argument: str | None = "layout") -> dict:
  """`kwargs` of a call of `name` with the old keywords replaced by values (a `DeprecationWarning` if any)."""
  # loss_scale= is local_gradient's own argument (the current scale) and init_state's old one (the first).
  legacy = [k for k in _LAYOUT + _REDUCTION + _PRECISION if k != "loss_scale" or name == "init_state"]
  legacy += ["outer_axis"] if name in _DILOCO else []
  old = {k: kwargs.pop(k) for k in list(kwargs) if k in legacy}
  if "mesh" in kwargs and layout_argument is not None and name not in ("save",):
    old["mesh"] = kwargs.pop("mesh")
  legacy_reduction = isinstance(kwargs.get("reduction"), str)
  legacy_data = name in ("save", "restore") and "pipeline" in old
  legacy_state = "compression_state" in kwargs
  if not old and not legacy_reduction and not legacy_state:
    return kwargs
  shown = dict(old, **({"reduction": kwargs["reduction"]} if legacy_reduction else {}),
               **({"compression_state": None} if legacy_state else {}))
  warnings.warn(
      f"jaxdp.{name}({', '.join(f'{k}=' for k in shown)}) is the keyword API of jaxdp 0.1; pass "
      f"{_replacement(name, shown)} instead (docs/migrating.md). The old keywords stop working in the next release.",
      DeprecationWarning, stacklevel=3,
  )
  if legacy_data:
    kwargs["data"] = old.pop("pipeline")
  if legacy_state:
    kwargs["state"] = kwargs.pop("compression_state")
  if "mesh" in old:
    kwargs[layout_argument] = old.pop("mesh")
  layout_old = {k: old[k] for k in _LAYOUT if k in old}
  if layout_old and layout_argument is not None:
    kwargs[layout_argument] = _layout(name, layout_old, kwargs.get(layout_argument))
  if "outer_axis" in old:
    _check_outer_axis(old.pop("outer_axis"), kwargs.get(layout_argument))
  if set(old) & set(_REDUCTION) or legacy_reduction:
    kwargs["reduction"] = _reduction(old, kwargs.get("reduction"))
  if set(old) & set(_PRECISION):
    kwargs["precision"] = _precision(old)
  return kwargs


def accepts_legacy_keywords(name: str, positional: tuple[str, ...], layout_argument: str | None = "layout",
                            internal: Callable | None = None, internal_keywords: tuple[str, ...] = ()):
  """Wraps the entry point `name` so that the old keywords are translated (`positional`: its parameters
  in order, so that an old positional `mesh` lands in `layout`). A call with one of `internal_keywords`
  (ZeRO's splits, which left the public signatures) runs `internal(**kwargs)` instead."""

  def wrap(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def entry(*args, **kwargs):
      if len(args) > len(positional):
        raise TypeError(f"{name}() takes {len(positional)} positional arguments, got {len(args)}.")
      named = dict(zip(positional, args))
      clash = set(named) & set(kwargs)
      if clash:
        raise TypeError(f"{name}() got multiple values for {', '.join(sorted(clash))}.")
      kwargs = translate(name, {**named, **kwargs}, layout_argument)
      if internal is not None and set(kwargs) & set(internal_keywords):
        return internal(**kwargs)
      return fn(**kwargs)

    return entry

  return wrap
