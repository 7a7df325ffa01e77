"""The step's settings are checked once on the compiled path, and still when a user calls a function directly;
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
from jaxdp import settings as settings_lib

CORE = ("loss", "reduction", "step", "layout", "compiled")


def loss_fn(params, batch):
  return (batch["x"] @ params["w"] - batch["y"]) ** 2


def test_step_settings_rejects_what_the_steps_rejected():
  with pytest.raises(ValueError, match="reduction='avg'"):
    settings_lib.step_settings(reduction="avg")
  with pytest.raises(ValueError, match="reduction='none' keeps independent replicas"):
    settings_lib.step_settings(reduction="none", zero_stage=1)
  with pytest.raises(ValueError, match="accum_steps"):
    settings_lib.step_settings(accum_steps=0)
  with pytest.raises(ValueError, match="reduce_dtype=.*float16"):
    settings_lib.step_settings(grad_reduce_dtype=jnp.float16, reduce_dtype_name="reduce_dtype")
  settings = settings_lib.step_settings(compute_dtype="bfloat16", bucket_bytes=0)
  assert settings.compute_dtype == np.dtype(jnp.bfloat16) and settings.bucket_bytes == 0


def test_the_compiled_step_checks_its_settings_once(monkeypatch):
  calls = []
  check = settings_lib.check_reduction
  monkeypatch.setattr(settings_lib, "check_reduction", lambda r: (calls.append(r), check(r)))
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  params = {"w": jnp.ones((3,), jnp.float32)}
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh)
  step = jaxdp.make_train_step(loss_fn, optax.sgd(0.1), mesh, accum_steps=2)
  assert calls == ["mean"]  # make_train_step's entry
  batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros((4,), np.float32)}
  state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["loss"])) and calls == ["mean"]  # tracing the step checks nothing again


def test_public_functions_called_directly_still_check():
  batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4,))}
  params = {"w": jnp.ones((3,))}
  with pytest.raises(ValueError, match="accum_steps"):
    jaxdp.local_gradient(loss_fn, params, batch, accum_steps=0)
  with pytest.raises(ValueError, match="compute_dtype"):
    jaxdp.local_gradient(loss_fn, params, batch, compute_dtype=jnp.int32)
  local = jaxdp.local_gradient(loss_fn, params, batch)
  with pytest.raises(ValueError, match="reduction='avg'"):
    jaxdp.reduce_gradient(local, axis_name="data", reduction="avg")
  with pytest.raises(ValueError, match="reduce_dtype="):
    jaxdp.reduce_gradient(local, axis_name="data", reduce_dtype=jnp.float16)


@pytest.mark.parametrize("module", CORE)
def test_the_core_modules_do_not_name_flax(module):
  source = pathlib.Path(jaxdp.__file__).with_name(f"{module}.py").read_text()
  assert "flax" not in source.lower()


def test_the_linen_batchnorm_guard_holds_without_importing_jaxdp_flax_modules():
  # A fresh process: jaxdp.linen, jaxdp.batchnorm and jaxdp.flax_support are imported by nobody but the hook.
  program = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np, optax, sys
      import flax.linen as nn
      import jaxdp
      assert "jaxdp.batchnorm" not in sys.modules and "jaxdp.linen" not in sys.modules

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
