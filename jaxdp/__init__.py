"""jaxdp: exact synchronous data-parallel training for JAX.

Each device of a mesh axis holds a full replica of the model, computes the
gradient of its own examples, the replicas agree on one gradient with
``lax.psum`` and every replica applies the same optax update. The default
reduction is the exact gradient of the global weighted mean, whatever the
split of examples or tokens over devices.

The step's options are three values: the layout (:func:`data_parallel`: the
mesh, data axes, ZeRO stage, stacks of layers, pipeline), the reduction
(:mod:`jaxdp.reductions`) and the precision policy (:func:`precision`).
Functional core (compose these inside your own ``shard_map``/``pmap``):
:func:`loss_sums`, :func:`local_gradient`, :func:`reduce_gradient`,
:func:`gradient_step`, :func:`finish_step`, :func:`apply_update`,
:func:`train_step`, :func:`eval_sums`. Edges: :func:`make_train_step`,
:func:`make_eval_step`, :func:`init_state`, :func:`split_batch`,
:class:`DataPipeline`, :class:`CheckpointManager`. Model libraries:
:mod:`jaxdp.nnx`, :mod:`jaxdp.linen`, :mod:`jaxdp.batchnorm`.

The names are imported on first use (PEP 562), so that ``python -m
jaxdp.launch``, which imports this package first, starts its workers without
importing jax, flax or orbax.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

# Where each public name lives; imported on first access by ``__getattr__``.
_EXPORTS_BY_MODULE = {
    "checkpoint": ("CheckpointManager",),
    "compiled": ("make_train_step",),
    "data": ("DataPipeline", "StreamingPipeline", "shard_uneven", "split_batch"),
    "diloco": ("DiLoCoState", "init_diloco_state", "make_diloco_step"),
    "evaluation": ("eval_sums", "make_eval_step"),
    "layerwise": ("gather", "scan_layers"),
    "layout": ("data_mesh", "gather_state"),
    "loss": ("LossOutput",),
    "loss_scaling": ("dynamic_loss_scale",),
    "parallel": ("DataParallel", "data_parallel", "init_state", "place_state"),
    "pipelining": ("pipeline",),
    "mixed_precision": ("Precision", "precision"),
    "randomness": ("example_keys",),
    "reduction": ("local_gradient", "loss_sums", "reduce_gradient"),
    "replicas": ("assert_replicas_equal", "per_replica", "replica_divergence"),
    "reports": ("comm_report", "memory_report"),
    "state": ("TrainState",),
    "step": ("apply_update", "finish_step", "gradient_step", "train_step"),
}
_EXPORTS = {name: module for module, names in _EXPORTS_BY_MODULE.items() for name in names}

# Names of jaxdp 0.1's top level that now live in a module only: still reachable here, with a warning.
_MOVED_BY_MODULE = {
    "batchnorm": ("Moments", "masked_moments"),
    "checkpoint": ("Restored",),
    "compiled": ("CompiledStep",),
    "compression": ("PowerSGD", "PowerSGDState", "init_compression", "powersgd"),
    "data": ("PADS", "addressable_positions", "device_indices", "epoch_permutation", "process_positions"),
    "diloco": ("DiLoCoStep", "diloco_params"),
    "evaluation": ("EvalStep", "means_from_sums"),
    "layerwise": ("gather_policy",),
    "layout": ("BACKENDS", "ZERO_STAGES", "Layout", "auto_mesh", "state_specs"),
    "loss": ("LOSS_KEYWORDS",),
    "loss_scaling": ("DynamicLossScale", "LossScale", "update_loss_scale"),
    "pipelining": ("Pipeline",),
    "randomness": ("use_example_ids",),
    "reduction": ("LocalGradient", "ReducedGradient", "applied_gradient", "as_varying", "divide_gradient",
                  "global_norm", "reduce_model_state"),
    "reductions": ("REDUCTIONS",),
    "reports": ("Collective", "MemoryReport", "collectives_from_hlo"),
}
_MOVED = {name: module for module, names in _MOVED_BY_MODULE.items() for name in names}
_RENAMED = {"REDUCTIONS": "MODES"}  # old top-level name -> its name in the module

__all__ = [
    "CheckpointManager",
    "DataParallel",
    "DataPipeline",
    "DiLoCoState",
    "LossOutput",
    "Precision",
    "StreamingPipeline",
    "TrainState",
    "apply_update",
    "assert_replicas_equal",
    "comm_report",
    "data_mesh",
    "data_parallel",
    "dynamic_loss_scale",
    "eval_sums",
    "example_keys",
    "finish_step",
    "gather",
    "gather_state",
    "gradient_step",
    "init_diloco_state",
    "init_state",
    "local_gradient",
    "loss_sums",
    "make_diloco_step",
    "make_eval_step",
    "make_train_step",
    "memory_report",
    "per_replica",
    "pipeline",
    "place_state",
    "precision",
    "reduce_gradient",
    "reductions",
    "replica_divergence",
    "scan_layers",
    "shard_uneven",
    "split_batch",
    "train_step",
]


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(f"jaxdp.{_EXPORTS[name]}"), name)
  elif name in _MOVED:
    module = _MOVED[name]
    value = getattr(importlib.import_module(f"jaxdp.{module}"), _RENAMED.get(name, name))
    warnings.warn(f"jaxdp.{name} moved to jaxdp.{module}.{_RENAMED.get(name, name)}; import it from there.",
                  DeprecationWarning, stacklevel=2)
    return value  # not cached: each access warns
  elif not name.startswith("_") and importlib.util.find_spec(f"jaxdp.{name}") is not None:
    value = importlib.import_module(f"jaxdp.{name}")  # a submodule (jaxdp.nnx, jaxdp.reductions, ...)
  else:
    raise AttributeError(f"module 'jaxdp' has no attribute {name!r}")
  globals()[name] = value  # later accesses skip this function
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
