"""What a layout costs: memory and communication reports of a step, and the scaling model."""

from jaxdp.core import lazy_submodules

__getattr__ = lazy_submodules(__name__)
