"""How a run is spread over its devices: meshes and state layouts, ZeRO's splits, layer-wise gathering, pipelines, and the layout value `jaxdp.data_parallel`."""

from jaxdp.core import lazy_submodules

__getattr__ = lazy_submodules(__name__)
