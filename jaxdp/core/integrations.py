"""The model libraries jaxdp integrates with, and the module that registers each one's support.

`jaxdp.core.loss.model_support` imports a library's registering module the
first time it runs with that library loaded (in `sys.modules`): the
library's guards (e.g. the refusal of flax linen's `BatchNorm` statistics
over padding rows) then hold in every program that uses it, whether or not
the program imports the registering module itself. This module imports
nothing, so that the core can read it without importing any library.
"""

LIBRARIES = {"flax": "jaxdp.adapters.flax_support"}
"""`{library module: jaxdp module that registers its ModelSupport}`."""
