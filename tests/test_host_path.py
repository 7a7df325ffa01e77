"""The host path of a step call (jaxdp.runtime.host_inputs): what a repeated call does, asserted by mechanism, never by time.

After the first call with an input signature, a call with the same signature builds no layout, validates
nothing structural, traces and compiles nothing, makes no eager JAX op and no transfer of inputs that are
placed already, and dispatches exactly one program: the step's own. A second process with the same model and
a shared persistent compilation cache compiles nothing.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src import core

import jaxdp
from jaxdp.core import checks as _checks
from jaxdp.runtime import compiled
from jaxdp.runtime import host_inputs

MESH = jaxdp.data_mesh(jax.devices()[:2])
OPT = optax.sgd(0.1)
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


def loss_fn(params, batch):
  return 0.5 * (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2


def inputs():
  state = jaxdp.init_state({"w": np.ones(3, np.float32), "b": np.zeros((), np.float32)}, OPT, MESH)
  split = jaxdp.sharding.layout.split_along(MESH, "data")
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=8).astype(np.float32)}
  return state, jax.device_put(batch, split), jax.device_put(np.ones(8, np.float32), split)


class Counts:
  """Counts, while active, every compile event, eager op, device_put, structural check and layout built, and
  each call of the programs it wraps."""

  def __init__(self, monkeypatch, programs: dict):
    self.n = {"compile": 0, "eager op": 0, "device_put": 0, "signature": 0, "make_layout": 0, "validation": 0,
              "program": 0}
    self.active = False

    def counted(name, fn):
      def wrapper(*args, **kwargs):
        if self.active:
          self.n[name] += 1
        return fn(*args, **kwargs)

      return wrapper

    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: self.active and event in COMPILE_EVENTS and self.n.__setitem__(
            "compile", self.n["compile"] + 1))
    # An op on arrays outside any trace: dispatched on its own (a jitted program's cached call never gets here).
    monkeypatch.setattr(core.EvalTrace, "process_primitive", counted("eager op", core.EvalTrace.process_primitive))
    monkeypatch.setattr(jax, "device_put", counted("device_put", jax.device_put))
    monkeypatch.setattr(_checks, "signature", counted("signature", _checks.signature))
    monkeypatch.setattr(_checks, "check_step_inputs", counted("validation", _checks.check_step_inputs))
    monkeypatch.setattr(_checks, "check_batch_split", counted("validation", _checks.check_batch_split))
    monkeypatch.setattr(compiled, "make_layout", counted("make_layout", compiled.make_layout))
    for key, program in programs.items():
      programs[key] = counted("program", program)


def backend_compiles(fn):
  """How many programs ``fn()`` compiled (or read from the persistent cache)."""
  events = []
  listener = lambda event, *_, **__: events.append(event)  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return events.count("/jax/core/compile/backend_compile_duration")


def test_the_first_call_traces_and_compiles_one_program():
  state, batch, weights = inputs()
  step = jaxdp.make_train_step(loss_fn, OPT, MESH)
  evaluate = jaxdp.make_eval_step(loss_fn, MESH)
  assert step._traces == 0  # nothing runs when the step is built
  assert backend_compiles(lambda: jax.block_until_ready(evaluate(state, batch, weights))) == 1
  assert backend_compiles(lambda: jax.block_until_ready(step(state, batch, weights))) == 1
  assert step._traces == 1


def test_a_second_train_call_builds_nothing_and_dispatches_one_program(monkeypatch):
  step = jaxdp.make_train_step(loss_fn, OPT, MESH)
  state, batch, weights = inputs()
  state, _ = step(state, batch, weights)
  layouts, plans, traces = dict(step._layout_ids), dict(step._plans), step._traces
  counts = Counts(monkeypatch, step._programs)
  counts.active = True
  for _ in range(3):
    state, metrics = step(state, batch, weights)
  counts.active = False
  assert counts.n == {"compile": 0, "eager op": 0, "device_put": 0, "signature": 0, "make_layout": 0,
                      "validation": 0, "program": 3}
  assert (step._layout_ids, step._plans, step._traces) == (layouts, plans, traces)  # no new key, no retrace
  assert len(step._programs) == 1
  # No other program of its own: every jitted callable the step holds is its one program per layout.
  jitted = type(jax.jit(lambda: 0))
  assert [name for name, v in vars(step).items() if isinstance(v, jitted)] == []
  assert int(metrics["skipped"]) == 0 and int(state.step) == 4


def test_a_second_eval_call_builds_nothing_and_dispatches_one_program(monkeypatch):
  evaluate = jaxdp.make_eval_step(loss_fn, MESH)
  state, batch, weights = inputs()
  first = evaluate(state, batch, weights)
  plans = dict(evaluate._plans)
  counts = Counts(monkeypatch, evaluate._programs)
  counts.active = True
  again = [evaluate(state, batch, weights) for _ in range(3)]
  counts.active = False
  assert counts.n == {"compile": 0, "eager op": 0, "device_put": 0, "signature": 0, "make_layout": 0,
                      "validation": 0, "program": 3}
  assert evaluate._plans == plans
  assert all(float(m["loss"]) == float(first["loss"]) for m in again)  # the means come out of the program


def test_what_the_fast_path_skips_is_checked_again_once_anything_changes(monkeypatch):
  """A state another step consumed, or leaves in another tree, leave the fast path: checked in full again."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH)
  other = jaxdp.make_train_step(loss_fn, OPT, MESH)
  state, batch, weights = inputs()
  state, _ = step(state, batch, weights)
  consumed = state
  new, _ = other(state, batch, weights)  # another step donates the state this one returned
  with pytest.raises(ValueError, match=r"donated to an earlier step"):
    step(consumed, batch, weights)
  state, _ = step(new, batch, weights)
  assert host_inputs.known_state(step._known, *jax.tree.flatten(state)) is not None
  swapped = state._replace(params={"b": state.params["b"], "w": jnp.ones(3)})  # one leaf replaced
  assert host_inputs.known_state(step._known, *jax.tree.flatten(swapped)) is None
  step(swapped, batch, weights)


def test_a_known_state_donated_to_another_program_is_still_refused():
  """The fast path still looks for deleted leaves: JAX's dispatch crashes the process on a donated buffer."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH)
  state, batch, weights = inputs()
  state, _ = step(state, batch, weights)
  jax.jit(lambda x: x * 2, donate_argnums=0)(state.params["w"])  # the user's own program consumes one leaf
  with pytest.raises(ValueError, match=r"state.params\['w'\] was donated to an earlier step"):
    step(state, batch, weights)


CACHE_WORKER = textwrap.dedent("""
    import json, os, sys
    import jax
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    events = []
    jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
    import numpy as np, optax, jaxdp
    mesh = jaxdp.data_mesh(jax.devices()[:2])
    loss_fn = lambda p, b: 0.5 * (b["x"] @ p["w"] - b["y"]) ** 2
    state = jaxdp.init_state({"w": np.ones(3, np.float32)}, optax.sgd(0.1), mesh)
    batch = {"x": np.ones((8, 3), np.float32), "y": np.zeros(8, np.float32)}
    state, metrics = jaxdp.make_train_step(loss_fn, optax.sgd(0.1), mesh)(state, batch)
    means = jaxdp.make_eval_step(loss_fn, mesh)(state, batch)
    print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                      "misses": events.count("/jax/compilation_cache/cache_misses"),
                      "loss": float(metrics["loss"]), "eval": float(means["loss"])}))
""")


def test_a_second_process_gets_its_first_step_from_the_persistent_cache(tmp_path):
  """Two processes with the same model and a shared cache directory: the second compiles nothing."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")
         and k != "JAX_COMPILATION_CACHE_DIR"}
  env["JAX_NUM_CPU_DEVICES"] = "2"
  runs = []
  for _ in range(2):
    done = subprocess.run([sys.executable, "-c", CACHE_WORKER, str(tmp_path / "cache")], env=env, check=True,
                          capture_output=True, text=True, timeout=300)
    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
  cold, cached = runs
  assert cold["misses"] > 0 and cold["hits"] == 0
  assert cached["misses"] == 0 and cached["hits"] == cold["misses"]  # every program read back, none compiled
  assert (cached["loss"], cached["eval"]) == (cold["loss"], cold["eval"])
  assert any((tmp_path / "cache").iterdir())


def test_subnormal_device_weights_in_a_running_loop_raise_within_17_calls():
  """The step's program counts them; the host reads the running count every 16 calls (once it is done)."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH)
  state, batch, weights = inputs()
  for _ in range(3):
    state, _ = step(state, batch, weights)  # the first count is read at the second call
  tiny = jax.device_put(np.full(8, 1e-40, np.float32), weights.sharding)
  state, _ = step(state, batch, tiny)
  calls = 0
  with pytest.raises(ValueError, match=r"the weights \(a JAX array\) given to an earlier step has 8 values"):
    for calls in range(1, 18):
      state, _ = step(state, batch, weights)
  assert calls <= 17
  step(state, batch, weights)  # reported once: the step goes on


def test_two_steps_in_turn_both_stay_on_the_fast_path(monkeypatch):
  """A step's donation (its arrays deleted) does not make another step check its own state again."""
  first, second = jaxdp.make_train_step(loss_fn, OPT, MESH), jaxdp.make_train_step(loss_fn, OPT, MESH)
  (a, batch, weights), (b, *_) = inputs(), inputs()
  a, _ = first(a, batch, weights)
  b, _ = second(b, batch, weights)
  counts = Counts(monkeypatch, first._programs)
  counts.active = True
  for _ in range(2):
    a, _ = first(a, batch, weights)
    b, _ = second(b, batch, weights)
  counts.active = False
  assert (counts.n["signature"], counts.n["validation"], counts.n["program"]) == (0, 0, 2)


def _many_leaves(leaves=96):
  """A sum of ``leaves / 2`` linear models of 3 inputs, on 2 devices, Adam."""
  rng = np.random.default_rng(0)
  params = {f"{kind}{i:02d}": (rng.normal(size=3) if kind == "w" else np.zeros(())).astype(np.float32)
            for i in range(leaves // 2) for kind in ("w", "b")}

  def loss(p, batch):
    pred = sum(batch["x"] @ p[f"w{i:02d}"] + p[f"b{i:02d}"] for i in range(leaves // 2))
    return 0.5 * (pred - batch["y"]) ** 2

  opt = optax.adam(0.1)
  _, batch, weights = inputs()
  return loss, opt, jaxdp.init_state(params, opt, MESH), batch, weights


def _entry_shapes_bytes(text):
  """The bytes of every array shape written in the compiled program's entry computation."""
  import re

  entry = text[text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  sizes = {"f32": 4, "s32": 4, "u32": 4, "pred": 1, "f16": 2, "bf16": 2}
  out = []
  for dtype, dims in re.findall(r"\b(f32|s32|u32|pred|f16|bf16)\[([\d,]*)\]", entry):
    out.append(sizes[dtype] * int(np.prod([int(d) for d in dims.split(",") if d])))
  return out


def test_a_small_steps_program_stays_within_xla_cpus_sequential_threshold():
  """XLA CPU runs a program's kernels in order on the calling thread only when no buffer exceeds 512 bytes.

  64 leaves (520 bytes of gradient, loss and weight): the gradient is packed in rows of at most 512 bytes
  (one all-reduce of several operands), the norm reads those rows, and the update selects instead of
  branching (no conditional): no array in the program's entry exceeds 512 bytes. The values are the same.
  """
  loss, opt, state, batch, weights = _many_leaves(64)
  step = jaxdp.make_train_step(loss, opt, MESH)
  text = step.lower(state, batch, weights).compile().as_text()
  assert max(_entry_shapes_bytes(text)) <= jaxdp.training.reduction.ROW_BYTES
  assert " conditional(" not in text
  entry = text[text.index("\nENTRY"):]
  assert entry.count(" all-reduce(") == 2  # the gradient's (several rows in one), the norm's 4 bytes
  assert jaxdp.training.reduction.rows_of([400, 400, 100]) == [[0], [1, 2]]
  assert jaxdp.training.reduction.rows_of([100, 600]) == [[0, 1]]  # a leaf over 512 bytes: one row, as before


def test_the_update_selects_or_branches_with_the_same_values_and_skips(monkeypatch):
  """A small state's update is selected (``jnp.where``), a larger one's branched (``lax.cond``, forced here
  with ``SELECT_BYTES = 0``): bit for bit the same state after a good step, and a NaN step skipped on both."""
  from jaxdp.training import step as step_module

  loss, opt, state, batch, weights = _many_leaves(8)
  poisoned = dict(batch, x=batch["x"].at[0, 0].set(jnp.nan))
  results = {}
  for mode, limit in (("select", step_module.SELECT_BYTES), ("cond", 0)):
    monkeypatch.setattr(step_module, "SELECT_BYTES", limit)
    step = jaxdp.make_train_step(loss, opt, MESH, donate=False)
    text = step.lower(state, batch, weights).compile().as_text()
    assert (" conditional(" in text) == (mode == "cond")
    good, metrics = step(state, batch, weights)
    assert int(metrics["skipped"]) == 0
    skipped, metrics = step(good, poisoned, weights)
    assert int(metrics["skipped"]) == 1 and int(metrics["nonfinite"]) == 1
    jax.tree.map(np.testing.assert_array_equal, skipped, good)  # nothing moved, step count and moments included
    results[mode] = good
  jax.tree.map(np.testing.assert_array_equal, results["select"], results["cond"])
