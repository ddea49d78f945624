"""The documentation site builds with warnings as errors, and that check has teeth.

``mkdocs build --strict`` (the same build as ``make docs``) over README.md (the home
page, through mkdocs_hooks.py), every page of docs/ and the API reference that
mkdocstrings generates from the public names' docstrings. A broken link or anchor,
a page left out of the nav, or a public name the reference cannot find fails it;
the second test breaks a copy of the docs each way and checks the build refuses.
A build takes a few seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_docs_build_strict(tmp_path):
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "radix prefix cache" in home and 'href="architecture.html"' in home  # the README, its docs/ links made relative
    api = (tmp_path / "site" / "api.html").read_text()
    public = (
        "load_model",
        "generate",
        "score_logits",
        "Session",
        "Session.chat",
        "Server",
        "policies.REGISTRY",
        "errors.JaxKVError",
        "errors.ConfigError",
        "server.run.make_app",
        "server.run.BackgroundServer",
    )
    missing = [name for name in public if f'id="jaxkv.{name}"' not in api]
    assert not missing, f"the API reference has no entry for {missing}"


def broken_copy(tmp_path: Path, page: str, text: str) -> Path:
    """A copy of docs/ with ``text`` appended to ``page``, and a config that builds it."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    with open(docs / page, "a") as f:
        f.write("\n" + text + "\n")
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(ROOT / "mkdocs_hooks.py")]
    config["plugins"][1]["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return tmp_path / "mkdocs.yml"


@pytest.mark.parametrize(
    "page, text, complaints",
    [
        (
            "retention.md",
            "See [the missing page](no_such_page.md).\n\nSee [a missing section](repair.md#no-such-section).",
            ("no_such_page.md", "no-such-section"),
        ),
        ("api.md", "::: jaxkv.no_such_public_name", ("no_such_public_name",)),
    ],
    ids=["broken link and anchor", "renamed public name"],
)
def test_docs_build_fails_on_breakage(tmp_path, page, text, complaints):
    """A broken link and a broken anchor share one build: under ``--strict`` a
    WARNING alone fails it, so each must be reported as a WARNING (not INFO), which
    is what fails the build when it is the only breakage. A public name the
    reference cannot find stops the build at once (mkdocstrings' error), so it
    builds on its own."""
    done = build(broken_copy(tmp_path, page, text), tmp_path / "site")
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    for complaint in complaints:
        assert any(complaint in line and line.startswith(("WARNING", "ERROR")) for line in log.splitlines()), (complaint, log)
