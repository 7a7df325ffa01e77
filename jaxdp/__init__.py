"""jaxdp: exact synchronous data-parallel training for JAX.

Each device of a mesh axis holds a full replica of the model, computes the
gradient of its own examples, the replicas agree on one gradient with
`lax.psum` and every replica applies the same optax update. The default
reduction is the exact gradient of the global weighted mean, whatever the
split of examples or tokens over devices.

The step's options are three values: the layout (`data_parallel`: the
mesh, data axes, ZeRO stage, stacks of layers, pipeline), the reduction
(`jaxdp.reductions`) and the precision policy (`precision`).
Functional core (compose these inside your own `shard_map`/`pmap`):
`loss_sums`, `local_gradient`, `reduce_gradient`,
`gradient_step`, `finish_step`, `apply_update`,
`train_step`, `eval_sums`. Edges: `make_train_step`,
`make_eval_step`, `init_state`, `split_batch`,
`DataPipeline`, `CheckpointManager`. Model libraries:
`jaxdp.adapters.nnx`, `jaxdp.adapters.linen`, `jaxdp.adapters.batchnorm`.

The package's folders are its layers, each importing only from those before
it: `core` (the state, the loss protocol, checks, randomness, precision),
`reductions`, `sharding` (layouts, ZeRO, layer-wise, pipelines, the
layout value), `analysis` (reports, the scaling model), `training` (the
pure step), `runtime` (the jitted steps, processes, the launcher), `io`
(data, checkpoints) and `adapters` (flax nnx and linen). The names are imported on
first use (PEP 562), so that `python -m jaxdp.launch`, which imports this
package first, starts its workers without importing jax, flax or orbax. The
module paths of jaxdp 0.1 (`jaxdp.layout`, `jaxdp.nnx`, ...) still import,
with a `DeprecationWarning` naming the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# Where each public name lives; imported on first access by ``__getattr__``.
_EXPORTS_BY_MODULE = {
    "io.checkpoint": ("CheckpointManager",),
    "runtime.compiled": ("make_train_step",),
    "io.data": ("DataPipeline", "StreamingPipeline", "shard_uneven", "split_batch"),
    "runtime.diloco": ("DiLoCoState", "init_diloco_state", "make_diloco_step"),
    "runtime.evaluation": ("eval_sums", "make_eval_step"),
    "sharding.layerwise": ("gather", "scan_layers"),
    "sharding.layout": ("data_mesh", "gather_state"),
    "core.loss": ("LossOutput",),
    "core.loss_scaling": ("dynamic_loss_scale",),
    "sharding.parallel": ("DataParallel", "data_parallel", "init_state", "place_state"),
    "sharding.pipelining": ("pipeline",),
    "core.precision": ("Precision", "precision"),
    "core.randomness": ("example_keys",),
    "training.reduction": ("local_gradient", "loss_sums", "reduce_gradient"),
    "training.replicas": ("assert_replicas_equal", "per_replica", "replica_divergence"),
    "analysis.reports": ("comm_report", "memory_report"),
    "core.state": ("TrainState",),
    "training.step": ("apply_update", "finish_step", "gradient_step", "train_step"),
}
_EXPORTS = {name: module for module, names in _EXPORTS_BY_MODULE.items() for name in names}

# Names of jaxdp 0.1's top level that now live in a module only: still reachable here, with a warning.
_MOVED_BY_MODULE = {
    "adapters.batchnorm": ("Moments", "masked_moments"),
    "io.checkpoint": ("Restored",),
    "runtime.compiled": ("CompiledStep",),
    "reductions.compression": ("PowerSGD", "PowerSGDState", "init_compression", "powersgd"),
    "io.data": ("PADS", "addressable_positions", "device_indices", "epoch_permutation", "process_positions"),
    "runtime.diloco": ("DiLoCoStep", "diloco_params"),
    "runtime.evaluation": ("EvalStep", "means_from_sums"),
    "sharding.layerwise": ("gather_policy",),
    "sharding.layout": ("BACKENDS", "ZERO_STAGES", "Layout", "auto_mesh", "state_specs"),
    "core.loss": ("LOSS_KEYWORDS",),
    "core.loss_scaling": ("DynamicLossScale", "LossScale", "update_loss_scale"),
    "sharding.pipelining": ("Pipeline",),
    "core.randomness": ("use_example_ids",),
    "training.reduction": ("LocalGradient", "ReducedGradient", "applied_gradient", "as_varying", "divide_gradient",
                  "global_norm", "reduce_model_state"),
    "reductions": ("REDUCTIONS",),
    "analysis.reports": ("Collective", "MemoryReport", "collectives_from_hlo"),
}
_MOVED = {name: module for module, names in _MOVED_BY_MODULE.items() for name in names}
_RENAMED = {"REDUCTIONS": "MODES"}  # old top-level name -> its name in the module

# jaxdp 0.1's module paths -> where those modules live now (imported through _OldModulePaths, with a warning).
_MOVED_MODULES = {
    "jaxdp.state": "jaxdp.core.state",
    "jaxdp.loss": "jaxdp.core.loss",
    "jaxdp.carries": "jaxdp.core.carries",
    "jaxdp.integrations": "jaxdp.core.integrations",
    "jaxdp._checks": "jaxdp.core.checks",
    "jaxdp.randomness": "jaxdp.core.randomness",
    "jaxdp.loss_scaling": "jaxdp.core.loss_scaling",
    "jaxdp.mixed_precision": "jaxdp.core.precision",
    "jaxdp.compression": "jaxdp.reductions.compression",
    "jaxdp.layout": "jaxdp.sharding.layout",
    "jaxdp.pipelining": "jaxdp.sharding.pipelining",
    "jaxdp.layerwise": "jaxdp.sharding.layerwise",
    "jaxdp.parallel": "jaxdp.sharding.parallel",
    "jaxdp._legacy": "jaxdp.sharding.legacy",
    "jaxdp.reports": "jaxdp.analysis.reports",
    "jaxdp.scaling": "jaxdp.analysis.scaling",
    "jaxdp._config": "jaxdp.training.config",
    "jaxdp.reduction": "jaxdp.training.reduction",
    "jaxdp.step": "jaxdp.training.step",
    "jaxdp.replicas": "jaxdp.training.replicas",
    "jaxdp.compiled": "jaxdp.runtime.compiled",
    "jaxdp.evaluation": "jaxdp.runtime.evaluation",
    "jaxdp.diloco": "jaxdp.runtime.diloco",
    "jaxdp.host_inputs": "jaxdp.runtime.host_inputs",
    "jaxdp.distributed": "jaxdp.runtime.distributed",
    "jaxdp.data": "jaxdp.io.data",
    "jaxdp.checkpoint": "jaxdp.io.checkpoint",
    "jaxdp._ckpt_record": "jaxdp.io.record",
    "jaxdp.batchnorm": "jaxdp.adapters.batchnorm",
    "jaxdp.flax_support": "jaxdp.adapters.flax_support",
    "jaxdp.nnx": "jaxdp.adapters.nnx",
    "jaxdp.linen": "jaxdp.adapters.linen",
}

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
    value = importlib.import_module(f"jaxdp.{name}")  # a submodule (jaxdp.adapters.nnx, jaxdp.reductions, ...)
  else:
    raise AttributeError(f"module 'jaxdp' has no attribute {name!r}")
  globals()[name] = value  # later accesses skip this function
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))


class _ForwardedModule(types.ModuleType):
  """An old module path: every attribute read from the module that lives at the new one."""

  def __init__(self, name: str, target: str):
    super().__init__(name)
    self.__dict__["_target"] = target

  def __getattr__(self, attr: str):
    return getattr(importlib.import_module(self.__dict__["_target"]), attr)


class _OldModulePaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """`import jaxdp.layout` (a path of jaxdp 0.1): a module forwarding to `jaxdp.sharding.layout`, after a
  `DeprecationWarning`. Only the names of `_MOVED_MODULES` are answered; nothing else is touched."""

  def find_spec(self, fullname, path=None, target=None):
    if fullname in _MOVED_MODULES:
      return importlib.util.spec_from_loader(fullname, self)
    return None

  def create_module(self, spec):
    new = _MOVED_MODULES[spec.name]
    warnings.warn(f"{spec.name} moved to {new}; import it from there.", DeprecationWarning, stacklevel=2)
    return _ForwardedModule(spec.name, new)

  def exec_module(self, module) -> None:
    pass


if not any(isinstance(finder, _OldModulePaths) for finder in sys.meta_path):
  sys.meta_path.insert(0, _OldModulePaths())  # before an editable install's finder, which would look in the folder
