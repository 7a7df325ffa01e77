"""Worker without JAX, for testing the launcher itself (starts in milliseconds).

Usage: ``plain.py MODE MARKER`` (``MARKER`` only tags the processes for the
leftover check). Modes:

* ``env``: print the ``JAXDP_*`` environment as JSON, a line to stderr, a last line without newline;
* ``stream``: print ``first``, wait 1.5 s, print ``second``;
* ``fail``: rank 1 exits with code 3; the others sleep, rank 0 ignoring
  SIGTERM and rank 2 (if any) with a sleeping child of its own;
* ``sleep``: print ``ready`` and sleep.
"""

import json
import os
import signal
import subprocess
import sys
import time

SLEEP = 120  # seconds; every test stops its workers well before


def main():
  mode, marker = sys.argv[1], sys.argv[2]
  rank = int(os.environ["JAXDP_PROCESS_ID"])
  if mode == "env":
    print(json.dumps({k: v for k, v in os.environ.items() if k.startswith("JAXDP_") or k == "PYTHONUNBUFFERED"}))
    print(f"to stderr from {rank}", file=sys.stderr)
    sys.stdout.write("no newline")
    return
  if mode == "stream":
    print("first", flush=True)
    time.sleep(1.5)
    print("second", flush=True)
    return
  if mode == "fail" and rank == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  if mode == "fail" and rank == 2:
    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({SLEEP})", marker])
  print("ready", flush=True)
  if mode == "fail" and rank == 1:
    time.sleep(0.5)
    sys.exit(3)
  time.sleep(SLEEP)


if __name__ == "__main__":
  main()
