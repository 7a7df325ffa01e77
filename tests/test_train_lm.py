"""The byte-level LM experiment, end to end in a tiny configuration (8 simulated CPU devices, 4 used)."""

import dataclasses
import json
import pathlib
import shutil
import sysconfig

import jax
import numpy as np
import pytest

import jaxdp

from experiments import train_lm
from experiments.lm import corpus
from experiments.lm import model as lm

# Round-off tolerance on a loss of ~5.5 nats: float32's ulp there is 4.8e-7, so 1e-5 is ~20 ulps,
# room for a different summation order (psum of 4 partial sums vs one sum) over a few Adam steps.
F32_LOSS_ATOL = 1e-5

TINY = train_lm.Config(
    devices=4, steps=4, batch_size=8, seq_len=32, layers=1, d_model=16, heads=2, d_ff=32,
    val_every=4, max_bytes=None, progress=False, out=None,
)


pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: the tests check agreement, not speed


@pytest.fixture(scope="module")
def paragraphs(tmp_path_factory) -> str:
  """A single text file (real stdlib source); its blank-line paragraphs are documents of many lengths.

  About one chunk in ten of 32 bytes ends a paragraph, so most steps give the devices uneven token counts.
  """
  path = tmp_path_factory.mktemp("corpus") / "textwrap.txt"
  path.write_bytes((pathlib.Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes())
  return str(path)


def test_chunks_cover_every_target_once():
  docs = [b"abcdefghij", b"xy", b"z", b"0123"]
  chunks = corpus.chunk_documents(docs, seq_len=4)
  assert [bytes(c) for c in chunks] == [b"abcde", b"efghi", b"ij", b"xy", b"0123"]  # b"z" has no target
  batch, mask = corpus.make_collate(4)(chunks)
  assert mask.sum(axis=1).tolist() == [4, 4, 1, 1, 3]
  assert sum(mask.sum(axis=1)) == sum(len(d) - 1 for d in docs)
  assert bytes(batch["targets"][2, :1].astype(np.uint8)) == b"j" and batch["inputs"][2, 1:].sum() == 0


def test_default_corpus_is_stdlib_and_split_is_disjoint():
  docs = corpus.read_documents(None, max_bytes=50_000)
  train_docs, val_docs = corpus.split_documents(docs, 10)
  assert sum(map(len, docs)) >= 50_000 and len(val_docs) == len(docs) // 10
  assert len(train_docs) + len(val_docs) == len(docs) and not set(train_docs) & set(val_docs)
  assert docs == corpus.read_documents(None, max_bytes=50_000)  # deterministic


def test_dropout_is_keyed_by_rng():
  graphdef, params = train_lm.make_model(dataclasses.replace(TINY, dropout=0.5))
  batch, _ = corpus.make_collate(TINY.seq_len)(corpus.chunk_documents([bytes(range(40))], TINY.seq_len))
  loss_fn = jax.jit(lm.make_loss_fn(graphdef))  # one compile per signature; eager would compile every op
  keys = ((), (jax.random.key(1),), (jax.random.key(1),), (jax.random.key(2),))
  plain, a, a_again, b = (loss_fn(params, batch, *k).losses for k in keys)
  assert np.array_equal(a, a_again) and not np.array_equal(a, plain) and not np.array_equal(a, b)


def test_main_writes_metrics_and_same_seed_rerun_is_bitwise_equal(paragraphs, tmp_path):
  out = tmp_path / "run"
  argv = ["--devices", "4", "--steps", "4", "--batch-size", "8", "--seq-len", "32", "--layers", "1",
          "--d-model", "16", "--heads", "2", "--d-ff", "32", "--val-every", "4", "--max-bytes", "0",
          "--corpus", paragraphs, "--dropout", "0.1", "--no-progress", "--out", str(out)]
  first = train_lm.main(argv)
  lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines] == [0, 1, 2, 3]
  assert all({"loss", "tokens", "grad_norm", "time"} <= set(r) and r["tokens"] > 0 for r in lines)
  assert all(r["tokens"] == sum(r["device_tokens"]) for r in lines)
  summary = json.loads((out / "summary.json").read_text())
  assert summary["devices"] == 4 and np.isfinite(summary["val_loss"]) and summary["dropout"] == 0.1
  again = train_lm.train(train_lm.config_from_args(argv), out=None)
  assert [r["loss"] for r in again["records"]] == [r["loss"] for r in first["records"]]
  assert again["summary"]["val_loss"] == first["summary"]["val_loss"]


def test_compare_mean_matches_one_device_and_rank_mean_does_not(paragraphs, tmp_path):
  config = dataclasses.replace(TINY, corpus=paragraphs, accum_steps=2, out=str(tmp_path))
  result = train_lm.compare(config)
  assert (tmp_path / "loss_curves.png").stat().st_size > 0
  assert json.loads((tmp_path / "compare.json").read_text())["uneven_steps"] == result["uneven_steps"]
  assert all((tmp_path / name / "metrics.jsonl").exists() for name, _ in train_lm.RUNS)
  assert result["uneven_steps"] > 0  # paragraphs of many lengths: devices hold different token counts
  mean, rank_mean = result["mean_vs_single"]["max_abs_loss_diff"], result["rank_mean_vs_single"]["max_abs_loss_diff"]
  assert mean < F32_LOSS_ATOL, result
  assert rank_mean > max(10 * mean, F32_LOSS_ATOL), result  # DDP's mean of means: a real, visible gap


def test_a_run_resumed_from_its_checkpoint_is_the_same_run(paragraphs, tmp_path):
  """Interrupted after step 2 (the step-4 checkpoint removed) and started again: steps 2-3 and the params are bitwise equal."""
  ckpt = tmp_path / "ckpt"
  config = dataclasses.replace(TINY, corpus=paragraphs, dropout=0.1, ckpt_dir=str(ckpt), ckpt_every=2)
  full = train_lm.train(config)
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [2, 4]
  shutil.rmtree(ckpt / "4")  # as if killed before the last save
  resumed = train_lm.train(config)
  assert [r["step"] for r in resumed["records"]] == [2, 3]
  assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in full["records"][2:]]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed["params"]), jax.device_get(full["params"]))


# Combined meshes (tensor parallel x data parallel, hybrid) against one device. Two layers, dropout 0, batch 16 of
# 16 bytes; the global batch and its order are the same on every layout, so the losses must agree to round-off.
MESH_ARGS = ["--steps", "4", "--batch-size", "16", "--seq-len", "16", "--layers", "2", "--d-model", "32", "--heads", "4",
             "--d-ff", "64", "--dropout", "0", "--val-every", "4", "--max-bytes", "0", "--no-progress"]
MESH_RTOL = 1e-5  # ~20 float32 ulps on losses of ~5: XLA's partitioned sums (over "model") re-associate


@pytest.fixture(scope="module")
def one_device_run(paragraphs):
  """The reference shared by the mesh tests: the same flags on one device (a 1-device data mesh)."""
  return train_lm.train(train_lm.config_from_args(MESH_ARGS + ["--corpus", paragraphs, "--devices", "1"]), out=None)


@pytest.mark.parametrize("mesh, zero_stage", [
    ("data=4,model=2", 0),
    ("data=4,model=2", 3),
    ("replica=2,data=4", 3),
])
def test_combined_mesh_losses_equal_one_device(paragraphs, one_device_run, mesh, zero_stage):
  config = train_lm.config_from_args(MESH_ARGS + ["--corpus", paragraphs, "--mesh", mesh, "--zero-stage", str(zero_stage)])
  run = train_lm.train(config, out=None)
  axes = train_lm.parse_mesh(mesh)
  assert run["summary"]["mesh"] == axes and run["summary"]["devices"] == 8 and run["summary"]["zero_stage"] == zero_stage
  data_ways = 8 // axes.get("model", 1)
  assert all(len(r["device_tokens"]) == data_ways and r["tokens"] == sum(r["device_tokens"]) for r in run["records"])
  want = [r["loss"] for r in one_device_run["records"]]
  np.testing.assert_allclose([r["loss"] for r in run["records"]], want, rtol=MESH_RTOL, atol=0)
  np.testing.assert_allclose(run["summary"]["val_loss"], one_device_run["summary"]["val_loss"], rtol=MESH_RTOL)
  specs = {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_leaves_with_path(run["params"])}
  qkv, down = specs["['blocks'][0]['qkv']['kernel'].value"], specs["['blocks'][0]['down']['kernel'].value"]
  if "model" in axes:  # Megatron: heads column-split, the MLP's second layer row-split, kept through training
    assert tuple(qkv)[2] == "model" and tuple(down)[0] == "model", specs
  else:
    assert "model" not in str(specs)
  if zero_stage == 3:  # and ZeRO-3 splits every such kernel over "data" too
    assert "data" in tuple(qkv) and "data" in tuple(down), specs


def test_mesh_flag_parsing_and_simulated_device_count(monkeypatch):
  assert train_lm.parse_mesh("replica=2, data=4") == {"replica": 2, "data": 4}
  for bad, match in (("model=2", "no data axis"), ("data=4,pipe=2", "unknown axis"), ("data=0", "positive size"),
                     ("data=2,data=2", "twice"), ("data", "name=size")):
    with pytest.raises(ValueError, match=match):
      train_lm.parse_mesh(bad)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
  train_lm._simulate_cpu_devices(["--mesh", "data=4,model=2"])
  assert train_lm.os.environ["JAX_NUM_CPU_DEVICES"] == "8"
  with pytest.raises(SystemExit):
    train_lm._simulate_cpu_devices(["--mesh", "model=2"])
  mesh = train_lm.build_mesh(train_lm.config_from_args(["--mesh", "replica=2,data=2,model=2"]))
  assert mesh.axis_names == ("replica", "data", "model") and train_lm.data_axes(mesh) == ("replica", "data")
  assert train_lm.data_parallel_size(mesh) == 4 and train_lm.data_axes(train_lm.build_mesh(TINY)) == "data"
  with pytest.raises(ValueError, match="--devices 4 but --mesh"):
    train_lm.build_mesh(train_lm.config_from_args(["--mesh", "data=4,model=2", "--devices", "4"]))


# --scan-layers: the blocks stacked with nnx.vmap and run with nnx.scan; at --zero-stage 3 layer-wise (layers="blocks").
# The stacked model draws its own weights (nnx.split_rngs keys), so for a like-for-like check it starts from the list
# model's weights stacked (lm.stack_blocks): then it is the same function, and must train like the list model.


def test_stacked_blocks_are_the_list_model_with_and_without_dropout():
  sizes = dict(seq_len=TINY.seq_len, layers=2, d_model=16, heads=2, d_ff=32, dropout=0.5)
  listed, params = lm.make_model(seed=0, **sizes)
  stacked, drawn = lm.make_model(seed=0, scan_layers=True, **sizes)
  params_stacked = lm.stack_blocks(params)
  assert jax.tree.structure(params_stacked) == jax.tree.structure(drawn)
  specs = jaxdp.adapters.nnx.partition_specs(params_stacked)
  assert specs == jaxdp.adapters.nnx.partition_specs(drawn)  # the layer axis added, unsplit, to every tensor-parallel spec
  assert tuple(specs["blocks"]["qkv"]["kernel"]) == (None, None, None, "model", None)
  batch, _ = corpus.make_collate(TINY.seq_len)(corpus.chunk_documents([bytes(range(70))], TINY.seq_len))
  f_list, f_stack = jax.jit(lm.make_loss_fn(listed)), jax.jit(lm.make_loss_fn(stacked))
  for keys in ((), (jax.random.key(1),)):  # dropout keys split per layer as the list splits them: the same masks
    np.testing.assert_allclose(f_stack(params_stacked, batch, *keys).losses, f_list(params, batch, *keys).losses,
                               rtol=1e-6, atol=1e-6)
  assert not np.array_equal(f_stack(params_stacked, batch, jax.random.key(1)).losses, f_stack(params_stacked, batch).losses)


def test_layerwise_stage3_on_scanned_layers_matches_the_list_model_on_one_device(paragraphs, one_device_run):
  """Tensor x data parallel (data=4, model=2), layer-wise stage 3, against the list model's one-device stage-0 run."""
  base = MESH_ARGS + ["--corpus", paragraphs]
  _, params = train_lm.make_model(train_lm.config_from_args(base))
  config = train_lm.config_from_args(base + ["--mesh", "data=4,model=2", "--zero-stage", "3", "--scan-layers"])
  assert train_lm.layerwise_stack(config) == "blocks" and train_lm.layerwise_stack(config, "rank_mean") is None
  run = train_lm.train(config, out=None, params=lm.stack_blocks(params))
  assert run["summary"]["layerwise"] and run["summary"]["scan_layers"]
  want = [r["loss"] for r in one_device_run["records"]]
  np.testing.assert_allclose([r["loss"] for r in run["records"]], want, rtol=MESH_RTOL, atol=0)
  np.testing.assert_allclose(run["summary"]["val_loss"], one_device_run["summary"]["val_loss"], rtol=MESH_RTOL)
  specs = {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_leaves_with_path(run["params"])}
  qkv, down = tuple(specs["['blocks']['qkv']['kernel'].value"]), tuple(specs["['blocks']['down']['kernel'].value"])
  # The layer axis is never split; one layer's heads over "model", and "data" on another dimension of one layer.
  assert qkv[0] is None and "model" in str(qkv[3]) and "data" in str(qkv[1:]), specs
  assert down[0] is None and "model" in str(down[1]) and "data" in str(down[1:]), specs


def test_stage_mesh_losses_equal_one_device(paragraphs, one_device_run):
  """Pipeline x data x tensor parallel (stage=2, data=2, model=2; GPipe, M = 2·P = 4) against one device."""
  base = MESH_ARGS + ["--corpus", paragraphs]
  _, params = train_lm.make_model(train_lm.config_from_args(base))
  config = train_lm.config_from_args(base + ["--mesh", "stage=2,data=2,model=2"])
  assert config.scan_layers and config.microbatches == 4 and train_lm.layerwise_stack(config) == "blocks"
  with pytest.raises(ValueError, match="add a stage axis"):
    train_lm.config_from_args(base + ["--microbatches", "4"])
  run = train_lm.train(config, out=None, params=lm.stack_blocks(params))
  assert run["summary"]["pipeline"]["microbatches"] == 4 and not run["summary"]["layerwise"]
  assert all(len(r["device_tokens"]) == 2 for r in run["records"])  # two data shards; copies over stage/model not counted
  want = [r["loss"] for r in one_device_run["records"]]
  np.testing.assert_allclose([r["loss"] for r in run["records"]], want, rtol=MESH_RTOL, atol=0)
  np.testing.assert_allclose(run["summary"]["val_loss"], one_device_run["summary"]["val_loss"], rtol=MESH_RTOL)
  specs = {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_leaves_with_path(run["params"])}
  qkv = tuple(specs["['blocks']['qkv']['kernel'].value"])
  assert qkv[0] == "stage" and "model" in str(qkv[3]), specs  # layers over the stages, heads over "model"
