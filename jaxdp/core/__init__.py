"""The step's vocabulary: the state, the loss protocol, the checks of inputs, randomness that follows the examples, loss scaling and the precision policy, and the one module that touches JAX internals (carries). Imports no other jaxdp package and no model library."""

import importlib


def lazy_submodules(package: str):
  """A package's `__getattr__` (PEP 562): `jaxdp.adapters.nnx` imports `nnx` on first use, as the names of
  `jaxdp` itself are, so that importing a package imports none of its modules."""

  def get(name: str):
    try:
      return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as error:
      if error.name == f"{package}.{name}":
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
      raise

  return get


__getattr__ = lazy_submodules(__name__)
