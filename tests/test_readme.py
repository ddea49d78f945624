"""Every code block of the README and of every page of ``docs/`` runs.

* ```python blocks run, in order, in one namespace per page (later blocks of a page
  use what its earlier ones defined), on the CPU with the embedded model.
* ```bash blocks: each command line is checked against the real parser of the
  program it runs. ``jaxkv ...`` lines go through ``jaxkv.cli``'s parser (plugins
  included); ``python -m MODULE ...`` and ``python path/to/script.py ...`` lines
  run the script's ``main`` with ``ArgumentParser.parse_args`` stopped right after
  parsing, so an unknown flag or a bad value fails here, without the minutes-long
  run. ``jupytext`` and ``papermill`` lines go through those tools' own parsers, the
  notebook they name must be one of ``eval/notebooks`` and every ``-p NAME`` one of
  its parameters. ``make``, ``curl``, ``pip`` and ``cd`` lines are left to CI and
  the server tests.
* A block that must not run says so in its fence, after the language (the info
  string): ```text output (output shown, e.g. of ``make demo``) or
  ```python long-running (minutes of work). Those are reported as skipped, each with
  its page and line. Any other fence (no language, another language, an unknown
  marker) fails ``test_every_fence_is_checked_or_marked``: nothing is left out
  silently. The site renders marked fences as ordinary code blocks
  (``relaxed_headers`` in mkdocs.yml).
* The README's mechanism table quotes a headline number per row (in bold) and links
  the page it comes from; that page must contain the number.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from jaxkv.models.loading import EMBEDDED_DIR

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SKIPPED = ("make", "curl", "pip", "cd", "export", "git", "uvicorn")
CHECKED_LANGUAGES = ("python", "bash")
# Markers a fence may carry after its language to say it is not run; each with why.
SKIP_MARKERS = {"output": "output shown on the page, not code", "long-running": "minutes of work: run by hand, not in make test"}


@dataclass(frozen=True)
class Fence:
    """One fenced code block: where it is, its language, its markers and its text."""

    page: Path
    line: int
    language: str
    markers: tuple[str, ...]
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        marked = [m for m in self.markers if m in SKIP_MARKERS]
        return f"{self.where} is marked {marked[0]!r}: {SKIP_MARKERS[marked[0]]}" if marked else None


def fences(page: Path) -> list[Fence]:
    """Every ``` fence of a page (top level: the pages use no indented fences)."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            info = lines[i][3:].split()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            body = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Fence(page, i + 1, info[0] if info else "", tuple(info[1:]), body))
            i = end
        i += 1
    return found


ALL_FENCES = [fence for page in PAGES for fence in fences(page)]


def checked(language: str, page: Path | None = None) -> list[Fence]:
    """The fences of ``language`` that run (not marked), of one page or of all."""
    return [f for f in ALL_FENCES if f.language == language and f.skip_reason is None and page in (None, f.page)]


def blocks(language: str) -> list[str]:
    """The README's runnable blocks of ``language`` (its text only)."""
    return [f.body for f in checked(language, README)]


def command_lines(block: str) -> list[str]:
    """Shell lines with continuations joined, comments and blank lines dropped."""
    text = re.sub(r"\\\n\s*", " ", block)
    lines = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


class _Parsed(Exception):
    pass


def _parse_only(argv: list[str], run) -> None:
    """Run ``run()`` with argparse stopping right after a successful parse."""
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse
    try:
        with pytest.raises(_Parsed):
            run(argv)
    finally:
        argparse.ArgumentParser.parse_args = real


NOTEBOOK_TOOLS = ("jupytext", "papermill")


def check_notebook_command(tool: str, args: list[str]) -> None:
    """A ``jupytext``/``papermill`` line of the README: parsed by the tool's parser; the
    notebook is a jupytext script of ``eval/notebooks`` (``X.ipynb`` is the pairing
    of ``X.py``) and papermill's ``-p`` names are parameters of it."""
    import jupytext

    if tool == "jupytext":
        from jupytext.cli import parse_jupytext_args

        notebooks = parse_jupytext_args(args).notebooks
        assert notebooks and all((ROOT / n).is_file() for n in notebooks), args
        return
    from papermill.cli import papermill as command

    params = command.make_context("papermill", list(args)).params
    name = Path(params["notebook_path"]).stem
    script = ROOT / "eval" / "notebooks" / f"{name}.py"
    assert script.is_file(), f"papermill runs {params['notebook_path']}, not a notebook of eval/notebooks"
    (cell,) = [c for c in jupytext.read(script).cells if "parameters" in c.metadata.get("tags", [])]
    known = {t.id for node in ast.parse(cell.source).body if isinstance(node, ast.Assign) for t in node.targets}
    unknown = sorted({p for p, _ in params["parameters"]} - known)
    assert not unknown, f"{name}: no parameters {unknown}"


def check_command(line: str) -> None:
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # env assignments
        words.pop(0)
    prog, args = words[0], words[1:]
    if Path(prog).name in SKIPPED:
        return
    if Path(prog).name in NOTEBOOK_TOOLS:
        check_notebook_command(Path(prog).name, args)
        return
    if Path(prog).name == "jaxkv":
        from jaxkv import cli

        _parse_only(args, lambda a: cli.build_parser(load=(a[0],)).parse_args(a))
        return
    assert Path(prog).name.startswith("python"), f"the docs run an unknown program: {line}"
    if args[0] == "-m":
        module = importlib.import_module(args[1])
        _parse_only(args[2:], module.main)
    else:
        script = str(ROOT / args[0])
        _parse_only(args[1:], lambda a: runpy.run_path(script, run_name="__main__", init_globals={"__argv__": a}))


def test_readme_has_code_blocks():
    assert blocks("python") and blocks("bash")


def test_every_docs_page_is_covered():
    """Every page of docs/ is collected, and each opens with a minimal example."""
    assert {p.name for p in PAGES} >= {
        "architecture.md",
        "retention.md",
        "intentkv.md",
        "repair.md",
        "triaxial.md",
        "reuse.md",
        "server.md",
        "accelerators.md",
        "models.md",
        "evaluation.md",
        "benchmarks.md",
        "api.md",
    }
    for page in PAGES[1:]:
        if page.name == "index.md":  # the README, put there by mkdocs_hooks.py
            continue
        assert [f for f in fences(page) if f.skip_reason is None], f"{page.name} has no runnable example"


@pytest.mark.parametrize("fence", ALL_FENCES, ids=lambda f: f.where)
def test_every_fence_is_checked_or_marked(fence):
    unknown = [m for m in fence.markers if m not in SKIP_MARKERS]
    assert not unknown, f"{fence.where}: unknown fence marker(s) {unknown}; known: {sorted(SKIP_MARKERS)}"
    assert fence.language in CHECKED_LANGUAGES or fence.skip_reason, (
        f"{fence.where}: a ```{fence.language} block is neither run nor marked; "
        f"mark it in its fence ({', '.join(sorted(SKIP_MARKERS))}) or make it python / bash"
    )


@pytest.mark.parametrize("fence", [f for f in ALL_FENCES if f.skip_reason], ids=lambda f: f.where)
def test_marked_fences_are_skipped_by_name(fence):
    pytest.skip(fence.skip_reason)


def _command_cases() -> list:
    return [pytest.param(line, id=f"{f.where}: {line[:60]}") for f in checked("bash") for line in command_lines(f.body)]


@pytest.mark.parametrize("line", _command_cases())
def test_readme_command_lines_parse(line, monkeypatch):
    if not line.startswith(("python", "jaxkv", ".venv", "JAX_PLATFORMS") + NOTEBOOK_TOOLS) and shlex.split(line)[0] not in SKIPPED:
        pytest.fail(f"documented command of an unknown kind: {line}")
    first = shlex.split(line)
    if any(Path(w).name.startswith("python") and i + 1 < len(first) and first[i + 1].endswith(".py") for i, w in enumerate(first)):
        script = next(w for w in first if w.endswith(".py"))
        monkeypatch.setattr("sys.argv", [script] + first[first.index(script) + 1 :])
    check_command(line)


def _headline_rows() -> list:
    """README table rows that quote a **number** and link a page of docs/."""
    rows = []
    for line in README.read_text().splitlines():
        bold = re.findall(r"\*\*([^*]*\d[^*]*)\*\*", line)
        link = re.search(r"\]\(docs/([\w-]+\.md)", line)
        if line.startswith("|") and bold and link:
            rows.extend(pytest.param(number, link.group(1), id=f"{number} in {link.group(1)}") for number in bold)
    return rows


@pytest.mark.parametrize("number, page", _headline_rows())
def test_readme_headline_numbers_are_on_their_pages(number, page):
    assert number in (ROOT / "docs" / page).read_text(), f"README quotes {number}, docs/{page} does not have it"


def test_readme_quotes_a_headline_per_mechanism():
    assert len(_headline_rows()) >= 8


def run_page(page: Path) -> None:
    """A page's python blocks, in order, in one fresh namespace."""
    namespace: dict = {"__name__": page.stem}
    for fence in checked("python", page):
        try:
            exec(compile(fence.body, fence.where, "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{fence.where} failed: {err!r}\n{fence.body}") from err


@pytest.mark.slow  # every example, sessions, servers and the multi-device subprocesses included
@pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").is_file(), reason="embedded model not installed")
def test_readme_python_blocks_run():
    run_page(README)


@pytest.mark.slow
@pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").is_file(), reason="embedded model not installed")
@pytest.mark.parametrize("page", [p for p in PAGES[1:] if checked("python", p)], ids=lambda p: p.name)
def test_docs_python_blocks_run(page):
    run_page(page)


def test_fence_markers_are_read_from_the_info_string(tmp_path, monkeypatch):
    """A marked fence is skipped with its reason; an unmarked non-python/bash fence is an error."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python long-running\nrun()\n```\n\n```text output\n42\n```\n\n```json\n{}\n```\n\n```bash\njaxkv demo\n```\n"
    )
    slow, shown, data, shell = fences(page)
    assert (slow.language, slow.markers, slow.body, slow.line) == ("python", ("long-running",), "run()\n", 3)
    assert "page.md:3 is marked 'long-running'" in slow.skip_reason and "page.md:7" in shown.skip_reason
    assert data.skip_reason is None and shell.skip_reason is None
    with pytest.raises(AssertionError, match="neither run nor marked"):
        test_every_fence_is_checked_or_marked(data)
    test_every_fence_is_checked_or_marked(shell)
