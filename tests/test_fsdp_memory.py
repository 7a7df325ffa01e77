"""The memory experiment of layer-wise ZeRO-3 (experiments/fsdp_memory.py) on a tiny stack: compile-only.

Two layer counts of a small MLP block at 8 devices; per-layer activations (one sequence of 4 tokens per
device) are small next to a layer's parameters, so the layer-wise peak grows by about one layer's sharded
state per layer and the whole gather's by more than one whole layer. No step runs: the peaks come from
``compiled.memory_analysis()``, exact integers for a given XLA, so the comparisons have no tolerance.
"""

import json

import jax
import optax

import jaxdp
from experiments import fsdp_memory

SCHEDULES = {"stage0", "stage3", "layerwise", "layerwise_no_reshard"}
TINY = ["--layers", "2,4", "--width", "32", "--hidden", "64", "--seq", "4", "--batch-per-device", "1"]


def test_tiny_run_writes_the_json_and_the_layerwise_peak_grows_slower(tmp_path):
  out = fsdp_memory.main([*TINY, "--out", str(tmp_path)])
  written = json.loads((tmp_path / "fsdp_memory.json").read_text())
  assert (tmp_path / "fsdp_memory.png").stat().st_size > 0
  assert written["n_devices"] == 8
  assert [r["layers"] for r in written["rows"]] == [2, 4]
  for row in written["rows"]:
    assert set(row["peak_bytes"]) == SCHEDULES
    assert all(isinstance(v, int) and v > 0 for v in row["peak_bytes"].values())
    assert row["param_bytes"] == 4 * (row["layers"] * (2 * 32 * 64 + 32) + 32 + 32)
  first, last = written["rows"]
  growth = {k: (last["peak_bytes"][k] - first["peak_bytes"][k]) / 2 for k in SCHEDULES}
  assert 0 < growth["layerwise"] < growth["stage3"]
  assert growth["layerwise"] < growth["layerwise_no_reshard"]  # the kept gathered layers cost memory
  assert out["goals"]["c_hlo"]["pass"], [r["hlo"] for r in out["rows"]]


def test_reshard_setting_is_honoured_by_a_second_step_of_the_same_loss():
  """Each step follows its body's policy: JAX's caches of the checkpointed body cannot hand one step the other's."""
  mesh = jaxdp.data_mesh(jax.devices()[:8])
  cfg = {"width": 32, "hidden": 64, "seq": 4, "batch_per_device": 1}
  params, batch, optimizer = fsdp_memory.model_params(2, 32, 64), fsdp_memory.model_batch(cfg, 8), optax.sgd(0.1)
  backward_gathers = {}
  for reshard in (True, False):
    step = jaxdp.make_train_step(fsdp_memory.make_loss(reshard), optimizer, mesh, zero_stage=3, layers="layers")
    state = jaxdp.init_state(params, optimizer, mesh, zero_stage=3, layers="layers")
    hlo = step.lower(state, batch).compile().as_text()
    backward_gathers[reshard] = len(fsdp_memory.loop_collectives(hlo)["backward"]["all-gather"])
  assert backward_gathers == {True: 3, False: 0}
