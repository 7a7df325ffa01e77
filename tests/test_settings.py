"""The step's values are checked once on the compiled path, and still when a user calls a function directly;
the core modules know nothing of flax, whose guards still hold in a program that never imports jaxdp's flax
modules."""

import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp import reductions
from jaxdp.training import config as _config

CORE = ("core/loss", "training/reduction", "reductions/__init__", "training/step", "sharding/layout", "runtime/compiled",
        "sharding/parallel", "core/precision", "training/config")
# The package's folders in layer order: a module imports only from its own layer and those before it.
LAYERS = ("core", "reductions", "sharding", "analysis", "training", "runtime", "io", "adapters")


def loss_fn(params, batch):
  return (batch["x"] @ params["w"] - batch["y"]) ** 2


def test_step_config_rejects_what_the_steps_rejected():
  with pytest.raises(TypeError, match="jaxdp.reductions.Reduction"):
    _config.step_config(reduction="mean")  # a name is the old keyword API's (translated at the edge only)
  with pytest.raises(ValueError, match="reduction='none' keeps independent replicas"):
    _config.step_config(jaxdp.data_parallel(jaxdp.data_mesh(jax.devices()[:2]), zero_stage=1),
                        reduction=reductions.none())
  with pytest.raises(ValueError, match="accum_steps"):
    _config.step_config(accum_steps=0)
  with pytest.raises(ValueError, match="reduce_dtype=.*float16"):
    jaxdp.precision(reduce_dtype=jnp.float16)
  config = _config.step_config(precision=jaxdp.precision("bfloat16"), reduction=reductions.bucketed(0))
  assert config.compute_dtype == np.dtype(jnp.bfloat16) and config.bucket_bytes == 0


def test_the_compiled_step_checks_its_values_once(monkeypatch):
  calls = []
  fold = reductions._fold
  monkeypatch.setattr(reductions, "_fold", lambda pieces: (calls.append(len(pieces)), fold(pieces))[1])
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  params = {"w": jnp.ones((3,), jnp.float32)}
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh)
  calls.clear()
  step = jaxdp.make_train_step(loss_fn, optax.sgd(0.1), mesh, reduction=reductions.mean(), accum_steps=2)
  assert calls == [1]  # make_train_step's entry
  batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros((4,), np.float32)}
  state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and calls == [1]  # tracing the step checks nothing again


def test_public_functions_called_directly_still_check():
  batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4,))}
  params = {"w": jnp.ones((3,))}
  with pytest.raises(ValueError, match="accum_steps"):
    jaxdp.local_gradient(loss_fn, params, batch, accum_steps=0)
  with pytest.raises(ValueError, match="compute_dtype"):
    jaxdp.local_gradient(loss_fn, params, batch, precision=jaxdp.precision(jnp.int32))
  local = jaxdp.local_gradient(loss_fn, params, batch)
  with pytest.raises(TypeError, match="reduction must be"):
    jaxdp.reduce_gradient(local, layout="data", reduction=optax.sgd(0.1))
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="reduction='avg'"):
    jaxdp.reduce_gradient(local, axis_name="data", reduction="avg")  # the old keywords: the old message
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="reduce_dtype="):
    jaxdp.reduce_gradient(local, axis_name="data", reduce_dtype=jnp.float16)


@pytest.mark.parametrize("module", CORE)
def test_the_core_modules_do_not_name_flax(module):
  source = (pathlib.Path(jaxdp.__file__).parent / f"{module}.py").read_text()
  assert "flax" not in source.lower()


def test_the_linen_batchnorm_guard_holds_without_importing_jaxdp_flax_modules():
  # A fresh process: jaxdp.adapters.linen, jaxdp.adapters.batchnorm and jaxdp.adapters.flax_support are imported by nobody but the hook.
  program = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np, optax, sys
      import flax.linen as nn
      import jaxdp
      assert "jaxdp.adapters.batchnorm" not in sys.modules and "jaxdp.adapters.linen" not in sys.modules

      class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
          return nn.Dense(1)(nn.BatchNorm(use_running_average=False)(x))[:, 0]

      model = Model()
      variables = model.init(jax.random.key(0), jnp.ones((2, 3)))

      def loss_fn(params, batch, *, model_state):
        out, updates = model.apply({"params": params, "batch_stats": model_state}, batch, mutable=["batch_stats"])
        return jaxdp.LossOutput(out ** 2, model_state=updates["batch_stats"])

      mesh = jaxdp.data_mesh(jax.devices()[:1])
      state = jaxdp.init_state(variables["params"], optax.sgd(0.1), mesh, model_state=variables["batch_stats"])
      step = jaxdp.make_train_step(loss_fn, optax.sgd(0.1), mesh)
      try:
        step(state, np.ones((2, 3), np.float32))
      except ValueError as e:
        assert "flax.linen.BatchNorm" in str(e), e
        print("refused")
  """)
  env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(pathlib.Path(jaxdp.__file__).parents[1])}
  run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300)
  assert run.returncode == 0 and run.stdout.strip() == "refused", run.stderr[-3000:]


def test_importing_jaxdp_patches_no_model_library():
  program = textwrap.dedent("""
      import flax.nnx as nnx
      before = nnx.BatchNorm.__call__
      import jaxdp, jaxdp.adapters.nnx, jaxdp.adapters.linen, jaxdp.adapters.batchnorm
      assert nnx.BatchNorm.__call__ is before, "jaxdp patched nnx.BatchNorm at import"
      with jaxdp.adapters.batchnorm.training_batch_guards():  # only while a jaxdp training step traces loss_fn
        assert nnx.BatchNorm.__call__ is not before
      assert nnx.BatchNorm.__call__ is before
      print("unpatched")
  """)
  env = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(pathlib.Path(jaxdp.__file__).parents[1])}
  run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300)
  assert run.returncode == 0 and run.stdout.strip() == "unpatched", run.stderr[-3000:]


def test_no_module_imports_from_a_layer_above_its_own():
  import ast

  root, upward = pathlib.Path(jaxdp.__file__).parent, []
  for path in root.rglob("*.py"):
    parts = path.relative_to(root).parts
    if len(parts) < 2:  # the package's own __init__ and the launcher's command line sit above every layer
      continue
    layer = LAYERS.index(parts[0])
    for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside functions count too
      names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
      names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
      for name in names:
        target = name.split(".")
        if target[0] == "jaxdp" and len(target) > 1 and target[1] in LAYERS and LAYERS.index(target[1]) > layer:
          upward.append(f"{'/'.join(parts)}:{node.lineno} imports {name}")
  assert not upward, upward
  assert sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(LAYERS)
