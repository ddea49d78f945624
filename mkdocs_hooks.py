"""mkdocs hook: the site's home page is the README.

``docs/index.md`` is a placeholder; at build time its content is replaced by
``README.md`` with the README's ``docs/...`` links made relative to ``docs/``, so the
front door is written once and the strict build checks its links like any page's.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"


def readme_as_home(readme: str) -> str:
    """README text with links into ``docs/`` rewritten for a page that lives there."""
    return re.sub(r"\]\(docs/", "](", readme)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "index.md":
        return readme_as_home(README.read_text())
    return markdown
