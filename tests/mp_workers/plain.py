"""Worker without JAX, for testing the launcher itself (starts in milliseconds).

Usage: ``plain.py MODE MARKER``: ``MARKER`` tags the processes for the
leftover check (and is a directory in mode ``fail``). Modes:

* ``env``: print the ``JAXDP_*`` environment as JSON, a line to stderr, a last line without newline;
* ``stream``: print ``first``, wait 1.5 s, print ``second``;
* ``fail``: rank 1 exits with code 3 once every rank is ready; the others
  sleep, rank 0 ignoring SIGTERM and rank 2 (if any) with descendants of its
  own: a sleeping child in its process group, and the two of ``orphans``;
* ``sleep``: print ``ready`` and sleep;
* ``orphans``: start two descendants that escape the worker's process
  group: a child in a new session, and a daemon (double fork: its parent
  exits at once, so it is re-parented); print ``ready`` and their pids as
  JSON, then exit 0 while they sleep on;
* ``orphans-sleep``: the same, but then sleep;
* ``lost-peer``: rank 0 prints what gloo prints when a peer is gone and
  exits with code 1 at once; rank 1 exits with code 3 half a second later
  (as if rank 0 had been reaped first on a loaded machine);
* ``flaky``: print the ``JAXDP_*`` environment as JSON; the last rank exits
  with code 3 on attempts 0 and 1 (``JAXDP_RESTART_COUNT``), every other
  run exits 0.
"""

import json
import os
import signal
import subprocess
import sys
import time

SLEEP = 120  # seconds; every test stops its workers well before
DAEMON = f"import os, time\nif os.fork():\n  os._exit(0)\nprint(os.getpid(), flush=True)\ntime.sleep({SLEEP})"


def start_orphans(marker: str) -> dict:
  """Starts a child in a new session and a double-forked daemon, both tagged; returns their pids once they run."""
  child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({SLEEP})", marker], start_new_session=True)
  starter = subprocess.Popen([sys.executable, "-c", DAEMON, marker], start_new_session=True, stdout=subprocess.PIPE)
  daemon = int(starter.stdout.readline())  # the daemon runs, and its parent has exited (or is about to)
  starter.wait()
  return {"worker": os.getpid(), "child": child.pid, "daemon": daemon}


def fail(marker: str, rank: int) -> None:
  """Mode ``fail``: rank 1 exits with 3 once every rank has left a file in ``marker`` (or after 30 s)."""
  if rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  if rank == 2:
    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({SLEEP})", marker])
    start_orphans(marker)
  print("ready", flush=True)
  open(os.path.join(marker, f"ready-{rank}"), "w").close()
  if rank != 1:
    return
  count, deadline = int(os.environ["JAXDP_NUM_PROCESSES"]), time.monotonic() + 30
  while len([f for f in os.listdir(marker) if f.startswith("ready-")]) < count and time.monotonic() < deadline:
    time.sleep(0.05)
  time.sleep(0.5)  # the others are asleep by now
  sys.exit(3)


def jaxdp_env() -> str:
  return json.dumps({k: v for k, v in os.environ.items() if k.startswith("JAXDP_") or k == "PYTHONUNBUFFERED"})


def main():
  mode, marker = sys.argv[1], sys.argv[2]
  rank = int(os.environ["JAXDP_PROCESS_ID"])
  if mode == "env":
    print(jaxdp_env())
    print(f"to stderr from {rank}", file=sys.stderr)
    sys.stdout.write("no newline")
    return
  if mode == "flaky":
    print(jaxdp_env(), flush=True)
    last = rank == int(os.environ["JAXDP_NUM_PROCESSES"]) - 1
    sys.exit(3 if last and int(os.environ["JAXDP_RESTART_COUNT"]) < 2 else 0)
  if mode == "lost-peer":
    if rank == 0:
      print("ValueError: UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [127.0.0.1]:1",
            file=sys.stderr, flush=True)
      sys.exit(1)
    time.sleep(0.5)
    sys.exit(3)
  if mode == "stream":
    print("first", flush=True)
    time.sleep(1.5)
    print("second", flush=True)
    return
  if mode in ("orphans", "orphans-sleep"):
    print("ready", json.dumps(start_orphans(marker)), flush=True)
    if mode == "orphans":
      return
  elif mode == "fail":
    fail(marker, rank)
  else:
    print("ready", flush=True)
  time.sleep(SLEEP)


if __name__ == "__main__":
  main()
