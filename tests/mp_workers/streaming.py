"""Worker: trains on per-process streams of different, unannounced lengths under ``python -m jaxdp.launch``.

Usage: ``streaming.py OUT_DIR --counts 7,19 [--batch B] [--template]``.
Process ``r`` streams examples ``sum(counts[:r]) .. sum(counts[:r+1]) - 1``
from a generator (its length is known to nobody); the loop ends when the
step's reduced ``has_more`` count says every stream is dry. With
``--template`` the pipeline is given a template example (needed by a process
whose stream is empty). Every rank writes ``OUT_DIR/rank{r}.json``: its step
count, the real example ids each of its mesh positions received at each
step, the reduced counts and its copy of the final parameters.

The test imports :func:`example` and :func:`collate` to build the
single-device reference on the same examples.
"""

import json
import os
import sys

import numpy as np

try:
  from mp_workers import problem  # imported by the tests
except ImportError:  # run as a script by the launcher
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import problem


def example(i: int) -> dict:
  """Example ``i``: a fixed function of ``i``, so the test can rebuild it."""
  rng = np.random.default_rng(1000 + i)
  return {
      "id": np.int32(i),
      "x": rng.normal(size=(problem.D_IN,)).astype(np.float32),
      "y": rng.normal(size=(problem.D_OUT,)).astype(np.float32),
      "w": np.float32(rng.uniform(0.5, 2.0)),
  }


def collate(examples: list) -> tuple[dict, np.ndarray]:
  batch = {k: np.stack([e[k] for e in examples]) for k in ("id", "x", "y")}
  return batch, np.stack([e["w"] for e in examples])


def stream(rank: int, counts: list[int]):
  """This process's examples, one at a time, from a generator."""
  first = sum(counts[:rank])
  for i in range(first, first + counts[rank]):
    yield example(i)


def _arg(name: str, default: str) -> str:
  return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def local_ids(batch, weights, b: int) -> dict[int, list[int]]:
  """The real example ids on each of this process's mesh positions; padding rows (weight 0) copy one real row."""
  ids = {}
  for id_shard, w_shard in zip(batch["id"].addressable_shards, weights.addressable_shards):
    assert id_shard.index == w_shard.index
    w, got = np.asarray(w_shard.data), np.asarray(id_shard.data)
    real = int(np.sum(w > 0))
    assert np.all(w[:real] > 0) and not np.any(w[real:]) and len(set(got[real:].tolist())) <= 1, (w, got)
    assert real == 0 or np.all(got[real:] == got[0]), (w, got)  # the device's own first row when it has one
    ids[(w_shard.index[0].start or 0) // b] = got[:real].tolist()
  return ids


def main():
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import optax

  import jaxdp
  from jaxdp.runtime import distributed
  from jaxdp.io.data import StreamingPipeline

  out_dir = sys.argv[1]
  counts = [int(c) for c in _arg("--counts", "7,19").split(",")]
  b = int(_arg("--batch", "2"))
  info = distributed.initialize()
  assert info.process_count == len(counts), (info, counts)
  mesh = jaxdp.data_mesh()
  opt = optax.sgd(problem.LR, momentum=problem.MOMENTUM)
  state = jaxdp.init_state(problem.init_params(), opt, mesh)
  step = jaxdp.make_train_step(problem.loss_fn, opt, mesh)
  template = example(0) if "--template" in sys.argv else None
  pipe = StreamingPipeline(stream(info.process_index, counts), collate, mesh, per_device_batch=b, template=template)

  ids, reduced = [], []
  for batch, weights, has_more in pipe:
    state, metrics = step(state, batch, weights, has_more=has_more)
    pipe.report(metrics["has_more"])
    ids.append(local_ids(batch, weights, b))
    reduced.append(int(jax.device_get(metrics["has_more"])))  # read only for the record

  params = jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data).tolist(), state.params)
  record = {"rank": info.process_index, "steps": pipe.steps, "consumed": pipe.consumed,
            "positions": list(pipe.local_positions), "ids": ids, "has_more": reduced, "params": params}
  with open(os.path.join(out_dir, f"rank{info.process_index}.json"), "w") as f:
    json.dump(record, f)
  print(f"streamed {pipe.consumed} examples in {pipe.steps} steps", flush=True)


if __name__ == "__main__":
  main()
