"""The host side of a step call, shared by the train, eval and DiLoCo steps: one input layer.

Every call of `jaxdp.runtime.compiled.CompiledStep`, `jaxdp.runtime.evaluation.EvalStep` and
`jaxdp.runtime.diloco.DiLoCoStep` runs its inputs through the functions of this module in one place, each
step's `_prepare`, in this order, each function one concern:

- `known_state`: whether the state is the one the step returned (or placed) last, by the identity of
  its leaves, none deleted, and no donation of undeleted arrays anywhere since (`mark_donated` counts
  them). Such a state skips the checks of its structure, donation and placement: it was checked when it
  went in, and the step's own program made it.
- `check_state_donation`: any other state is refused if an earlier step consumed it (by name and fix).
- `input_signature`: a cheap key of the other inputs (structure, shapes, dtypes, shardings); with the
  state's layout key it picks the `InputPlan` checked once per signature (`plan_inputs`).
- `agree_across_processes`: with several processes, on every call, one 32-byte all-gather (a
  per-process cache could let one process skip it and leave the others waiting).
- `check_input_values`: only what the values decide (host weights below float32's smallest normal,
  64-bit host ids out of 32-bit range), and only for the inputs the plan says are on the host.
- `place_inputs`: the batch split over the data axes unless it is already, the key replicated.
- `unshare_inputs`: a copy of an input that holds one of the donated state's buffers (only inputs of a
  state leaf's shape and dtype are compared).

What needs the values on the device is never read here (that would wait for the device): the guards
(`Guard`: the count of non-finite steps in a row, their padding rows, the count of subnormal device
weights) are carried from one call's program to the next on the devices (`update_guard`, traced into
the step's own program), and a later call reads them (`read_scalar`, `read_total`).
"""

from __future__ import annotations

import collections
import itertools
import operator
import types
import weakref
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jaxdp.core import checks as _checks

# How many times a step has donated arrays that XLA did not delete (on CPU a live numpy view keeps a buffer):
# a known state is known only while this stays. A deleted array is seen by known_state itself.
_donations = 0


def mark_donated(leaves: list) -> None:
  """Records that a step consumed `leaves`, the arrays of a placed state (see
  `jaxdp.core.checks.mark_donated`)."""
  global _donations
  if not leaves or _deleted(leaves, all):  # the usual case: XLA deleted every donated buffer
    return
  alive = list(itertools.filterfalse(_is_deleted, leaves))
  if alive:  # most are deleted by the donation; a live numpy view keeps some (CPU)
    _donations += 1
    _checks.mark_donated(alive)


_is_deleted = operator.methodcaller("is_deleted")  # a placed state's leaves are all jax.Arrays


def _deleted(leaves: list, reduce: Callable = any) -> bool:
  """`reduce` (`any` or `all`) of whether each of `leaves` (jax.Arrays, at least one) is deleted: by the
  array class's own method when they all share it (a third of the cost of looking it up on each)."""
  method = getattr(type(leaves[0]), "is_deleted", None)
  if not isinstance(method, types.FunctionType):  # jax's own (compiled) method: it refuses any other class
    try:
      return reduce(map(method, leaves))
    except TypeError:  # leaves of another array class
      pass
  return reduce(map(_is_deleted, leaves))


class KnownState:
  """A state whose leaves a step placed and checked: its own output, or an input it placed as it was.

  `strong`: hold the leaves themselves (a step's own output, which the next call donates) instead of weak
  references to them (an input the user may drop).
  """

  __slots__ = ("leaves", "strong", "treedef", "donations", "key")

  def __init__(self, leaves: list, treedef: Any, key: Any, strong: bool = False):
    self.leaves, self.strong = (leaves if strong else list(map(weakref.ref, leaves))), strong
    self.treedef, self.key, self.donations = treedef, key, _donations


def known_state(known: KnownState | None, leaves: list, treedef: Any) -> Any:
  """`known.key` if `leaves` are exactly `known`'s (same objects, same tree), none is deleted, and no step
  donated an array it could not delete since; else `None`."""
  if known is None or known.donations != _donations or len(leaves) != len(known.leaves) or treedef != known.treedef:
    return None
  held = known.leaves if known.strong else [ref() for ref in known.leaves]
  # Deleted (consumed by a step since): JAX's dispatch does not always refuse a deleted donated array (it can
  # crash the process), so the state goes the full way, which names the leaf.
  if all(map(operator.is_, leaves, held)) and not (leaves and _deleted(leaves)):
    return known.key
  return None


def check_state_donation(state: Any, leaves: list, name: str = "state") -> None:
  """Refuses a state an earlier step consumed, naming the leaf and the fix (before anything runs)."""
  _checks.check_not_donated(state, leaves, name)


def _leaf_key(x: Any) -> tuple:
  if isinstance(x, jax.Array):
    return (x.shape, x.dtype, x.sharding)
  return (type(x), np.shape(x), getattr(x, "dtype", None))


def input_signature(*trees: Any) -> tuple[list, tuple]:
  """`(leaves, key)`: the leaves of `trees` and a hashable key of their structure, shapes, dtypes and
  shardings (host leaves by type, shape and dtype)."""
  leaves, treedef = jax.tree.flatten(trees)
  return leaves, (treedef, tuple(map(_leaf_key, leaves)))


class InputPlan(NamedTuple):
  """What a call with inputs of one signature has to do, decided once (`plan_inputs`)."""

  place_batch: bool  # a batch, weights or has_more leaf not yet split over the data axes as the step needs
  check_ids: bool  # a host 64-bit integer batch leaf: its values are checked against 32-bit range each call
  floating_weights: bool  # floating weights: the program counts those below float32's smallest normal
  host_weights: bool  # floating weights on the host: their values are checked each call
  device_weights: bool  # floating weights given as a JAX array: the program's count is read later
  may_alias: bool  # an input array of one of the state's (shape, dtype): compared by buffer each call


def plan_inputs(batch: Any, weights: Any, has_more: Any, split: jax.sharding.Sharding,
                state_kinds: frozenset = frozenset()) -> InputPlan:
  """The `InputPlan` of these inputs; `state_kinds`: the donated state's `(shape, dtype)` pairs."""
  inputs = jax.tree.leaves((batch, weights, has_more))
  floating = weights is not None and jax.dtypes.issubdtype(np.asarray(weights).dtype if not hasattr(
      weights, "dtype") else weights.dtype, np.floating)
  wide = jax.dtypes.canonicalize_dtype(np.int64) != np.int64
  return InputPlan(
      place_batch=not all(isinstance(x, jax.Array) and x.sharding == split for x in inputs),
      check_ids=wide and any(not isinstance(x, jax.Array) and np.asarray(x).dtype in (np.int64, np.uint64)
                             for x in jax.tree.leaves(batch)),
      floating_weights=floating,
      host_weights=floating and not isinstance(weights, jax.Array),
      device_weights=floating and isinstance(weights, jax.Array),
      may_alias=any(isinstance(x, jax.Array) and (x.shape, x.dtype) in state_kinds for x in inputs),
  )


def check_input_values(plan: InputPlan, batch: Any, weights: Any) -> None:
  """The checks of values, on the host inputs only: 64-bit ids out of 32-bit range, subnormal host weights."""
  if plan.check_ids:
    _checks.check_batch_values(batch, "batch", dtypes=False)
  if plan.host_weights:
    _checks.check_weight_values(weights)


def agree_across_processes(inputs: dict, name: str) -> None:
  """With several processes, every call on every process: inputs that differ raise everywhere instead of
  leaving the other processes blocked in the step's collectives. Returns at once with one process."""
  if jax.process_count() > 1:
    from jaxdp.runtime.distributed import assert_same_across_processes

    assert_same_across_processes(inputs, name)


def place_inputs(plan: InputPlan, inputs: Any, split: jax.sharding.Sharding) -> Any:
  """`inputs` (batch, weights, has_more) split over the data axes, unless the plan says they are already."""
  return jax.device_put(inputs, split) if plan.place_batch else inputs


class PlacedKey:
  """The last PRNG key placed (replicated on the mesh), by identity: a JAX array never changes."""

  __slots__ = ("ref", "placed")

  def __init__(self):
    self.ref, self.placed = None, None

  def __call__(self, rng: Any, place: Callable[[Any], Any]) -> Any:
    if rng is None:
      return None
    if self.ref is not None and self.ref() is rng:
      return self.placed
    placed = place(rng)
    if isinstance(rng, jax.Array):
      self.ref, self.placed = weakref.ref(rng), placed
    return placed


def state_kinds(state: Any) -> frozenset:
  """The `(shape, dtype)` pairs of the state's arrays: an input of one of them may share a donated buffer."""
  return frozenset((x.shape, x.dtype) for x in jax.tree.leaves(state) if isinstance(x, jax.Array))


def unshare_inputs(plan: InputPlan, inputs: Any, kinds: frozenset, donated: Callable[[], list]) -> Any:
  """`inputs` with a copy of any array that holds one of the donated state's buffers.

  Such an input (`weights=state.params[...]`, or an array built on its shards) would reach the step twice,
  once donated, and XLA crashes the process on that. Only inputs of a state leaf's (shape, dtype) are compared,
  and only when the plan found some.
  """
  if not plan.may_alias:
    return inputs

  def own(x):
    if not isinstance(x, jax.Array) or (x.shape, x.dtype) not in kinds:
      return x
    same_kind = [y for y in donated() if isinstance(y, jax.Array) and (y.shape, y.dtype) == (x.shape, x.dtype)]
    if any(x is y for y in same_kind) or _checks.buffer_key(x) in {_checks.buffer_key(y) for y in same_kind}:
      return x.copy()
    return x

  return jax.tree.map(own, inputs)


def raise_if_consumed(error: RuntimeError, state: Any, name: str = "state") -> None:
  """After JAX refused a deleted input array (before running or donating anything): jaxdp's message if it is
  one of the state's leaves; the caller re-raises `error` otherwise."""
  if "deleted" in str(error):
    check_state_donation(state, jax.tree.leaves(state), name)


# Guards ------------------------------------------------------------------------------------------------------
# What a check of values on the devices needs is carried from program to program on the devices, as one more
# input and output of the step's own program: the host reads a small value once ready, never every step's.


class Guard(NamedTuple):
  """The guards' state, carried on the devices from one call's program to the next (`None`: not carried).

  Attributes:
    skips: int32 `[]`, replicated: the non-finite steps in a row, counting stopped at the limit (tripped).
    padded: int32 `[N]`, one per device of the data axes: whether one of those steps had a padding row
      (weight 0) on that device.
    subnormal: int32 `[N]`: per device, how many weights below float32's smallest normal it was given since
      the count was last read (no collective: each device counts its own).
  """

  skips: Any = None
  padded: Any = None
  subnormal: Any = None


def fresh_guard(guard: Guard | None, *, skips: bool, weights: bool, place_scalar: Callable, place_split: Callable,
                n: int) -> Guard:
  """`guard` with the parts a call carries: `skips` and `padded` with the non-finite guard on,
  `subnormal` with floating weights; a missing part starts at zero, a part this call does not carry is
  `None` (kept by the caller for a later call)."""
  guard = Guard() if guard is None else guard
  if (guard.skips is not None) == skips and (guard.padded is not None) == skips and (
      guard.subnormal is not None) == weights:
    return guard  # the usual call: the parts the last call left, exactly

  def part(value, wanted, zeros):
    return (zeros() if value is None else value) if wanted else None

  return Guard(part(guard.skips, skips, lambda: place_scalar(np.zeros((), np.int32))),
               part(guard.padded, skips, lambda: place_split(np.zeros((n,), np.int32))),
               part(guard.subnormal, weights, lambda: place_split(np.zeros((n,), np.int32))))


def merge_guard(new: Guard, old: Guard) -> Guard:
  """`new`, with `old`'s part wherever `new` does not carry one (kept for a later call)."""
  if (new.skips is not None or old.skips is None) and (new.padded is not None or old.padded is None) and (
      new.subnormal is not None or old.subnormal is None):
    return new  # the usual call: every part ``old`` had, carried
  return Guard(*(part if part is not None else kept for part, kept in zip(new, old)))


def update_guard(guard: Guard, flag: jax.Array, weights: Any, limit: int | None, per_device: Callable) -> Guard:
  """The guard after one step (traced in the step's program). `flag`: the step's `metrics["nonfinite"]`;
  `per_device(weights)`: per device, whether it has a row of weight 0 and how many subnormal weights."""
  zero_rows, below = per_device(weights) if weights is not None else (0, None)
  skips, padded, subnormal = guard
  if skips is not None:
    tripped, bad = skips >= limit, flag > 0
    skips, padded = (jax.numpy.where(tripped, skips, jax.numpy.where(bad, skips + 1, 0)),
                     jax.numpy.where(tripped, padded, jax.numpy.where(bad, padded | zero_rows, 0)))
  if subnormal is not None:
    subnormal = subnormal + below
  return Guard(skips, padded, subnormal)


MAX_UNREAD_FLAGS = 2  # the non-finite count of an earlier call is read at the latest two calls later


class SkipWatch:
  """The host side of the non-finite guard (`max_consecutive_skips`), shared by the train and DiLoCo steps.

  Each call's program leaves its count of non-finite steps in a row (`Guard.skips`, stopped at the
  limit) on the devices; `push` queues it and `check`, at the start of a later call, reads the
  newest count that is ready (waiting only for one `MAX_UNREAD_FLAGS` calls old: the device then still
  has the previous step to run while this one is prepared and dispatched) and raises `FloatingPointError`
  once it reaches the limit. With several processes, only by count: whether a count is ready depends on each
  process's timing, and every process must trip at the same call (else one leaves the job while another waits
  in the next collective). Once tripped it stays tripped (nothing runs, so no good step can clear it) until
  `reset`.

  Attributes:
    limit: `max_consecutive_skips` (an int >= 1), or `None`: never raises.
    read: how a count on the devices is read (`read_scalar` of a replicated count, the default;
      `read_max` of one count per DiLoCo group).
    count: the non-finite steps in a row, up to the step whose count the last `check` chose (read now
      if that check did not need its value).
    pending: each call's count on the devices, not read yet (oldest first).
  """

  def __init__(self, limit: int | None, where: str = "replica",
               consequence: str = "every replica skipped them, so the replicas are still consistent and the state "
                                  "passed in is the last good one.", read: Callable[[Any], int] | None = None):
    self.limit, self.where, self.consequence = limit, where, consequence
    self.read = read_scalar if read is None else read  # a count on the devices -> its value on the host
    self._count = 0  # as of the last count read
    self._unread = None  # the count a call chose but did not read: it could not have reached the limit
    self._bound = 0  # at least the chosen count: the count grows by at most one a call
    self.padded = False  # whether one of those steps had padding rows (all-zero weight)
    self.pending: collections.deque = collections.deque()
    self.pending_padded: dict = {}  # id(count) -> that call's per-device padding-row flags, read if tripped

  @property
  def count(self) -> int:
    if self._unread is not None:
      self._count = self._bound = self.read(self._unread)
      self._unread = None
    return self._count

  def reset(self) -> None:
    self._count, self._unread, self._bound, self.padded = 0, None, 0, False
    self.pending.clear()
    self.pending_padded.clear()

  def push(self, skips: Any, padded: Any = None) -> None:
    """Queues one call's count (`None`: the guard is off) and its per-device padding flags."""
    if skips is not None:
      self.pending.append(skips)  # the guard's own count: the user may delete or donate metrics
      self.pending_padded[id(skips)] = padded

  def check(self) -> None:
    if self.limit is None:
      return
    # The count grows by at most one a call: a count that cannot have reached the limit (the last one read plus
    # the calls since) is chosen but not read (a read is a transfer, and waits for the device).
    pending, ready, limit = self.pending, jax.process_count() == 1, self.limit
    if self._bound < limit and pending:  # once tripped the bound is the count read: no more reads
      newest = len(pending) - 1 if ready and pending[-1].is_ready() else len(pending) - MAX_UNREAD_FLAGS
      if newest >= 0:
        for _ in range(newest):
          self.pending_padded.pop(id(pending.popleft()), None)
        count = pending.popleft()
        padded = self.pending_padded.pop(id(count), None)
        bound = self._bound + newest + 1
        if bound < limit:
          self._unread, self._bound = count, bound
        else:
          self._count = self._bound = self.read(count)
          self._unread = None
          self.padded = bool(self._count and padded is not None and read_total(padded))
    if self._count >= limit:
      padding = (
          " These batches hold padding rows (weight 0). Weight 0 keeps a row out of the sums but not out of the "
          "gradient: a row the model turns into NaN (e.g. an all-zero row under a length mask: a softmax over no "
          "position) makes the whole gradient NaN (0 * NaN). If the padding rows are zeros (pad='zeros', or your "
          "own zero padding), pad with copies of real rows instead: jaxdp.shard_uneven, jaxdp.split_batch and the "
          "pipelines do by default (pad='copy')."
      ) if self.padded else ""
      raise FloatingPointError(
          f"the last {self.count} steps all had a NaN or Inf gradient or loss on at least one {self.where}; "
          f"{self.consequence}{padding} Lower the learning rate, check the data, or raise "
          "max_consecutive_skips; then call step.reset_nonfinite_guard() to run again."
      )


def read_scalar(x: jax.Array) -> int:
  """A replicated scalar's value, from this process's first copy (a fraction of `jax.device_get`'s cost)."""
  return int(np.asarray(x.addressable_data(0)))


def read_max(x: jax.Array) -> int:
  """The largest value of a per-device (or per-group) count over every process's devices: the largest of this
  process's shards, then, with several processes, of every process's (one small all-gather; every process
  reads at the same call, so they agree)."""
  local = max(int(np.max(np.asarray(shard.data))) for shard in x.addressable_shards)
  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils

  return int(np.max(multihost_utils.process_allgather(np.asarray(local, np.int32))))


def read_total(x: jax.Array) -> int:
  """The sum of the values of this process's devices of a per-device array."""
  # addressable_data(i) is device i's buffer (shard 0 for all i when replicated), without building the Shards.
  return int(sum(np.sum(np.asarray(x.addressable_data(i))) for i in range(len(x.sharding.addressable_devices))))
