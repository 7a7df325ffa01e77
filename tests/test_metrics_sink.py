"""The experiments' metrics writer: metrics.jsonl, and the same numbers as TensorBoard scalars (tensorboardX)."""

import json
import struct

from experiments import common


def read_scalars(folder):
  """``{(tag, step): value}`` from the TensorBoard event files under ``folder`` (TFRecord framing, by hand)."""
  from tensorboardX.proto import event_pb2

  scalars = {}
  for path in folder.glob("events.out.tfevents.*"):
    data, offset = path.read_bytes(), 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        scalars[(value.tag, event.step)] = value.simple_value
  return scalars


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
  records = [{"step": s, "loss": 2.0 - s / 4, "tokens": 128.0, "skipped": 0, "device_tokens": [64.0, 64.0]}
             for s in range(3)]
  with common.MetricsSink(tmp_path, tensorboard=True) as sink:
    for record in records:
      sink.write(json.dumps(record) + "\n")
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == records
  scalars = read_scalars(tmp_path / "tensorboard")
  expected = {(name, r["step"]): float(r[name]) for r in records for name in ("loss", "tokens", "skipped")}
  assert scalars == expected  # every number of a record, at its step; lists (device_tokens) are not scalars


def test_without_tensorboard_only_jsonl_is_written(tmp_path):
  with common.MetricsSink(tmp_path, append=False) as sink:
    sink.write(json.dumps({"step": 0, "loss": 1.0}) + "\n")
  assert not (tmp_path / "tensorboard").exists()
  with common.MetricsSink(tmp_path, append=True) as sink:
    sink.write(json.dumps({"step": 1, "loss": 0.5}) + "\n")
  assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
