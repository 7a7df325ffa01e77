"""flax nnx and linen programs: modules, BatchNorm and Dropout that are exact in a data-parallel step, and the guards that refuse flax's own."""

from jaxdp.core import lazy_submodules

__getattr__ = lazy_submodules(__name__)
