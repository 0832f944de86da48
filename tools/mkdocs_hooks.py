"""MkDocs hooks (mkdocs.yml: hooks): pages that show text kept elsewhere in the repository.

* ``<!-- RESULTS.md -->``: the whole of RESULTS.md (written by `make results` at the repository root), so
  the site always shows the current results.
* ``<!-- README.md:NAME -->``: the README's text between ``<!-- start:NAME ... -->`` and
  ``<!-- end:NAME -->`` (the contract, the known issues, ...), kept in one place.

Links in that text are relative to the repository root; they are rewritten relative to the page
(``docs/X`` -> ``X``, ``RESULTS.md`` -> ``results.md``), so `mkdocs build --strict` checks them as links of
the site.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "<!-- RESULTS.md -->"
SECTION = re.compile(r"<!-- README\.md:([\w-]+) -->")
LINK = re.compile(r"\]\((?!https?://|#)([^)\s]+)\)")


def readme_section(name: str, readme: str | None = None) -> str:
    """The README's text between its start:NAME and end:NAME markers (the markers excluded)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8") if readme is None else readme
    found = re.search(rf"<!-- start:{re.escape(name)}\b[^>]*-->\n(.*?)<!-- end:{re.escape(name)} -->", text, re.S)
    if found is None:
        raise KeyError(f"README.md has no section marked start:{name} ... end:{name}")
    return found.group(1)


def relink(markdown: str, page_path: str) -> str:
    """Links relative to the repository root made relative to the page docs/<page_path>."""
    up = "../" * page_path.count("/")

    def target(match):
        link = match.group(1)
        if link.startswith("docs/"):
            link = link[len("docs/"):]
        elif link.startswith("RESULTS.md"):
            link = "results.md" + link[len("RESULTS.md"):]
        else:
            return match.group(0)  # left as is: a broken link fails `mkdocs build --strict`
        return f"]({up}{link})"

    return LINK.sub(target, markdown)


def on_page_markdown(markdown, page, config, files):
    path = page.file.src_uri
    if RESULTS in markdown:
        markdown = markdown.replace(RESULTS, relink((ROOT / "RESULTS.md").read_text(encoding="utf-8"), path))
    return SECTION.sub(lambda m: relink(readme_section(m.group(1)), path), markdown)
