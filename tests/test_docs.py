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


def test_every_test_the_composition_table_names_exists():
  """docs/guarantees.md's composition table: every cell's Tn is listed, every listed or quoted file::name is a test
  function (or a parametrized one) in that file, and the counts in the text are the table's."""
  text = (ROOT / "docs" / "guarantees.md").read_text()
  section = text.split("## Composition table", 1)[1].split("\n## ", 1)[0]
  listed = dict(re.findall(r"^- (T\d+): `tests/([\w./]+::\w+)`", section, re.MULTILINE))
  rows = [line for line in section.splitlines() if line.startswith("| **")]
  cells = [cell.strip() for row in rows for cell in row.strip("|").split("|")[1:]]
  assert len(rows) == 21 and len(cells) == 21 * 21
  assert {c for c in cells if c.startswith("T")} <= set(listed)
  named = set(listed.values()) | set(re.findall(r"`(test_\w+\.py::\w+)`", section))
  assert named
  for ref in named:
    file, name = ref.split("::")
    source = (ROOT / "tests" / file).read_text()
    assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"docs/guarantees.md names {ref}, which does not exist"
  upper = [cells[i * 21 + j] for i in range(21) for j in range(i + 1, 21)]
  kinds = {"test": sum(c.startswith("T") for c in upper), "n/a": upper.count("n/a"), "refused": upper.count("refused"),
           "untested": upper.count("—")}
  assert sum(kinds.values()) == 210
  assert (f"{kinds['test']} are tested, {kinds['n/a']} cannot exist,\n{kinds['refused']} are refused and "
          f"{kinds['untested']} are untested") in section
  symmetric = all(cells[i * 21 + j] == cells[j * 21 + i] for i in range(21) for j in range(21))
  assert symmetric
