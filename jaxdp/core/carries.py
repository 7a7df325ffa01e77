"""Loop carries that start from a constant, inside a data-parallel step.

Inside `shard_map` with `check_vma=True` a constant (`jnp.zeros`) is
typed as the same on every device, while a loop body that reads the batch
returns a per-device ("varying") value. `lax.scan`, `fori_loop` and
`while_loop` then refuse the carry: its input and output types differ. Every
RNN starts that way (flax's `nn.RNN`, `LSTMCell.initialize_carry`,
`nn.scan`, `nnx.scan`), and the carry is made inside the model, where the
user cannot add the `lax.pcast` that JAX's message asks for. On one device
the same program runs.

While jaxdp traces a `loss_fn` (`promoting_carries`), a loop whose
initial carry is typed as varying over fewer manual axes than the body's
output is retraced with that carry cast to varying: exactly the `pcast`
JAX's message suggests, a no-op at run time, so the values are those of one
device. JAX already retraces a loop once to widen weakly typed carries
(`_promote_weak_typed_input`); this extends that one pass to the varying
axes. What one pass cannot settle is refused by JAX as before: a carry that
becomes varying only through another carry's value from an earlier iteration
needs `jaxdp.as_varying` on its initial value.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any

import jax
from jax import lax

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxdp_promoting_carries", default=False)
_INSTALL_LOCK = threading.Lock()
_installed = False


def varying_of(aval: Any) -> frozenset:
  """The manual mesh axes the abstract value `aval` is typed as varying over (JAX 0.10 and 0.11 spellings)."""
  manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()) or ())  # JAX 0.11 spelling


def _promoting(original):
  def promote(in_val: Any, in_aval: Any, out_aval: Any) -> tuple[Any, bool]:
    value, changed = original(in_val, in_aval, out_aval)
    if not _ACTIVE.get():
      return value, changed
    missing = tuple(sorted(varying_of(out_aval) - varying_of(jax.typeof(value))))
    if not missing:
      return value, changed
    return lax.pcast(value, missing, to="varying"), True

  promote.jaxdp_promoting = True
  return promote


def _install() -> bool:
  """Wraps JAX's carry promotion once per process; `False` where this JAX has no such hook."""
  global _installed
  with _INSTALL_LOCK:
    if not _installed:
      try:
        from jax._src.lax.control_flow import loops
      except ImportError:  # another JAX layout: loops keep JAX's own typing
        return False
      original = getattr(loops, "_promote_weak_typed_input", None)
      if original is None:
        return False
      if not getattr(original, "jaxdp_promoting", False):
        loops._promote_weak_typed_input = _promoting(original)
      _installed = True
  return True


@contextlib.contextmanager
def promoting_carries():
  """Within this context, loops traced inside `shard_map` accept initial carries made from constants."""
  _install()
  token = _ACTIVE.set(True)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes `x` is typed as varying over (inside `shard_map` with `check_vma`)."""
  return varying_of(jax.typeof(x))
