"""Worker: rank 1 fails mid-way while rank 0 blocks in a collective.

Usage: ``fail.py MODE MARKER`` (``MARKER`` only tags the processes for the
leftover check). MODE is what rank 1 does after a first successful
collective: ``exit3`` (``os._exit(3)``), ``raise`` (an uncaught exception:
with ``fail_fast`` the process ends at once with code 1), ``kill``
(``SIGKILL`` itself), ``stop`` (``SIGSTOP`` itself: no more heartbeats) or
``hang`` (sleeps while its heartbeats go on: only the launcher's
``--timeout`` ends that job).
"""

import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jax.experimental import multihost_utils  # noqa: E402

from jaxdp import distributed  # noqa: E402


def fail(mode):
  time.sleep(0.5)  # let rank 0 enter the collective first
  if mode == "exit3":
    os._exit(3)
  if mode == "raise":
    raise RuntimeError("rank 1 fails on purpose")
  if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
  if mode == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
  if mode in ("stop", "hang"):
    time.sleep(3600)
  raise SystemExit(f"unknown mode {mode!r}")


def main():
  mode = sys.argv[1]
  info = distributed.initialize()
  multihost_utils.sync_global_devices("started")
  print("first collective done", flush=True)
  if info.process_index == 1:
    fail(mode)
  print("rank 0 blocks in a collective", flush=True)
  multihost_utils.sync_global_devices("blocked")
  print("unreachable: rank 0 passed the collective", flush=True)


if __name__ == "__main__":
  main()
