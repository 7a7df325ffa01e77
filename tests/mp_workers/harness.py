"""Running ``python -m jaxdp.launch`` from the tests, and finding processes left behind."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent


class Result(NamedTuple):
  returncode: int
  stdout: str
  stderr: str
  seconds: float


def env(**extra: str) -> dict:
  """The environment of a launched job: CPU only, the repository importable."""
  out = dict(os.environ)
  out.pop("JAX_NUM_CPU_DEVICES", None)
  out.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **extra})
  return out


def launch(options: Sequence[str], command: Sequence[str], *, timeout: float = 120, **extra_env: str) -> Result:
  """Runs ``python -m jaxdp.launch OPTIONS -- COMMAND`` to the end (killed after ``timeout``)."""
  args = [sys.executable, "-m", "jaxdp.runtime.launch", *options, "--", *map(str, command)]
  return run(args, timeout=timeout, **extra_env)


def run(args: Sequence[str], *, timeout: float = 120, **extra_env: str) -> Result:
  start = time.monotonic()
  proc = subprocess.Popen(args, cwd=ROOT, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, 9)
    out, err = proc.communicate()
    raise AssertionError(f"{args} did not finish in {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
  return Result(proc.returncode, out, err, time.monotonic() - start)


def in_background(fn: Callable, *args, **kwargs) -> Callable:
  """Starts ``fn(*args, **kwargs)`` (a job: ``run``, ``launch``) in a thread; returns ``wait()``, which gives its result.

  The test computes something else in this process meanwhile (a single-device reference); ``wait()``
  returns or raises what ``fn`` did, with ``fn``'s own timeout.
  """
  outcome: dict = {}

  def target():
    try:
      outcome["result"] = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001  (raised again by wait())
      outcome["error"] = e

  thread = threading.Thread(target=target, daemon=True)
  thread.start()

  def wait():
    thread.join()
    if "error" in outcome:
      raise outcome["error"]
    return outcome["result"]

  return wait


def processes_with(marker: str) -> list[str]:
  """Command lines of the live processes whose command line contains ``marker``."""
  found = []
  for entry in Path("/proc").iterdir():
    if not entry.name.isdigit() or int(entry.name) == os.getpid():
      continue
    try:
      cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
      state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
      continue
    if marker in cmdline and state != "Z":
      found.append(f"{entry.name}: {cmdline}")
  return found


def assert_no_leftovers(marker: str, wait: float = 5.0) -> None:
  """Asserts that no process tagged with ``marker`` survives (after up to ``wait`` seconds)."""
  deadline = time.monotonic() + wait
  while (left := processes_with(marker)) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not left, f"processes left behind: {left}"
