"""mkdocs hooks: the README is the site's home page, and the committed plots are in the site.

* ``docs/index.md`` is a placeholder; at build time its content is replaced by
  ``README.md`` with the README's ``docs/...`` links made relative to ``docs/``, so the
  front door is written once and the strict build checks its links like any page's.
  README links to other repository files (reports under ``eval/results/``), which the
  site does not contain, become their text followed by the path in code.
* Pages show plots where they are committed, beside their reports
  (``![...](../eval/results/.../x.png)``, a path that also works when the page is read
  on a code host). The build copies every PNG of ``eval/results/`` and
  ``jaxkv/assets/`` into the site under ``repo/`` and points those links there.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent
README = ROOT / "README.md"
PLOT_DIRS = ("eval/results", "jaxkv/assets")
SITE_PREFIX = "repo"


def readme_as_home(readme: str) -> str:
    """README text with links into ``docs/`` rewritten for a page that lives there.

    Relative links to repository files outside ``docs/`` (not pictures, which
    ``plot_links_to_site`` handles) name the file in code instead: the site has no copy.
    """
    outside_docs = r"(?<!!)\[([^\]]+)\]\(((?!docs/|https?:|#|mailto:)[^)\s]+)\)"
    readme = re.sub(outside_docs, r"\1 (`\2`)", readme)
    return re.sub(r"\]\(docs/", "](", readme)


def plot_links_to_site(markdown: str) -> str:
    """``](../eval/results/x.png)`` -> ``](repo/eval/results/x.png)``, the copy in the site."""
    dirs = "|".join(re.escape(d) for d in PLOT_DIRS)
    return re.sub(rf"\]\(\.\./((?:{dirs})/[^)\s]+\.png)\)", rf"]({SITE_PREFIX}/\1)", markdown)


def on_files(files, config):
    for directory in PLOT_DIRS:
        for png in sorted((ROOT / directory).rglob("*.png")):
            uri = f"{SITE_PREFIX}/{png.relative_to(ROOT).as_posix()}"
            files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "index.md":
        markdown = readme_as_home(README.read_text())
    return plot_links_to_site(markdown)
