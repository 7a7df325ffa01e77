"""Steps that run: the jitted train, eval and DiLoCo steps, their host input layer, multi-process runs and the launcher."""

from jaxdp.core import lazy_submodules

__getattr__ = lazy_submodules(__name__)
