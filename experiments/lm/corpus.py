"""Byte-level text corpus: documents, a held-out split, next-byte chunks and their collate.

A document is the bytes of one file (or one paragraph of a single text file).
Each document of ``n`` bytes is cut into chunks of at most ``seq_len + 1``
bytes that overlap by one byte, so every byte after the first is a target
exactly once; the last chunk of a document is shorter. The chunks are the
examples of the dataset; ``collate`` pads them to ``seq_len`` and returns the
token mask as the weights.
"""

from __future__ import annotations

import pathlib
import sysconfig
import zlib
from typing import Sequence

import numpy as np


def stdlib_files() -> list[pathlib.Path]:
  """The ``*.py`` files of this Python's standard library, in a fixed pseudo-random order.

  Sorted by a CRC32 of the relative path, so that a byte budget takes a
  spread of the library rather than its first package, and the same files on
  every machine with the same Python.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
  return sorted(files, key=lambda p: (zlib.crc32(p.relative_to(root).as_posix().encode()), p.as_posix()))


def _is_text(data: bytes) -> bool:
  return b"\0" not in data[:4096]


def _budget(sources, max_bytes: int | None) -> list[bytes]:
  docs, total = [], 0
  for data in sources:
    if len(data) < 2:  # nothing to predict
      continue
    docs.append(data)
    total += len(data)
    if max_bytes is not None and total >= max_bytes:
      break
  return docs


def read_documents(path: str | None = None, max_bytes: int | None = 1_000_000) -> list[bytes]:
  """Reads documents until ``max_bytes`` (``None``: no limit).

  Args:
    path: ``None`` for the standard library's sources; a directory for every
      text file under it (sorted by path, binary files skipped); a file for
      its paragraphs (separated by blank lines).
    max_bytes: stop after the document that reaches this many bytes.
  """
  if path is None:
    files = stdlib_files()
  else:
    p = pathlib.Path(path)
    if p.is_file():
      paragraphs = p.read_bytes().replace(b"\r\n", b"\n").split(b"\n\n")
      return _budget((q.strip(b"\n") + b"\n" for q in paragraphs), max_bytes)
    if not p.is_dir():
      raise FileNotFoundError(f"--corpus {path!r} is neither a file nor a directory")
    files = sorted(f for f in p.rglob("*") if f.is_file())
  docs = _budget((d for d in map(pathlib.Path.read_bytes, files) if _is_text(d)), max_bytes)
  if not docs:
    raise ValueError(f"no text documents (of at least 2 bytes) found in {path or 'the standard library'}")
  return docs


def split_documents(docs: Sequence[bytes], val_every: int) -> tuple[list[bytes], list[bytes]]:
  """Every ``val_every``-th document (the last of each group) is held out; 0 holds out none."""
  if val_every <= 0 or len(docs) < val_every:
    return list(docs), []
  held = [i % val_every == val_every - 1 for i in range(len(docs))]
  return [d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h]


def chunk_documents(docs: Sequence[bytes], seq_len: int) -> list[np.ndarray]:
  """Overlapping chunks of at most ``seq_len + 1`` bytes (uint8): inputs ``c[:-1]``, targets ``c[1:]``."""
  chunks = []
  for doc in docs:
    data = np.frombuffer(doc, np.uint8)
    chunks.extend(data[s : s + seq_len + 1] for s in range(0, len(data) - 1, seq_len))
  return chunks


def make_collate(seq_len: int):
  """``collate(chunks) -> ({"inputs", "targets"} int32 [k, seq_len], mask float32 [k, seq_len])``."""

  def collate(chunks: list[np.ndarray]):
    inputs_KxT = np.zeros((len(chunks), seq_len), np.int32)
    targets_KxT = np.zeros((len(chunks), seq_len), np.int32)
    mask_KxT = np.zeros((len(chunks), seq_len), np.float32)
    for i, c in enumerate(chunks):
      n = len(c) - 1
      inputs_KxT[i, :n], targets_KxT[i, :n], mask_KxT[i, :n] = c[:-1], c[1:], 1.0
    return {"inputs": inputs_KxT, "targets": targets_KxT}, mask_KxT

  return collate
