"""Write the API reference pages: one page per public module of linicl (docs/api/<module>.md) and the
"API reference" part of mkdocs.yml's nav.

    python tools/gen_api_docs.py           # rewrite the pages and the nav
    python tools/gen_api_docs.py --check   # exit 1 if they are not up to date (tests/test_docs.py checks too)

The modules are read from the source tree, not imported: every ``linicl/**/*.py`` whose dotted name has no
part starting with ``_`` (a package is its ``__init__.py``). A module's public names are its ``__all__``
when it has one (string literals, ``+=`` and ``*NAME`` of a module-level tuple included), else its
top-level functions and classes whose names do not start with ``_``. A public name that is a submodule is
listed as a link to that module's page; every other one is rendered by mkdocstrings (``members:``), so a
page names every public name of its module and a new module or name cannot be left out.
"""

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "linicl"
API = ROOT / "docs" / "api"
MKDOCS = ROOT / "mkdocs.yml"
NAV_START = "    # api-nav-start (written by tools/gen_api_docs.py)"
NAV_END = "    # api-nav-end"


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every public module of the package: dotted name -> source file, sorted by name."""
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts):
            continue
        found[".".join(parts)] = path
    return dict(sorted(found.items()))


def _strings(node: ast.AST, constants: dict[str, list[str]]) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple)):
        out = []
        for element in node.elts:
            if isinstance(element, ast.Constant) and isinstance(element.value, str):
                out.append(element.value)
            elif isinstance(element, ast.Starred) and isinstance(element.value, ast.Name):
                out.extend(constants.get(element.value.id, []))
            else:
                raise ValueError(f"__all__: cannot read {ast.dump(element)}")
        return out
    raise ValueError(f"__all__: cannot read {ast.dump(node)}")


def public_names(path: Path) -> list[str]:
    """A module's public names: its ``__all__``, else its public top-level functions and classes."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants: dict[str, list[str]] = {}
    names: list[str] | None = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if target == "__all__":
                names = _strings(node.value, constants)
            elif isinstance(node.value, (ast.List, ast.Tuple)):
                try:
                    constants[target] = _strings(node.value, constants)
                except ValueError:
                    pass
        elif (isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)
              and node.target.id == "__all__"):
            names = (names or []) + _strings(node.value, constants)
    if names is not None:
        return list(dict.fromkeys(names))
    return [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not node.name.startswith("_")]


def page_name(module: str) -> str:
    return f"{module}.md"


def render(module: str, path: Path, all_modules: dict[str, Path]) -> str:
    names = public_names(path)
    submodules = [n for n in names if f"{module}.{n}" in all_modules]
    members = [n for n in names if n not in submodules]
    lines = ["<!-- Written by tools/gen_api_docs.py: do not edit. -->", "", f"# `{module}`", "",
             f"::: {module}", "    options:", "      show_root_heading: false", "      show_root_toc_entry: false"]
    if members:
        lines.append("      members:")
        lines += [f"        - {n}" for n in members]
    else:
        lines.append("      members: false")
    children = sorted(m for m in all_modules if m.rsplit(".", 1)[0] == module and m != module)
    listed = [f"{module}.{n}" for n in submodules] + [m for m in children if m.rsplit(".", 1)[1] not in submodules]
    if listed:
        lines += ["", "## Submodules", ""]
        lines += [f"- [`{m.rsplit('.', 1)[1]}`]({page_name(m)}): `{m}`" for m in listed]
    return "\n".join(lines) + "\n"


def index(all_modules: dict[str, Path]) -> str:
    lines = ["<!-- Written by tools/gen_api_docs.py: do not edit. -->", "", "# API reference", "",
             "One page per public module of `linicl` (generated from the source: `python tools/gen_api_docs.py`). "
             "Each page lists the module's public names (its `__all__`, else its public functions and classes).",
             ""]
    lines += [f"- [`{m}`]({page_name(m)})" for m in all_modules]
    return "\n".join(lines) + "\n"


def nav(all_modules: dict[str, Path]) -> str:
    """The API part of the nav: the package, its modules, and a section per subpackage."""
    lines = [NAV_START, "    - Overview: api/index.md"]
    for m in all_modules:
        depth = m.count(".")
        children = [c for c in all_modules if c.startswith(m + ".")]
        if depth >= 1 and children:  # a subpackage: a section with its own page first
            lines.append(f"    {'  ' * (depth - 1)}- {m}:")
            lines.append(f"    {'  ' * depth}- {m}: api/{page_name(m)}")
        else:
            lines.append(f"    {'  ' * max(depth - 1, 0)}- {m}: api/{page_name(m)}")
    lines.append(NAV_END)
    return "\n".join(lines)


def expected() -> dict[Path, str]:
    """Every generated file and its content (mkdocs.yml with its nav block rewritten)."""
    all_modules = modules()
    files = {API / page_name(m): render(m, p, all_modules) for m, p in all_modules.items()}
    files[API / "index.md"] = index(all_modules)
    text = MKDOCS.read_text(encoding="utf-8")
    start, end = text.index(NAV_START), text.index(NAV_END) + len(NAV_END)
    files[MKDOCS] = text[:start] + nav(all_modules) + text[end:]
    return files


def stale() -> list[Path]:
    """Generated files that are missing, differ, or are no longer generated (old pages in docs/api)."""
    files = expected()
    out = [p for p, text in files.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    out += [p for p in API.glob("*.md") if p not in files]
    return sorted(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the pages are not up to date")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for p in bad:
            print(f"out of date: {p.relative_to(ROOT)}", file=sys.stderr)
        if bad:
            print("run: python tools/gen_api_docs.py", file=sys.stderr)
        return 1 if bad else 0
    files = expected()
    API.mkdir(parents=True, exist_ok=True)
    for p in API.glob("*.md"):
        if p not in files:
            p.unlink()
    for p, text in files.items():
        if not p.exists() or p.read_text(encoding="utf-8") != text:
            p.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
