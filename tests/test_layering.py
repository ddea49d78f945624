"""The map's arrows point down (``docs/architecture.md``'s map): the import
contracts, and the engine's one pool interface.

The layering is declared once, as ``import-linter`` contracts in ``pyproject.toml``
(``[tool.importlinter]``): the order of ``jaxkv``'s parts, the imports the map
forbids (models import no kernels, nothing in ``jaxkv/`` imports ``train/`` or
``eval/``, nothing in ``train/`` imports ``eval/``, ...) and no import circle at any
depth. ``make test`` runs ``lint-imports`` first; the tests here run it too, on this
checkout, and on a copy with one upward import added, which must fail and name the
offending chain.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxkv"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the packages under ``root`` with ``root/pyproject.toml``'s
    contracts (``root`` first on the path, so a copy is read, not the installed tree)."""
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        exe = shutil.which("lint-imports")
    assert exe, "lint-imports is missing: pip install -e '.[test]' (import-linter)"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(exe), "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_import_contracts_hold():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


def copy_sources(dst: Path) -> Path:
    """The Python files of jaxkv/, train/ and eval/ and pyproject.toml, copied to ``dst``."""

    def not_source(folder, names):
        return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or os.path.isdir(os.path.join(folder, n)))]

    for package in ("jaxkv", "train", "eval"):
        shutil.copytree(ROOT / package, dst / package, ignore=not_source)
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


@pytest.mark.parametrize(
    "module, line, contract, chain",
    [
        # a model reaching up into the serving layer
        (
            "jaxkv/models/transformer.py",
            "import jaxkv.serving.scheduler",
            "jaxkv's parts import downwards only",
            "jaxkv.models.transformer -> jaxkv.serving.scheduler",
        ),
        # the package reaching into the evaluation scripts
        (
            "jaxkv/cache/radix.py",
            "import eval.quality.harness",
            "jaxkv never imports train/ or eval/",
            "jaxkv.cache.radix -> eval.quality.harness",
        ),
        # a trainer reaching up into the evaluation scripts
        (
            "train/intentkv_head.py",
            "import eval.quality.harness",
            "train/ never imports eval/",
            "train.intentkv_head -> eval.quality.harness",
        ),
        # a model importing a kernel module directly
        (
            "jaxkv/models/weights.py",
            "import jaxkv.kernels.quant",
            "models import no kernels",
            "jaxkv.models.weights -> jaxkv.kernels.quant",
        ),
    ],
)
def test_an_upward_import_breaks_a_contract(tmp_path, module, line, contract, chain):
    """One import added against the map, inside a function (imports there count
    too), fails ``lint-imports``, which names the contract and the import."""
    root = copy_sources(tmp_path)
    path = root / module
    path.write_text(path.read_text() + f"\n\ndef _upward():\n    {line}  # noqa\n")
    run = lint_imports(root)
    assert run.returncode != 0, run.stdout
    report = run.stdout.split("Broken contracts", 1)[-1]
    assert contract in report and chain in report, run.stdout


@pytest.mark.parametrize(
    "module", sorted(str(p.relative_to(PACKAGE)) for p in [*(PACKAGE / "engine").glob("*.py"), PACKAGE / "forward.py"])
)
def test_the_engine_never_branches_on_the_pool_kind(module):
    """The engine (``jaxkv/engine/``) and its forward call the pool interface
    (``jaxkv.cache.pools``) and the attention backend (``jaxkv.backends``) and never
    test which pool they hold: no condition reads a quantization mode or a pool
    class, and they import no quantized-pool module."""
    tree = ast.parse((PACKAGE / module).read_text())
    words = {
        "quant",
        "kv_quant",
        "kv_step",
        "kv_op",
        "token_kind",
        "QuantizedKV",
        "FloatKV",
        "DualPool",
        "QuantizedKVCache",
        "PagedKVCache",
    }
    conditions = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    conditions += [v for n in ast.walk(tree) if isinstance(n, ast.BoolOp) for v in n.values]
    named = sorted(
        {
            ast.unparse(c)
            for c in conditions
            for sub in ast.walk(c)
            if isinstance(sub, (ast.Name, ast.Attribute)) and (sub.id if isinstance(sub, ast.Name) else sub.attr) in words
        }
    )
    assert named == [], named
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if "quantized" in m}, imported


def test_no_jaxkv_module_is_over_800_lines():
    """The house rule of the engine redesign (issue 73): a module that grows past
    800 lines (as ``ruff format`` lays it out) is split by what its parts are for."""
    root = Path(__file__).resolve().parent.parent / "jaxkv"
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert sizes and max(sizes.values()) <= 800, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
