"""The device check's report: a pure function from its results to markdown.

``render(results) -> str`` writes every table of ``eval/device/check.py``'s report
from the results dict that script records (also saved beside the report as JSON,
so a report can be re-rendered: ``python -m eval.device.check --render FILE.json``).
Nothing here imports jax or touches a device; derived columns (floors, fractions,
ratios) are computed here from the recorded measurements, so a recorded result and
a fresh run give the same report. The one table writer, ``jaxkv.markdown``, is read
from its file rather than imported through the package: ``import jaxkv`` would bring
jax, flax and transformers (seconds of CPU) into the check's parent process, which
only starts parts and writes this report; the module imports nothing itself.

Results (every number in SI units: bytes, seconds, bytes/s, flop/s)::

    {"dry_run": bool, "started": "2026-11-25 19:00:00 UTC", "command": str,
     "budget_s": float, "seconds": float,
     "parts": {NAME: {"limit_s": float, "seconds": float, "status": STATUS,
                      "error": str | None, "info": {...}, "rows": [{...}, ...]}}}

``STATUS`` is one of ``STATUSES``. ``NAME`` is one of ``TABLES``' parts; what
``info`` and ``rows`` hold per part is listed beside each table function below
(``info["caption"]`` and ``info["<table>_caption"]`` are printed above a table,
``info["errors"]`` under Failures).
A part that did not finish keeps the rows it recorded, and its table says so.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys


def _md_table():
    """``jaxkv.markdown.md_table`` without running ``jaxkv/__init__`` (see the module docstring)."""
    if "jaxkv.markdown" in sys.modules:
        return sys.modules["jaxkv.markdown"].md_table
    package = importlib.util.find_spec("jaxkv")  # finds the package without importing it
    spec = importlib.util.spec_from_file_location("_jaxkv_markdown", f"{package.submodule_search_locations[0]}/markdown.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.md_table


md_table = _md_table()

STATUSES = ("ok", "stopped at deadline", "timed out", "failed", "not run")


@dataclasses.dataclass(frozen=True)
class Table:
    """One table of the report: ``key`` names its writer, ``part`` the part whose rows
    (those with ``row["table"] == key`` when a part fills several tables; untagged
    rows go to the table named after the part) and status it shows (None: the table
    of all parts)."""

    key: str
    part: str | None
    title: str


TABLES = (
    Table("env", "env", "Device and versions"),
    Table("parts", None, "Parts and time limits"),
    Table("kernels", "kernels", "Kernel correctness: native Triton vs the jnp reference and a float64 oracle"),
    Table("attention", "attention", "Decode attention per kernel: Triton vs the copy-bandwidth floor and plain jnp under XLA"),
    Table("ragged", "attention", "Ragged paged attention (prefill chunks and mixed steps): Triton vs the bf16 matmul rate"),
    Table("decode", "e2e", "End-to-end decode: jaxkv vs transformers, same weights, same device"),
    Table("prefill", "e2e", "Prefill: jaxkv vs transformers, same weights, same device"),
    Table("quant", "quant", "Quantized KV pool vs float pool, per decode token"),
)
TABLE_PART = {t.key: t.part for t in TABLES}
DRY_RUN_MARK = "dry run"


def heading(title: str, dry_run: bool) -> str:
    return f"## {title}" + (f" ({DRY_RUN_MARK})" if dry_run else "")


def _num(x, fmt: str = ".2f", scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x * scale, fmt)


def _ratio(a, b, fmt: str = ".2f", suffix: str = "x") -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return format(a / b, fmt) + suffix


def _pct(a, b) -> str:
    return _ratio(a, b, ".0%", "")


def _env(results) -> dict:
    return results["parts"].get("env", {}).get("info", {})


def _rows(results, table: str) -> list[dict]:
    """The rows of ``table``: its part's rows that belong to it (a row without a
    ``table`` belongs to the table named after its part)."""
    part = TABLE_PART[table]
    rows = results["parts"].get(part, {}).get("rows", [])
    return [r for r in rows if r.get("table", part) == table]


def _status_note(name: str, part: dict) -> list[str]:
    """A line above a table whose part did not finish cleanly."""
    status = part.get("status", "not run")
    if status == "ok":
        return []
    took = f" after {part['seconds']:.0f} s" if part.get("seconds") is not None else ""
    what = {
        "stopped at deadline": "it stopped itself before its time limit; rows below are those it finished",
        "timed out": f"killed at its {part.get('limit_s', 0):.0f} s limit; rows below are those it finished",
        "failed": "rows below are those it finished before the error",
        "not run": "nothing was measured",
    }[status]
    note = [f"> **Part `{name}`: {status}**{took}: {what}" + (f" ({part['stopped']})." if part.get("stopped") else ".")]
    if part.get("error"):
        note.append(f"> Error: `{part['error'].strip().splitlines()[-1][:300]}` (full text under Failures).")
    return note + [""]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A table of ``rows``; a part that measured nothing says so in a row of its own."""
    rows = rows or [["(not measured)"] + [""] * (len(header) - 1)]
    return md_table(header, rows).split("\n")


# ----------------------------------------------------------------------------- tables
def env_table(results) -> list[str]:
    """info: device, platform, driver, memory, compute_capability, python, versions
    {package: version or None}, jaxkv_commit, kernel_backend (+ kernel_backend_note),
    copy_bandwidth (bytes/s, read + written), matmul_flops (bf16 matmul flop/s) and matmul_shape."""
    info = _env(results)
    versions = info.get("versions", {})
    rows = [
        ["device", str(info.get("device", "n/a"))],
        ["JAX platform", str(info.get("platform", "n/a"))],
        ["driver", str(info.get("driver", "n/a"))],
        ["memory", str(info.get("memory", "n/a"))],
        ["compute capability", str(info.get("compute_capability", "n/a"))],
        ["python", str(info.get("python", "n/a"))],
    ]
    rows += [[name, str(v) if v else "not installed"] for name, v in versions.items()]
    rows += [
        ["jaxkv commit", str(info.get("jaxkv_commit", "n/a"))],
        ["decode kernels (`resolve_backend(None)`)", str(info.get("kernel_backend", "n/a"))
         + (f": {info['kernel_backend_note']}" if info.get("kernel_backend_note") else "")],
        ["copy bandwidth (read + written)", f"{_num(info.get('copy_bandwidth'), '.1f', 1e-9)} GB/s"],
        [f"bf16 matmul ({info.get('matmul_shape', 'n/a')})", f"{_num(info.get('matmul_flops'), '.1f', 1e-12)} TFLOP/s"],
    ]  # fmt: skip
    return _table(["what", "value"], rows)


def parts_table(results) -> list[str]:
    """One row per part: what it measures, its limit, the time it took, its status."""
    rows = []
    for name, part in results["parts"].items():
        took = _num(part.get("seconds"), ".1f")
        rows.append([f"`{name}`", part.get("what", ""), _num(part.get("limit_s"), ".0f"), took, part.get("status", "not run")])
    planned = sum(p.get("limit_s") or 0 for p in results["parts"].values())
    rows.append(["all", f"the limits above add up to {planned:.0f} s", _num(results.get("budget_s"), ".0f"),
                 _num(results.get("seconds"), ".1f"), ""])  # fmt: skip
    return _table(["part", "measures", "limit s", "took s", "status"], rows)


def kernels_table(results) -> list[str]:
    """rows: kernel, shape, vs_reference, vs_f64 (None where no oracle), bound (text),
    passed (bool), note (text or None), error (text or None: the check raised)."""
    rows = []
    for r in _rows(results, "kernels"):
        if r.get("error"):
            result = f"ERROR: {r['error'][:200]}"
        else:
            result = "pass" if r.get("passed") else "**FAIL**"
        rows.append([r["kernel"], r["shape"], _num(r.get("vs_reference"), ".2e"), _num(r.get("vs_f64"), ".2e"),
                     r.get("bound", ""), result, r.get("note") or ""])  # fmt: skip
    return _table(["kernel", "shape", "error vs jnp reference", "error vs float64", "bound", "result", "note"], rows)


def attention_table(results) -> list[str]:
    """rows: kernel, ctx, batch, bytes (that must move), kernel_s and xla_s (seconds per
    call, None if not measured), kernel_error (text or None). info: heads, chain, reps."""
    bw = _env(results).get("copy_bandwidth")
    rows = []
    for r in _rows(results, "attention"):
        floor = r["bytes"] / bw if bw else None
        t, x = r.get("kernel_s"), r.get("xla_s")
        kernel = _num(t, ".1f", 1e6) if not r.get("kernel_error") else f"n/a ({r['kernel_error'][:80]})"
        rows.append([r["kernel"], str(r["ctx"]), str(r["batch"]), _num(r["bytes"], ".1f", 1e-6), _num(floor, ".1f", 1e6),
                     kernel, _pct(floor, t), _num(x, ".1f", 1e6), _ratio(x, t)])  # fmt: skip
    return _table(["kernel", "live tokens", "batch", "MB moved", "floor us", "Triton us", "floor / Triton",
                   "XLA jnp us", "Triton speedup over XLA"], rows)  # fmt: skip


def ragged_table(results) -> list[str]:
    """Part attention, rows with ``table: "ragged"``: model, heads (``"Hq/Hkv x D"``),
    step (words), calls, flops and executed_flops (causal work, and with the tiles'
    padding: ``jaxkv.kernels.cost.ragged``), bytes (compulsory), kernel_s (seconds for
    all the calls; None if not measured), kernel_error (text or None)."""
    env = _env(results)
    peak, bw = env.get("matmul_flops"), env.get("copy_bandwidth")
    rows = []
    for r in _rows(results, "ragged"):
        t = r.get("kernel_s")
        rate = r["flops"] / t if t else None
        floor = max(r["bytes"] / bw, r["flops"] / peak) if bw and peak else None
        kernel = _num(t, ".3f", 1e3) if not r.get("kernel_error") else f"n/a ({r['kernel_error'][:80]})"
        rows.append([r["model"], r["heads"], r["step"], str(r["calls"]),
                     f"{_num(r['flops'], '.1f', 1e-9)} ({_num(r['executed_flops'], '.1f', 1e-9)})", kernel,
                     _num(rate, ".1f", 1e-12), _pct(rate, peak), _pct(floor, t)])  # fmt: skip
    return _table(["model", "Hq/Hkv x D", "step", "calls", "GFLOP (executed)", "Triton ms", "TFLOP/s",
                   "% bf16 matmul", "roofline %"], rows)  # fmt: skip


def decode_table(results) -> list[str]:
    """Part e2e, rows with ``table: "decode"``: batch, ctx, jaxkv_tok_s, hf_loop_tok_s, hf_generate_tok_s, bytes_per_step
    (weights + the batch's KV)."""
    bw = _env(results).get("copy_bandwidth")
    rows = []
    for r in _rows(results, "decode"):
        ours = r.get("jaxkv_tok_s")
        ref = max([x for x in (r.get("hf_loop_tok_s"), r.get("hf_generate_tok_s")) if x is not None], default=None)
        floor = r["batch"] * bw / r["bytes_per_step"] if bw else None
        rows.append([str(r["batch"]), str(r["ctx"]), _num(ours, ".1f"), _num(r.get("hf_loop_tok_s"), ".1f"),
                     _num(r.get("hf_generate_tok_s"), ".1f"), _ratio(ours, ref), _num(floor, ".0f"),
                     _pct(ours, floor), _pct(ref, floor)])  # fmt: skip
    return _table(["batch", "context", "jaxkv tok/s", "transformers loop tok/s", "transformers generate tok/s",
                   "jaxkv / faster transformers", "floor tok/s", "jaxkv % floor", "transformers % floor"], rows)  # fmt: skip


def prefill_table(results) -> list[str]:
    """Part e2e, rows with ``table: "prefill"``: tokens, jaxkv_s, hf_all_s (all logits), hf_last_s (last logit), flops
    (matmul work of the prefill, last logit only); where recorded, programs (prefill programs a fresh engine compiles
    for the prompt), jaxkv_first_s (its first call: those compiles and one run) and skipped (why the row was not run)."""
    peak = _env(results).get("matmul_flops")
    rows = []
    for r in _rows(results, "prefill"):
        ours = r.get("jaxkv_s")
        ref = min([x for x in (r.get("hf_all_s"), r.get("hf_last_s")) if x is not None], default=None)
        rate = r["flops"] / ours if ours else None
        programs = r.get("programs")
        rows.append([str(r["tokens"]), _num(ours, ".2f", 1e3), _num(r.get("hf_all_s"), ".2f", 1e3),
                     _num(r.get("hf_last_s"), ".2f", 1e3), _ratio(ref, ours), _num(rate, ".1f", 1e-12),
                     _pct(rate, peak), "n/a" if programs is None else str(programs), _num(r.get("jaxkv_first_s"), ".1f"),
                     f"skipped: {r['skipped']}" if r.get("skipped") else ""])  # fmt: skip
    return _table(["tokens", "jaxkv ms", "transformers ms, all logits", "transformers ms, last logit",
                   "faster transformers / jaxkv", "jaxkv TFLOP/s", "jaxkv % bf16 matmul", "programs compiled",
                   "jaxkv first call s", "note"], rows)  # fmt: skip


def quant_table(results) -> list[str]:
    """rows: ctx, batch, pool ("float", "int4", "triaxial"), s_per_token (seconds per
    decode step), kv_bytes (KV bytes one step reads). The ``vs float`` columns divide
    by the float row of the same ctx and batch. info: model, backend, steps."""
    rows_in = _rows(results, "quant")
    floats = {(r["ctx"], r["batch"]): r for r in rows_in if r["pool"] == "float"}
    rows = []
    for r in rows_in:
        base = floats.get((r["ctx"], r["batch"]), {})
        t = r.get("s_per_token")
        rows.append([str(r["ctx"]), str(r["batch"]), r["pool"], _num(t, ".3f", 1e3), _ratio(base.get("s_per_token"), t),
                     _num(r.get("kv_bytes"), ".1f", 1 / 2**20), _ratio(r.get("kv_bytes"), base.get("kv_bytes"))])  # fmt: skip
    return _table(["live tokens", "batch", "pool", "ms per token", "speedup vs float", "KV MiB read / step",
                   "bytes vs float"], rows)  # fmt: skip


TABLE_WRITERS = {
    "env": env_table, "parts": parts_table, "kernels": kernels_table, "attention": attention_table,
    "ragged": ragged_table, "decode": decode_table, "prefill": prefill_table, "quant": quant_table,
}  # fmt: skip


def _caption(table: Table, results) -> list[str]:
    """What the table's part ran on (model, backend, shapes) and how it timed, from its info."""
    info = results["parts"].get(table.part, {}).get("info", {})
    text = " ".join(c for c in (info.get("caption"), info.get(f"{table.key}_caption")) if c)
    return [text, ""] if text else []


def headline(results) -> str:
    """One paragraph of the numbers that matter most, from what was measured."""
    parts = results["parts"]
    bits = []
    checks = _rows(results, "kernels")
    if checks:
        bits.append(f"{sum(bool(r.get('passed')) for r in checks)}/{len(checks)} kernel checks pass")
    bw = _env(results).get("copy_bandwidth")
    att = [r for r in _rows(results, "attention") if r["kernel"] == "decode bf16" and r.get("kernel_s")]
    if att and bw:
        r = max(att, key=lambda r: r["bytes"])
        bits.append(f"bf16 decode attention at {r['ctx']} tokens x {r['batch']} runs at "
                    f"{_pct(r['bytes'] / bw, r['kernel_s'])} of the copy floor, {_ratio(r.get('xla_s'), r['kernel_s'])} XLA's jnp")  # fmt: skip
    rag = [r for r in _rows(results, "ragged") if r.get("kernel_s") and r["step"].startswith("prefill")]
    peak = _env(results).get("matmul_flops")
    if rag:
        r = max(rag, key=lambda r: r["flops"])
        bits.append(f"ragged prefill ({r['model']}, {r['step'].removeprefix('prefill ')}) at "
                    f"{_num(r['flops'] / r['kernel_s'], '.0f', 1e-12)} TFLOP/s, {_pct(r['flops'] / r['kernel_s'], peak)} "
                    "of the bf16 matmul rate")  # fmt: skip
    dec = [r for r in _rows(results, "decode") if r.get("jaxkv_tok_s")]
    if dec:
        r = max(dec, key=lambda r: (r["batch"], r["ctx"]))
        ref = max([x for x in (r.get("hf_loop_tok_s"), r.get("hf_generate_tok_s")) if x is not None], default=None)
        bits.append(f"decode b{r['batch']} ctx {r['ctx']}: jaxkv {_ratio(r['jaxkv_tok_s'], ref)} transformers")
    pre = [r for r in _rows(results, "prefill") if r.get("jaxkv_s")]
    if pre:
        r = max(pre, key=lambda r: r["tokens"])
        ref = min([x for x in (r.get("hf_all_s"), r.get("hf_last_s")) if x is not None], default=None)
        bits.append(f"prefill {r['tokens']}: jaxkv {_ratio(ref, r['jaxkv_s'])} transformers' speed")
    quant = [r for r in _rows(results, "quant") if r.get("s_per_token")]
    floats = {r["ctx"]: r for r in quant if r["pool"] == "float"}
    if floats:
        ctx = max(floats)
        speeds = [f"{r['pool'].split(' ')[0]} {_ratio(floats[ctx]['s_per_token'], r['s_per_token'])}"
                  for r in quant if r["ctx"] == ctx and r["pool"] != "float"]  # fmt: skip
        if speeds:
            bits.append(f"quantized pools at {ctx} tokens, speed vs the float pool: " + ", ".join(speeds))
    not_ok = [n for n, p in parts.items() if p.get("status") != "ok"]
    if not_ok:
        bits.append("not finished: " + ", ".join(f"`{n}` ({parts[n].get('status')})" for n in not_ok))
    return "; ".join(bits) + "." if bits else "Nothing was measured."


def render(results) -> str:
    """The whole report (markdown)."""
    dry = bool(results.get("dry_run"))
    device = _env(results).get("device", "unknown device")
    lines = [f"# jaxkv device check: {device}" + (f" ({DRY_RUN_MARK})" if dry else ""), ""]
    if dry:
        lines += ["**Dry run**: tiny shapes on the CPU, Triton kernels in the Triton interpreter, jnp references "
                  "under XLA:CPU. It proves the check runs end to end; no number below measures a GPU.", ""]  # fmt: skip
    lines += [f"Run {results.get('started', 'n/a')} by `{results.get('command', 'n/a')}`; "
              f"{_num(results.get('seconds'), '.0f')} s of a planned {_num(results.get('budget_s'), '.0f')} s.", "",
              f"**Headline**: {headline(results)}", ""]  # fmt: skip
    for table in TABLES:
        lines += [heading(table.title, dry), ""]
        if table.part is not None:
            lines += _status_note(table.part, results["parts"].get(table.part, {}))
            lines += _caption(table, results)
        lines += TABLE_WRITERS[table.key](results) + [""]
    errors = [(n, p["error"]) for n, p in results["parts"].items() if p.get("error")]
    errors += [(n, e) for n, p in results["parts"].items() for e in p.get("info", {}).get("errors", [])]
    if errors:
        lines += ["## Failures", ""]
        for name, err in errors:
            lines += [f"`{name}`:", "", "```", err.strip(), "```", ""]
    return "\n".join(lines)
