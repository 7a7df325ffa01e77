"""Worker: asynchronous saves that fail; each failure must raise, and the process must then exit promptly.

Usage: ``failed_save.py DIR``. Runs these scenarios, each in its own
checkpoint directory under ``DIR``, and writes one line per scenario to
``DIR/report.txt`` (the output interleaves orbax's logs from its threads):

* ``file``: the checkpoint directory is replaced by a file before a save
  (orbax's own default, creating directories in a background thread, left
  threads waiting 300 s on a signal that the failed creation never sent);
* ``close``: the directory is replaced by a file while a save is in flight
  (at its commit); ``close()`` raises;
* ``wait``: the commit fails (``PermissionError``); ``wait()`` raises once,
  then the next save works;
* ``save``: the commit fails; the next ``save()`` raises, a retry works;
* ``exit``: the directory is replaced while a save is in flight and the
  manager is never closed: the process ends while the save fails.

Failures are injected through ``os.rename``, which orbax calls in its
background thread to commit each temporary directory, so they happen at a
known point whatever the timing.
"""

import os
import shutil
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp import checkpoint  # noqa: E402

OPTIMIZER = optax.adam(0.1)


class CommitHook:
  """``os.rename`` that first runs a one-shot ``action`` when orbax commits a temporary directory."""

  def __init__(self):
    self.action = None
    self._rename = os.rename
    os.rename = self

  def __call__(self, src, dst, *args, **kwargs):
    action = self.action
    if action is not None and "orbax-checkpoint-tmp" in os.path.basename(os.fspath(src)):
      self.action = None
      action()
    return self._rename(src, dst, *args, **kwargs)


def replace_by_file(directory: str):
  def action():
    shutil.rmtree(directory)
    with open(directory, "w") as f:
      f.write("not a directory")

  return action


def permission_denied():
  raise PermissionError("injected: the commit of this step is refused")


def report(base: str, line: str) -> None:
  with open(os.path.join(base, "report.txt"), "a") as f:
    f.write(line + "\n")
  print(line, flush=True)


def outcome(call) -> str:
  """``"ok"`` or ``"<exception type> [noted]"``: whether jaxdp added its note to the error."""
  try:
    call()
  except Exception as e:  # the scenario reports what was raised
    noted = any("jaxdp.CheckpointManager" in n for n in getattr(e, "__notes__", []))
    return f"{type(e).__name__}{' noted' if noted else ''}"
  return "ok"


def main():
  base = sys.argv[1]
  os.makedirs(base)
  state = jaxdp.init_state({"w": np.ones((4, 3), np.float32)}, OPTIMIZER, jaxdp.data_mesh(jax.devices()[:1]))
  hook = CommitHook()
  manager = lambda name: checkpoint.CheckpointManager(os.path.join(base, name))  # noqa: E731

  ckpt = manager("file")
  replace_by_file(ckpt.directory)()
  report(base, f"file: save {outcome(lambda: ckpt.save(1, state))}, close {outcome(ckpt.close)}")

  ckpt = manager("close")
  hook.action = replace_by_file(ckpt.directory)
  report(base, f"close: save {outcome(lambda: ckpt.save(1, state))}, close {outcome(ckpt.close)}")

  ckpt = manager("wait")
  hook.action = permission_denied
  ckpt.save(1, state)
  first, second = outcome(ckpt.wait), outcome(ckpt.wait)
  saved = ckpt.save(2, state)
  closed = outcome(ckpt.close)
  report(base, f"wait: wait {first}, wait again {second}, then save {saved}, close {closed}, steps {ckpt.all_steps()}")

  ckpt = manager("save")
  hook.action = permission_denied
  ckpt.save(1, state)
  first, second = outcome(lambda: ckpt.save(2, state)), outcome(lambda: ckpt.save(2, state))
  closed = outcome(ckpt.close)
  report(base, f"save: next save {first}, retry {second}, close {closed}, steps {ckpt.all_steps()}")

  ckpt = manager("exit")
  hook.action = replace_by_file(ckpt.directory)
  saved = outcome(lambda: ckpt.save(1, state))
  deadline = time.monotonic() + 20
  while not os.path.isfile(ckpt.directory) and time.monotonic() < deadline:  # the save is failing
    time.sleep(0.01)
  report(base, f"exit: save {saved}, failing {os.path.isfile(ckpt.directory)}, exiting without close")


if __name__ == "__main__":
  main()
