"""DataPipeline(shuffle=False): the dataset's own order, every example once per epoch, the uneven tail weighted."""

import numpy as np
import pytest

from helpers import mesh_of
from jaxdp.io.data import DataPipeline


def collate(examples):
  return {"i": np.asarray(examples, np.int32)}, np.ones(len(examples), np.float32)


def test_unshuffled_pipeline_keeps_the_order_and_weighs_the_remainder():
  """23 examples, 3 devices, 3 rows each: 9 per step in order, the last step 5 real rows of weight 1 and 4 of 0."""
  mesh = mesh_of(3)
  pipe = DataPipeline(list(range(23)), collate, mesh, per_device_batch=3, shuffle=False)
  for epoch in range(2):
    seen = []
    for step in range(epoch * pipe.steps_per_epoch, (epoch + 1) * pipe.steps_per_epoch):
      batch, weights = pipe.batch_at(step)
      ids, w = np.asarray(batch["i"]), np.asarray(weights)
      assert set(np.unique(w)) <= {0.0, 1.0}
      seen.extend(ids[w > 0].tolist())
    assert seen == list(range(23))  # the dataset's order, each example once, every epoch
  _, weights = pipe.batch_at(pipe.steps_per_epoch - 1)
  assert float(np.asarray(weights).sum()) == 23 - 2 * 9
  shuffled = DataPipeline(list(range(23)), collate, mesh, per_device_batch=3)
  assert np.concatenate(shuffled.device_indices(0)).tolist() != list(range(9))


def test_a_position_of_a_shuffled_run_is_refused_by_an_unshuffled_pipeline():
  mesh = mesh_of(2)
  ordered = DataPipeline(list(range(10)), collate, mesh, per_device_batch=2, shuffle=False)
  shuffled = DataPipeline(list(range(10)), collate, mesh, per_device_batch=2)
  assert ordered.step_at(ordered.position(3)) == 3
  with pytest.raises(ValueError, match=r"shuffle=True, this one has False"):
    ordered.step_at(shuffled.position(3))
  with pytest.raises(TypeError, match=r"shuffle must be True or False"):
    DataPipeline(list(range(10)), collate, mesh, per_device_batch=2, shuffle="no")
