"""The docs' own checks that the block tests (pytest-markdown-docs over README.md and docs/) do not make."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.fast  # in the smoke run (make test-fast)

ROOT = pathlib.Path(__file__).parents[1]
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def python_blocks(path):
  return [body for info, body in FENCE.findall(path.read_text()) if info in ("python", "{.python}")]


def test_the_readmes_quick_start_is_examples_quickstart_py():
  """The README shows examples/quickstart.py as it is: the block test runs one, tests/test_examples.py the other."""
  quickstart = (ROOT / "examples" / "quickstart.py").read_text()
  assert quickstart in python_blocks(ROOT / "README.md")


def test_every_local_link_of_the_readme_names_a_file():
  """GitHub renders the README's relative links as they are: each must name a file of the repository."""
  links = re.findall(r"\]\(((?:docs|examples|experiments|jaxdp|tests)/[^)#]*|CHANGELOG\.md)[)#]", (ROOT / "README.md").read_text())
  assert links
  missing = sorted({link for link in links if not (ROOT / link).exists()})
  assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_api_reference_lists_every_public_name():
  """docs/api.md names each entry of jaxdp.__all__ (mkdocstrings renders it from its docstring), so a new public
  name cannot go undocumented."""
  import jaxdp

  listed = set(re.findall(r"^::: jaxdp\.(\w+)", (ROOT / "docs" / "api.md").read_text(), re.MULTILINE))
  missing = sorted(set(jaxdp.__all__) - listed)
  assert not missing, f"docs/api.md lacks ::: jaxdp.NAME for {missing}"
