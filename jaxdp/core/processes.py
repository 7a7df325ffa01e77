"""Agreement across processes: every process of a job checks that the others hold the same value.

Below the runtime (`jaxdp.runtime.distributed` re-exports it) because
placing a state (`jaxdp.init_state`) already needs it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import numpy as np


def _describe(value: Any) -> list[tuple[str, str]]:
  """`[(leaf path, description)]` of `value`: arrays as `dtype[shape]`, other leaves by `repr`."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(value)
  described = [("<structure>", str(treedef))]
  for path, leaf in leaves:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype") and not isinstance(leaf, np.generic):
      text = f"{leaf.dtype}[{','.join(map(str, leaf.shape))}]"
    else:
      text = repr(leaf)
    described.append((jax.tree_util.keystr(path) or "<root>", text))
  return described


def allgather_bytes(payload: bytes) -> list[bytes]:
  """Every process's `payload`, in process order (one collective per length agreement and data)."""
  from jax.experimental import multihost_utils

  lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(payload)], np.int64), tiled=False))
  size = int(lengths.max())
  padded = np.zeros((size,), np.uint8)
  padded[: len(payload)] = np.frombuffer(payload, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(padded, tiled=False))
  return [rows[p, : int(lengths[p, 0])].tobytes() for p in range(rows.shape[0])]


def _label(name: str, path: str) -> str:
  if path == "<structure>":
    return f"{name} (pytree structure)"
  return name if path == "<root>" else f"{name}{path}"


def _differences(name: str, descriptions: list[list[tuple[str, str]]], limit: int = 5) -> str:
  """One line per leaf whose description differs, with every process's version."""
  per_process = [dict(d) for d in descriptions]
  paths = list(dict.fromkeys(p for d in descriptions for p, _ in d))
  lines = []
  for path in paths:
    texts = [d.get(path, "<missing>") for d in per_process]
    if len(set(texts)) > 1:
      shown = ", ".join(f"process {i}: {_shorten(t)}" for i, t in enumerate(texts))
      lines.append(f"{_label(name, path)}: {shown}")
  more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
  return "\n  ".join(lines[:limit]) + more


def _shorten(text: str, width: int = 120) -> str:
  return text if len(text) <= width else text[: width - 3] + "..."


def assert_same_across_processes(value: Any, name: str = "value") -> None:
  """Raises a `ValueError` on every process unless `value` agrees across processes.

  A collective of every process: call it at the same point of the program on
  each, with the value each believes is shared (a configuration, the
  structure of a batch). Array leaves (numpy or JAX; for a global
  `jax.Array` its global shape) are compared by dtype and shape, not
  contents, so per-process batches can be checked for shape agreement; every
  other leaf (numbers, numpy scalars, strings, `None`) is compared by its
  `repr`, and the pytree structure is compared too. Only a 32-byte digest
  travels unless something differs (one small all-gather, a few
  milliseconds). With one process it returns at once.

  Args:
    value: any pytree.
    name: what `value` is, for the message (e.g. `"config"`, `"batch"`).

  Raises:
    ValueError: on every process, naming `name`, the leaves that differ and
      each process's version of them.
  """
  if not isinstance(name, str):
    raise TypeError(f"name must be a string describing value, got {type(name).__name__}.")
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  described = _describe(value)
  payload = json.dumps(described).encode()
  digest = np.frombuffer(hashlib.sha256(payload).digest(), np.uint8)
  digests = np.asarray(multihost_utils.process_allgather(digest, tiled=False))
  if np.all(digests == digests[:1]):
    return
  descriptions = [[tuple(item) for item in json.loads(b)] for b in allgather_bytes(payload)]
  raise ValueError(
      f"processes disagree on {name} (this is process {jax.process_index()} of {jax.process_count()}); "
      f"every process must pass the same {name}:\n  {_differences(name, descriptions)}"
  )
