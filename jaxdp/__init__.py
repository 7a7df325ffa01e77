"""jaxdp: exact synchronous data-parallel training for JAX.

Each device of a mesh axis holds a full replica of the model, computes the
gradient of its own examples, the replicas agree on one gradient with
``lax.psum`` and every replica applies the same optax update. The default
reduction is the exact gradient of the global weighted mean, whatever the
split of examples or tokens over devices.

Functional core (compose these inside your own ``shard_map``/``pmap``):
:func:`loss_sums`, :func:`local_gradient`, :func:`reduce_gradient`,
:func:`gradient_step`, :func:`finish_step`, :func:`apply_update`,
:func:`train_step`, :func:`eval_sums`. Edges:
:func:`make_train_step`, :func:`make_eval_step`, :func:`data_mesh`,
:func:`init_state`, :func:`shard_uneven`, :func:`split_batch`, :class:`DataPipeline`,
:func:`per_replica`, :func:`assert_replicas_equal`. Real programs: the
loss protocol (:class:`LossOutput`, :mod:`jaxdp.loss`: model state,
metrics, padding weights), :mod:`jaxdp.nnx` (flax nnx Modules), :mod:`jaxdp.linen` (flax linen's
BatchNorm, exact), :mod:`jaxdp.batchnorm` (exact cross-replica BatchNorm)
and :mod:`jaxdp.randomness` (dropout masks that follow example ids, the same
on any layout).

The names are imported on first use (PEP 562), so that ``python -m
jaxdp.launch``, which imports this package first, starts its workers without
importing jax, flax or orbax.
"""

from __future__ import annotations

import importlib
import importlib.util

# Where each public name lives; imported on first access by ``__getattr__``.
_EXPORTS_BY_MODULE = {
    "batchnorm": ("Moments", "masked_moments"),
    "checkpoint": ("CheckpointManager", "Restored"),
    "compiled": ("CompiledStep", "make_train_step"),
    "diloco": ("DiLoCoState", "DiLoCoStep", "diloco_params", "init_diloco_state", "make_diloco_step"),
    "compression": ("PowerSGD", "PowerSGDState", "init_compression", "powersgd"),
    "data": ("PADS", "DataPipeline", "StreamingPipeline", "addressable_positions", "device_indices",
             "epoch_permutation", "process_positions", "shard_uneven", "split_batch"),
    "evaluation": ("EvalStep", "eval_sums", "make_eval_step", "means_from_sums"),
    "layerwise": ("gather", "gather_policy", "scan_layers"),
    "loss": ("LOSS_KEYWORDS", "LossOutput"),
    "loss_scaling": ("DynamicLossScale", "LossScale", "dynamic_loss_scale", "update_loss_scale"),
    "pipelining": ("Pipeline", "pipeline"),
    "layout": ("BACKENDS", "ZERO_STAGES", "Layout", "auto_mesh", "data_mesh", "gather_state", "init_state",
               "place_state", "state_specs"),
    "randomness": ("example_keys", "use_example_ids"),
    "reduction": ("REDUCTIONS", "LocalGradient", "ReducedGradient", "applied_gradient", "as_varying",
                  "divide_gradient", "global_norm", "local_gradient", "loss_sums", "reduce_gradient",
                  "reduce_model_state"),
    "replicas": ("assert_replicas_equal", "per_replica", "replica_divergence"),
    "reports": ("Collective", "MemoryReport", "collectives_from_hlo", "comm_report", "memory_report"),
    "state": ("TrainState",),
    "step": ("apply_update", "finish_step", "gradient_step", "train_step"),
}
_EXPORTS = {name: module for module, names in _EXPORTS_BY_MODULE.items() for name in names}
_MODULES = ("batchnorm", "distributed", "layerwise", "layout", "linen", "nnx", "pipelining", "randomness", "scaling")  # public submodules in __all__

__all__ = [
    "BACKENDS",
    "CheckpointManager",
    "Collective",
    "CompiledStep",
    "DataPipeline",
    "DiLoCoState",
    "DiLoCoStep",
    "DynamicLossScale",
    "EvalStep",
    "LOSS_KEYWORDS",
    "Layout",
    "LocalGradient",
    "LossOutput",
    "LossScale",
    "MemoryReport",
    "Moments",
    "PADS",
    "Pipeline",
    "PowerSGD",
    "PowerSGDState",
    "REDUCTIONS",
    "ReducedGradient",
    "Restored",
    "StreamingPipeline",
    "TrainState",
    "ZERO_STAGES",
    "addressable_positions",
    "applied_gradient",
    "apply_update",
    "as_varying",
    "assert_replicas_equal",
    "auto_mesh",
    "batchnorm",
    "collectives_from_hlo",
    "comm_report",
    "data_mesh",
    "device_indices",
    "diloco_params",
    "distributed",
    "divide_gradient",
    "dynamic_loss_scale",
    "epoch_permutation",
    "eval_sums",
    "example_keys",
    "finish_step",
    "gather",
    "gather_policy",
    "gather_state",
    "global_norm",
    "gradient_step",
    "init_compression",
    "init_diloco_state",
    "init_state",
    "layerwise",
    "layout",
    "linen",
    "local_gradient",
    "loss_sums",
    "make_diloco_step",
    "make_eval_step",
    "make_train_step",
    "masked_moments",
    "means_from_sums",
    "memory_report",
    "nnx",
    "per_replica",
    "pipeline",
    "pipelining",
    "place_state",
    "powersgd",
    "process_positions",
    "randomness",
    "reduce_gradient",
    "reduce_model_state",
    "replica_divergence",
    "scaling",
    "scan_layers",
    "shard_uneven",
    "split_batch",
    "state_specs",
    "train_step",
    "update_loss_scale",
    "use_example_ids",
]


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(f"jaxdp.{_EXPORTS[name]}"), name)
  elif name in _MODULES or (not name.startswith("_") and importlib.util.find_spec(f"jaxdp.{name}") is not None):
    value = importlib.import_module(f"jaxdp.{name}")  # any submodule, as when they were all imported eagerly
  else:
    raise AttributeError(f"module 'jaxdp' has no attribute {name!r}")
  globals()[name] = value  # later accesses skip this function
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
