"""The docs as a reader sees them: docstrings that render as Markdown, code blocks within the page's width.

The API reference (docs/api.md, built by ``make docs``) renders jaxdp's docstrings with mkdocstrings: Google-style
sections parsed by griffe, text as Markdown. Sphinx roles and reST literals are then shown as literal text, so the
docstrings hold neither; this is checked on the source (every docstring of the package) and on what griffe parses
with the options of mkdocs.yml (every public name, as mkdocstrings renders it), without building the site.
"""

import ast
import importlib
import inspect
import pathlib
import re

import pytest
import yaml

import jaxdp

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).parents[1]
# :func:`x`, :class:`~a.B`, :py:meth:`...` (Sphinx roles), ``x`` (reST literals), "text::" (a reST literal block).
REST = re.compile(r":(?:py:)?[a-z]+:`[^`]+`|(?<!`)``(?!`)|::\s*$", re.MULTILINE)
# The widest code line the theme shows unclipped at 1280 px is about 100 characters (issue 35; see the report).
CODE_WIDTH = 100
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def docstrings(path):
  """``(line, text)`` of every string statement of a module: its docstrings and attribute docstrings."""
  tree = ast.parse(path.read_text())
  return [(node.lineno, node.value.value) for node in ast.walk(tree)
          if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]


def test_docstrings_hold_no_rest_markup():
  found = [f"{path.relative_to(ROOT)}:{line}: {REST.search(text).group(0)!r}"
           for path in sorted((ROOT / "jaxdp").rglob("*.py")) for line, text in docstrings(path) if REST.search(text)]
  assert not found, ("reST markup in docstrings, shown as literal text by mkdocstrings (Markdown): "
                     f"{found[:10]} ({len(found)} in all); run convert_docstrings.py or write `code`")


def resolve(path):
  """The object a ``::: dotted.path`` line of docs/api.md names."""
  parts = path.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for part in parts[i:]:
      obj = getattr(obj, part)
    return obj
  raise ImportError(path)


def members(obj):
  """What mkdocstrings renders under an object: a module's or class's own public members (filters: "!^_")."""
  if inspect.ismodule(obj):
    return [m for n, m in vars(obj).items() if not n.startswith("_") and getattr(m, "__module__", None) == obj.__name__]
  if inspect.isclass(obj):
    return [m for n, m in vars(obj).items() if not n.startswith("_") and isinstance(m, property)
            or inspect.isfunction(m) and m.__qualname__.startswith(obj.__qualname__ + ".")]
  return []


def public_objects():
  """``(name, docstring)`` of everything docs/api.md renders: each ``:::`` object and its members."""
  seen, out = set(), []
  for path in re.findall(r"^::: (\S+)", (ROOT / "docs" / "api.md").read_text(), re.MULTILINE):
    obj = resolve(path)
    for member in [obj] + members(obj) + [m for c in members(obj) if inspect.isclass(c) for m in members(c)]:
      doc = member.__doc__ if isinstance(member, property) else inspect.getdoc(member)
      if doc and id(member) not in seen and (member is obj or not isinstance(member, (int, str, tuple, dict))):
        seen.add(id(member))
        out.append((f"{path}:{getattr(member, '__qualname__', getattr(member, '__name__', ''))}", inspect.cleandoc(doc)))
  return out


def parser_options():
  handler = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["plugins"][1]["mkdocstrings"]["handlers"]["python"]
  options = handler["options"]
  assert options["docstring_style"] == "google"
  return options.get("docstring_options", {})


def rendered_texts(sections):
  """The text of every parsed section, as mkdocstrings hands it to Markdown."""
  for section in sections:
    value = section.value
    if isinstance(value, str):
      yield value
    elif isinstance(value, list):
      for item in value:
        yield getattr(item, "description", "") or ""
        yield str(getattr(item, "annotation", "") or "")
        yield getattr(item, "name", "") or ""
    elif hasattr(value, "contents"):  # an admonition
      yield value.contents


def test_the_api_reference_renders_every_docstring_as_markdown():
  """Parsed as mkdocs.yml has mkdocstrings parse them: no role, no reST literal, and each Returns section is one
  description (before, "A :class:`CompiledStep` ..." became a value named "A" and its continuation lines further
  values)."""
  import griffe  # griffelib (requirements.txt): the parser mkdocstrings uses
  options = parser_options()
  problems = []
  for name, doc in public_objects():
    sections = griffe.Docstring(doc, lineno=1).parse("google", warnings=False, **options)
    for text in rendered_texts(sections):
      if REST.search(text):
        problems.append(f"{name}: {REST.search(text).group(0)!r}")
    for section in sections:
      if section.kind.value == "returns":
        if len(section.value) != 1 or section.value[0].name:
          problems.append(f"{name}: Returns parsed as {[(r.name, r.description[:30]) for r in section.value]}")
  assert len(public_objects()) > len(jaxdp.__all__)  # the members too
  assert not problems, f"{len(problems)} docstrings render badly: {problems[:10]}"


def test_docs_code_blocks_fit_the_page():
  """Code lines wider than the theme's content column are clipped (a scroll bar hides the comments)."""
  long = [f"{path.name}: {line[:60]}... ({len(line)})" for path in sorted((ROOT / "docs").glob("*.md"))
          for _, body in FENCE.findall(path.read_text()) for line in body.split("\n") if len(line) > CODE_WIDTH]
  assert not long, f"{len(long)} code lines over {CODE_WIDTH} characters: {long[:10]}"
