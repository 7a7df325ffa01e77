"""`python -m jaxdp.launch`: the launcher's command line (`jaxdp.runtime.launch`), under its usual name.

Imports no jax: the launcher starts its workers before any of them initialises a backend.
"""

import sys

from jaxdp.runtime.launch import main

if __name__ == "__main__":
  sys.exit(main())
