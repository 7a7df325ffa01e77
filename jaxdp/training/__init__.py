"""The pure data-parallel step: local gradients, their exact reduction, the update, replica checks."""

from jaxdp.core import lazy_submodules

__getattr__ = lazy_submodules(__name__)
