"""Every script in examples/ runs as a user would run it, in a subprocess, with few steps.

Each runs on 4 simulated CPU devices (the multi-process one as 2 processes x
2 devices under ``python -m jaxdp.launch``, as its docstring says) and must
exit 0; for the scripts known here the printed result is checked too. A
new example is picked up by the glob and must at least run.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
LAUNCHED = {"multiprocess.py": ["-m", "jaxdp.runtime.launch", "--nproc", "2", "--devices-per-proc", "2", "--timeout", "120",
                                "--"]}
STEPS = {"nnx_cnn.py": 3, "linen_mlp.py": 2, "zero3_lm.py": 3, "multiprocess.py": 3}


def numbers(pattern: str, text: str) -> list[float]:
  return [float(x) for x in re.findall(pattern, text)]


def check_nnx_cnn(out: str) -> None:
  (first, last), (one_first, one_last) = (map(float, pair) for pair in re.findall(r"loss ([\d.]+) -> ([\d.]+)", out))
  assert last < first and one_last < one_first
  assert numbers(r"4 devices vs 1: ([\d.e+-]+)", out)[0] < 1e-5  # float32 round-off (5e-7 after 10 steps)


def check_linen_mlp(out: str) -> None:
  mean, rank_mean = numbers(r"difference to 1 device: ([\d.e+-]+)", out)
  # The exact weighted mean is one device's step up to round-off (6e-8 after 5 steps); DDP's mean of per-device
  # means weights the 2-example device like the 11-example one (3e-2 after 5 steps).
  assert mean < 1e-5 and rank_mean > 1e-3


def check_zero3_lm(out: str) -> None:
  first, last = numbers(r"loss ([\d.]+) nats/byte", out)
  assert last < first
  assert "each holds (4, 64, 64) of the stacked weight (4, 64, 256)" in out  # split over 4 devices at rest


def check_multiprocess(out: str) -> None:
  first, last = numbers(r"\[rank 0\] step \d+: loss ([\d.]+)", out)
  assert last < first and "2 process(es), 4 devices" in out
  assert numbers(r"gradient descent ([\d.e+-]+)", out)[0] < 1e-5  # float32 against float32 numpy: 4e-9 after 5 steps


CHECKS = {"nnx_cnn.py": check_nnx_cnn, "linen_mlp.py": check_linen_mlp, "zero3_lm.py": check_zero3_lm,
          "multiprocess.py": check_multiprocess}


def test_examples_exist():
  assert set(CHECKS) <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script):
  steps = ["--steps", str(STEPS[script.name])] if script.name in STEPS else []
  # Most XLA passes skipped, as the fast_compiles fixture does: these short runs are mostly compilation.
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
         "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
  result = subprocess.run([sys.executable, *LAUNCHED.get(script.name, []), str(script), *steps], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  assert result.stdout.strip()
  CHECKS.get(script.name, lambda out: None)(result.stdout)
