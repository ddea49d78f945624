"""The evaluation notebooks (``eval/notebooks/*.py``, jupytext percent scripts stored
without outputs) run under papermill on the CPU with their default (small) parameters
and one example per cell (``n=1``), with fewer cells and shorter conversations (``SMALL``),
and produce their table and plots; every parameter is documented for the A100 run.

A fresh clone has no Jupyter kernel registered, so the tests write a kernelspec that
runs ``ipykernel`` in this interpreter and point ``JUPYTER_PATH`` at it."""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from pathlib import Path

import jupytext
import papermill
import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "eval" / "notebooks"
KERNEL = "jaxkv-tests"
# notebook -> (files it must write, a header of the table it must display)
EXPECTED = {
    "retention": (("results.csv", "results.md", "accuracy_vs_budget.png", "kv_reads_vs_budget.png"), "| method |"),
    "repair": (("results.csv", "results.md", "repair_vs_k.png", "figure2.png"), "| K | repairkv |"),
}
# Smaller than the notebooks' CPU defaults, for the suite's time: one example per cell,
# shorter conversations and replies, and the fewest cells that still fill every table
# and plot: the full cache and one method at one budget in one layout (retention); the
# full cache, B_base, and RepairKV with its matched no-repair at one K (repair). The
# defaults themselves are what a user runs.
SMALL = {
    "retention": {"methods": "full,snapkv", "budgets": "192", "layouts": "dead_slot", "length": 256, "max_new_tokens": 8},
    "repair": {"ks": "16", "policies": "repairkv", "length": 300, "max_new_tokens": 8},
}


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernelspec for this interpreter, found through ``JUPYTER_PATH``."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "jaxkv tests",
                "language": "python",
                "env": {"JAX_PLATFORMS": "cpu"},
            }
        )
    )
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(root)] + ([old] if old else []))
    yield KERNEL
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


def _parameters(notebook) -> dict:
    """The parameter cell's assignments ``{name: default}``."""
    (cell,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    return {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_is_stored_without_outputs_and_documents_every_parameter(name):
    path = NOTEBOOKS / f"{name}.py"
    notebook = jupytext.read(path)
    params = _parameters(notebook)
    assert {"model", "dtype", "tp", "n", "out_dir"} <= set(params) and params["model"] == "embedded"
    docs = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    a100 = docs[docs.index("one A100") :]
    for param in params:
        assert f"| `{param}` |" in a100, f"{name}: parameter {param} has no A100 row"
    assert not any(c.get("outputs") for c in notebook.cells if c.cell_type == "code")
    assert not (NOTEBOOKS / f"{name}.ipynb").exists()  # the .py is the stored form


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs_on_the_cpu_and_shows_its_table_and_plots(name, kernel, tmp_path):
    out_dir = tmp_path / "out"
    source = jupytext.read(NOTEBOOKS / f"{name}.py")
    t0 = time.perf_counter()
    executed = papermill.execute_notebook(
        source,
        str(tmp_path / f"{name}.ipynb"),
        parameters={"out_dir": str(out_dir), "n": 1, **SMALL[name]},
        kernel_name=kernel,
        cwd=str(REPO),
        progress_bar=False,
        execution_timeout=600,
    )
    print(f"\n{name} notebook: {time.perf_counter() - t0:.1f} s")
    files, header = EXPECTED[name]
    for f in files:
        assert (out_dir / f).stat().st_size > 0, f
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)
    tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert any(header in t for t in tables), tables
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == len([f for f in files if f.endswith(".png")])
    printed = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "decode kernels: reference" in printed  # the CPU runs the jnp reference
