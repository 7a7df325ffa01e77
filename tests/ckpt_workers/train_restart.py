"""Worker: ``train_resume.py``'s training, crashing on the launcher's first attempt only.

Usage: ``train_restart.py OUT CKPT --steps T [--zero-stage S] [--every K] [--kill-at K]``,
under ``python -m jaxdp.launch --max-restarts N``.

The model, data, keys and checkpoints are ``train_resume``'s. On attempt 0
(``JAXDP_RESTART_COUNT``) the last rank SIGKILLs itself right after step
``--kill-at``; on later attempts nobody does, so the restarted job resumes
from the latest intact checkpoint in ``CKPT`` and finishes by itself.
Attempt ``N`` writes ``train_resume``'s files (``losses.jsonl``, and on rank
0 ``restored.npz`` and ``final.npz``) to ``OUT/attemptN``.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxdp  # noqa: E402
from jaxdp import distributed  # noqa: E402

import train_resume  # noqa: E402  (this directory is the script's: on sys.path)


def main():
  args = train_resume.parse_args()
  restart = int(os.environ.get("JAXDP_RESTART_COUNT", "0"))
  out = os.path.join(args.out, f"attempt{restart}")
  os.makedirs(out, exist_ok=True)
  distributed.initialize()
  print(f"attempt {restart}", flush=True)
  train_resume.train(jaxdp.data_mesh(), out, args.ckpt, steps=args.steps, zero_stage=args.zero_stage,
                     every=args.every, kill_at=args.kill_at if restart == 0 else None)
  print("done", flush=True)


if __name__ == "__main__":
  sys.exit(main())
