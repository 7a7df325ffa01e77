"""Data in and state out: input pipelines and checkpoints."""

from jaxdp.core import lazy_submodules

__getattr__ = lazy_submodules(__name__)
