"""Every code block of the README runs.

* ```python blocks run, in order, in one namespace (later blocks use what earlier
  ones defined), on the CPU with the embedded model.
* ```bash blocks: each command line is checked against the real parser of the
  program it runs. ``jaxkv ...`` lines go through ``jaxkv.cli``'s parser (plugins
  included); ``python -m MODULE ...`` and ``python path/to/script.py ...`` lines
  run the script's ``main`` with ``ArgumentParser.parse_args`` stopped right after
  parsing, so an unknown flag or a bad value fails here, without the minutes-long
  run. ``jupytext`` and ``papermill`` lines go through those tools' own parsers, the
  notebook they name must be one of ``eval/notebooks`` and every ``-p NAME`` one of
  its parameters. ``make``, ``curl``, ``pip`` and ``cd`` lines are left to CI and
  the server tests.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import runpy
import shlex
from pathlib import Path

import pytest

from jaxkv.models.loading import EMBEDDED_DIR

README = Path(__file__).resolve().parent.parent / "README.md"
SKIPPED = ("make", "curl", "pip", "cd", "export", "git", "uvicorn")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.DOTALL)


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
        assert notebooks and all((README.parent / n).is_file() for n in notebooks), args
        return
    from papermill.cli import papermill as command

    params = command.make_context("papermill", list(args)).params
    name = Path(params["notebook_path"]).stem
    script = README.parent / "eval" / "notebooks" / f"{name}.py"
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
    assert Path(prog).name.startswith("python"), f"README runs an unknown program: {line}"
    if args[0] == "-m":
        module = importlib.import_module(args[1])
        _parse_only(args[2:], module.main)
    else:
        script = str(README.parent / args[0])
        _parse_only(args[1:], lambda a: runpy.run_path(script, run_name="__main__", init_globals={"__argv__": a}))


def test_readme_has_code_blocks():
    assert blocks("python") and blocks("bash")


@pytest.mark.parametrize("line", [line for block in blocks("bash") for line in command_lines(block)])
def test_readme_command_lines_parse(line, monkeypatch):
    if not line.startswith(("python", "jaxkv", ".venv", "JAX_PLATFORMS") + NOTEBOOK_TOOLS) and shlex.split(line)[0] not in SKIPPED:
        pytest.fail(f"README command of an unknown kind: {line}")
    first = shlex.split(line)
    if any(Path(w).name.startswith("python") and i + 1 < len(first) and first[i + 1].endswith(".py") for i, w in enumerate(first)):
        script = next(w for w in first if w.endswith(".py"))
        monkeypatch.setattr("sys.argv", [script] + first[first.index(script) + 1 :])
    check_command(line)


@pytest.mark.slow  # every example, sessions, servers and the multi-device subprocesses included
@pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").is_file(), reason="embedded model not installed")
def test_readme_python_blocks_run():
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(blocks("python")):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"README python block {i + 1} failed: {err!r}\n{block}") from err
