"""The documentation: every public name of linicl is on an API reference page, the generated pages are
up to date, every page, notebook and README link resolves. Reads the markdown and mkdocs.yml only (no docs
tools needed; `make docs` builds the site with `mkdocs build --strict`, which also checks links)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


gen = _load("gen_api_docs", ROOT / "tools" / "gen_api_docs.py")
hooks = _load("mkdocs_hooks", ROOT / "tools" / "mkdocs_hooks.py")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def nav_targets() -> list[str]:
    """The files mkdocs.yml's nav names (relative to docs/)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:"):]
    return re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.(?:md|ipynb))\s*$", nav, re.M)


def slug(heading: str) -> str:
    """The anchor of a heading as MkDocs' toc writes it (enough for the headings linked here)."""
    text = re.sub(r"[`*_]", "", heading.strip()).lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[\s]+", "-", text).strip("-")


def expanded(path: Path) -> str:
    """A file's markdown as the site shows it: a docs page with the README sections and RESULTS.md that
    tools/mkdocs_hooks.py puts in at its markers."""
    text = path.read_text(encoding="utf-8")
    if DOCS in path.parents:
        page = str(path.relative_to(DOCS))
        text = text.replace(hooks.RESULTS, hooks.relink((ROOT / "RESULTS.md").read_text(encoding="utf-8"), page))
        text = hooks.SECTION.sub(lambda m: hooks.relink(hooks.readme_section(m.group(1)), page), text)
    return text


def anchors(path: Path) -> set[str]:
    text = expanded(path)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_api_pages_are_up_to_date():
    stale = gen.stale()
    assert not stale, f"run `python tools/gen_api_docs.py`: out of date: {[str(p.relative_to(ROOT)) for p in stale]}"


def test_every_module_has_a_page_in_the_nav():
    modules = gen.modules()
    nav = set(nav_targets())
    for module in modules:
        assert (DOCS / "api" / f"{module}.md").is_file(), module
        assert f"api/{module}.md" in nav, module
    # the package's own list of public submodules (linicl.SUBMODULES) is covered
    init = (ROOT / "linicl" / "__init__.py").read_text(encoding="utf-8")
    submodules = re.search(r"^SUBMODULES = \((.*?)\)", init, re.S | re.M).group(1)
    for name in re.findall(r'"(\w+)"', submodules):
        assert f"linicl.{name}" in modules, name


def _documented(page: Path) -> set[str]:
    """The names a generated page renders (mkdocstrings members) or links (submodules)."""
    text = page.read_text(encoding="utf-8")
    members = set(re.findall(r"^        - (\w+)$", text, re.M))
    linked = set(re.findall(r"^- \[`(\w+)`\]\(", text, re.M))
    return members | linked


def test_every_public_name_is_in_the_api_reference():
    missing = []
    for module, path in gen.modules().items():
        documented = _documented(DOCS / "api" / f"{module}.md")
        missing += [f"{module}.{name}" for name in gen.public_names(path) if name not in documented]
    assert not missing, missing


def test_public_names_read_from_the_source():
    """The page generator's reading of a module: __all__ (with += and *NAME), else public defs."""
    assert {"ModelConfig", "generate", "Transformer", "iclca", "routing"} <= set(
        gen.public_names(ROOT / "linicl" / "__init__.py"))
    assert {"from_pretrained", "save_pretrained", "minilm"} <= set(gen.public_names(ROOT / "linicl" / "lm" / "__init__.py"))
    names = gen.public_names(ROOT / "linicl" / "iclca.py")
    assert {"convert", "convert_approx"} <= set(names) and not any(n.startswith("_") for n in names)


def test_every_page_of_the_nav_exists_and_every_page_is_in_it():
    nav = nav_targets()
    assert len(nav) == len(set(nav))
    for target in nav:
        assert (DOCS / target).exists(), target
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages <= set(nav), sorted(pages - set(nav))
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{notebook.name}" in nav, notebook.name


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [t for t in LINK.findall(readme) + IMAGE.findall(readme) if not re.match(r"https?://|mailto:", t)]
    assert links
    for target in links:
        file, _, anchor = target.partition("#")
        path = ROOT / file if file else ROOT / "README.md"
        assert path.exists(), target
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), target


def test_readme_first_lines_are_the_two_commands():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").split("\n")
    assert lines[0] == "# linicl" and lines[2] == "```bash"
    assert lines[3].startswith("make demo") and lines[4].startswith("make test")
    assert len(lines) <= 151  # a newcomer's page; the rest lives in docs/guides


def test_results_figures_resolve():
    results = (ROOT / "RESULTS.md").read_text(encoding="utf-8")
    for target in IMAGE.findall(results):
        if not re.match(r"https?://", target):
            assert (ROOT / target).is_file(), target
            # the site shows RESULTS.md at docs/results.md with these links made relative to docs/
            assert (DOCS / hooks.relink(f"]({target})", "results.md")[2:-1]).is_file(), target


@pytest.mark.parametrize("page", sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")))
def test_docs_links_resolve(page):
    """Relative links of a docs page point at files of the site (mkdocs --strict checks them too)."""
    text = re.sub(r"```.*?```", "", expanded(DOCS / page), flags=re.S)
    for target in LINK.findall(text) + IMAGE.findall(text):
        if re.match(r"https?://|mailto:", target) or target.startswith("#"):
            continue
        file, _, anchor = target.partition("#")
        path = (DOCS / page).parent / file
        assert path.exists(), f"{page}: {target}"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{page}: {target}"
