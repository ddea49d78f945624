"""The device check (``eval/device/check.py``) without a device: its CPU dry run end to
end, its report writer on a recorded result, and its per-part watchdog."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.device import check as device_check, report as device_report

REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "data" / "device_check_results.json"


def _row_line(text: str, *cells: str) -> str:
    """The report line of the table row starting with ``cells``."""
    start = "| " + " | ".join(cells) + " |"
    lines = [line for line in text.splitlines() if line.startswith(start)]
    assert len(lines) == 1, (start, lines)
    return lines[0]


@pytest.mark.slow
def test_dry_run_writes_every_table_marked_dry_run(tmp_path):
    out = tmp_path / "report.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "eval.device.check", "--dry-run", "--out", str(out), "--logs", str(tmp_path / "logs")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    results = json.loads(out.with_suffix(".json").read_text())
    assert text in proc.stdout  # printed as well as written
    assert text.startswith("# jaxkv device check: cpu (dry run)") and "no number below measures a GPU" in text
    for table in device_report.TABLES:
        assert device_report.heading(table.title, True) + "\n" in text, table.title
    assert text.count(f"({device_report.DRY_RUN_MARK})\n") == len(device_report.TABLES) + 1  # every table and the title

    parts = results["parts"]
    assert list(parts) == [p.name for p in device_check.PARTS]
    assert {name: p["status"] for name, p in parts.items()} == {p.name: "ok" for p in device_check.PARTS}
    assert all(p["seconds"] <= p["limit_s"] for p in parts.values())
    assert not any(p["info"].get("errors") for p in parts.values()), [p["info"].get("errors") for p in parts.values()]
    env_info = parts["env"]["info"]
    assert env_info["copy_bandwidth"] > 0 and env_info["matmul_flops"] > 0 and env_info["versions"]["jax"]
    # every check ran through the Triton interpreter and passed its bound
    kernels = parts["kernels"]["rows"]
    assert len(kernels) == len(device_check.kernel_checks(device_check.DRY_RUN)) and all(r["passed"] for r in kernels)
    # every timing and every baseline was measured
    for key, fields in (("attention", ("kernel_s", "xla_s")), ("ragged", ("kernel_s", "flops", "executed_flops")),
                        ("decode", ("jaxkv_tok_s", "hf_loop_tok_s", "hf_generate_tok_s")),
                        ("prefill", ("jaxkv_s", "jaxkv_first_s", "hf_all_s", "hf_last_s", "programs")),
                        ("quant", ("s_per_token", "kv_bytes"))):  # fmt: skip
        rows = device_report._rows(results, key)
        assert rows and all(r[f] > 0 for r in rows for f in fields), (key, rows)
    assert [r["kernel"] for r in device_report._rows(results, "attention")] == ["decode bf16", "decode INT4", "decode mixed 2.7b"]
    assert {r["pool"].split(" ")[0] for r in device_report._rows(results, "quant")} == {"float", "int4", "triaxial"}
    assert "(not measured)" not in text and "## Failures" not in text
    assert device_report.render(results) == text  # the report is a function of the recorded results


def test_report_from_recorded_results():
    """Every table from a recorded (fixture) result; derived columns computed from it;
    unfinished parts, failed checks and errors marked."""
    results = json.loads(FIXTURE.read_text())
    before = copy.deepcopy(results)
    text = device_report.render(results)
    assert results == before and device_report.render(results) == text  # pure
    for table in device_report.TABLES:
        assert device_report.heading(table.title, False) + "\n" in text
    assert device_report.DRY_RUN_MARK not in text

    env = results["parts"]["env"]["info"]
    bw = env["copy_bandwidth"]
    assert "| triton | 3.6.0 |" in text and "| torch | not installed |" in text and "| driver | 999.1 |" in text
    # attention: floor = bytes / copy bandwidth; floor / Triton; XLA / Triton
    att = results["parts"]["attention"]["rows"][0]
    floor = att["bytes"] / bw
    line = _row_line(text, "decode bf16", "32768", "8")
    assert f"| {floor * 1e6:.1f} | {att['kernel_s'] * 1e6:.1f} | {floor / att['kernel_s']:.0%} |" in line
    assert f"| {att['xla_s'] / att['kernel_s']:.2f}x |" in line
    assert "n/a (BackendUnavailableError: fixture)" in _row_line(text, "decode INT4", "32768", "8")
    # decode: ratio against the faster transformers loop; floor tok/s = batch * bw / bytes per step
    dec = results["parts"]["e2e"]["rows"][0]
    line = _row_line(text, "1", "512")
    ref = max(dec["hf_loop_tok_s"], dec["hf_generate_tok_s"])
    assert f"| {dec['jaxkv_tok_s'] / ref:.2f}x | {bw / dec['bytes_per_step']:.0f} |" in line
    assert "| 600.0 | n/a | 4.00x |" in _row_line(text, "8", "4096")  # a missing baseline: the other one
    # quant: speed and bytes relative to the float pool of the same context
    fl, i4 = results["parts"]["quant"]["rows"][:2]
    line = _row_line(text, "32768", "1", "int4")
    assert f"| {fl['s_per_token'] / i4['s_per_token']:.2f}x |" in line and f"| {i4['kv_bytes'] / fl['kv_bytes']:.2f}x |" in line
    # unfinished parts, failures
    assert "> **Part `e2e`: timed out** after 180 s: killed at its 180 s limit" in text
    assert "> **Part `attention`: stopped at deadline**" in text and "(stopped before 4096 tokens x 8)" in text
    titles = {t.key: t.title for t in device_report.TABLES}
    prefill = text.split(device_report.heading(titles["prefill"], False))[1].split("## ")[0]
    assert "(not measured)" in prefill
    assert "**FAIL**" in _row_line(text, "decode masked INT2 pages + float part")
    assert "ERROR: XlaRuntimeError: INTERNAL: fixture failure" in _row_line(text, "INT4 quantizing write")
    failures = text.split("## Failures")[1]
    assert "compiling decode for batch 32" in failures and "hf_generate_tok_s (table decode, batch 8, ctx 4096)" in failures
    assert "1/3 kernel checks pass" in text and "not finished: `attention` (stopped at deadline), `e2e` (timed out)" in text


def test_ragged_rows_report_their_share_of_the_matmul_rate():
    """Ragged rows recorded by the attention part: TFLOP/s = flops / seconds, its share
    of the bf16 matmul rate ``env`` measured, and the roofline share (bytes over the
    copy bandwidth or flops over the matmul rate, whichever is slower); the headline
    quotes the largest prefill."""
    results = json.loads(FIXTURE.read_text())
    env = results["parts"]["env"]["info"]
    rows = [row for row, _ in device_check.ragged_steps(device_check.DEVICE)]
    assert [r["step"] for r in rows[:1]] == ["prefill 8192 tokens in 2048-token chunks"] and rows[-1]["step"].startswith("mixed")
    rows[0].update(kernel_s=0.002, kernel_error=None)
    rows[-1].update(kernel_s=0.0005, kernel_error=None)
    rows[1].update(kernel_s=None, kernel_error="BackendUnavailableError: fixture")
    results["parts"]["attention"]["rows"] += rows
    text = device_report.render(results)
    big, mixed = rows[0], rows[-1]
    line = _row_line(text, "Llama-3-8B", "32/8 x 128", big["step"], "4")
    rate = big["flops"] / big["kernel_s"]
    assert f"| {rate * 1e-12:.1f} | {rate / env['matmul_flops']:.0%} | {big['flops'] / env['matmul_flops'] / big['kernel_s']:.0%} |" in line
    line = _row_line(text, "Llama-3-8B", "32/8 x 128", mixed["step"], "1")
    floor = max(mixed["bytes"] / env["copy_bandwidth"], mixed["flops"] / env["matmul_flops"])
    assert line.endswith(f"| {floor / mixed['kernel_s']:.0%} |")
    assert "n/a (BackendUnavailableError: fixture)" in _row_line(text, "SmolLM2-135M", "9/3 x 64", rows[1]["step"])
    assert f"ragged prefill (Llama-3-8B, 8192 tokens in 2048-token chunks) at {rate * 1e-12:.0f} TFLOP/s" in text
    # the decode table keeps its own rows only
    assert [r["kernel"] for r in device_report._rows(results, "attention")] == [
        r["kernel"] for r in results["parts"]["attention"]["rows"] if "table" not in r
    ]


def test_ragged_costs_count_a_causal_prompt():
    """A prompt's calls add up to the causal work of the whole prompt: each query head
    sees its position + 1 entries, ``4 D + 5`` flops each."""
    for row, calls in device_check.ragged_steps(device_check.DEVICE):
        K, G, D = row["Hkv"], row["G"], row["D"]
        if row["step"].startswith("prefill"):
            tokens = calls[-1][0][1]
            assert row["flops"] == K * G * (4 * D + 5) * tokens * (tokens + 1) // 2
            assert row["flops"] <= row["executed_flops"] <= 1.2 * row["flops"]


def test_prefill_rows_show_their_compiles_and_why_a_row_was_skipped():
    """A prefill row recorded with its program count and first call shows both; a row the
    e2e part skipped (its compiles predicted past the time left) says why."""
    results = json.loads(FIXTURE.read_text())
    rows = results["parts"]["e2e"]["rows"]
    rows.append(dict(table="prefill", tokens=2048, flops=1e12, programs=4, jaxkv_first_s=50.4, jaxkv_s=0.0436, hf_all_s=0.0217))
    rows.append(dict(table="prefill", tokens=8192, flops=4e12, programs=16, skipped="16 programs to compile at ~12 s each"))
    text = device_report.render(results)
    assert "| 4 | 50.4 |  |" in _row_line(text, "2048", "43.60")
    assert _row_line(text, "8192", "n/a").endswith("| 16 | n/a | skipped: 16 programs to compile at ~12 s each |")


def test_prefill_programs_counts_the_programs_a_fresh_engine_compiles():
    """``bench_prefill.prefill_programs`` (what the device check predicts compile time
    from) equals the step programs a fresh engine adds for one prompt: one per token
    bucket of its pieces, however long the prompt (live lengths are data)."""
    import jax

    import jaxkv
    from eval.bench.prefill import prefill_programs
    from jaxkv.engine import Engine
    from jaxkv.forward import run_step

    model = jaxkv.load_model("embedded")
    # positions no other test uses, so every program is new: 200 tokens are 3 x 64 + 8
    # (buckets 80 and 16 of a 65-token budget), 240 are 7 x 32 + 16 (32 and 16)
    for T, chunk in ((200, 64), (240, 32)):
        engine = Engine(model, rows=1, max_positions=T, num_slots=T + 1, prefill_chunk=chunk)
        before = run_step._cache_size()
        row = engine.open_row()
        engine.prefill([row], [list(range(1, T + 1))])
        jax.block_until_ready(engine.cache.k)
        assert run_step._cache_size() - before == prefill_programs(T, chunk) == 2, (T, chunk)
    assert prefill_programs(8192, 512) == prefill_programs(8000, 512) == 1 and prefill_programs(600, 512) == 2


def test_render_command_rewrites_the_report(tmp_path, capsys):
    out = tmp_path / "again.md"
    text = device_check.main(["--render", str(FIXTURE), "--out", str(out)])
    assert out.read_text() == text == device_report.render(json.loads(FIXTURE.read_text()))
    assert text in capsys.readouterr().out


def test_watchdog_kills_a_part_past_its_limit(tmp_path):
    """A part still running at its limit is killed (its whole process group) and marked;
    the check goes on with what it had recorded."""
    part = device_check.PARTS_BY_NAME["env"]
    entry = device_check.run_part(part, dry_run=True, limit_s=0.5, logs=tmp_path)  # jax alone imports longer
    assert entry["status"] == "timed out" and entry["seconds"] < 10
    assert entry["error"].startswith("exit code -9") and entry["rows"] == []
    results = {"dry_run": True, "parts": {"env": entry}}
    assert "> **Part `env`: timed out**" in device_report.render(results)


def test_failed_part_is_marked_with_its_error(tmp_path):
    """Without --dry-run the parts ask JAX for CUDA: on a CPU-only jaxlib the part fails,
    and the report carries its error instead of numbers."""
    part = device_check.PARTS_BY_NAME["env"]
    entry = device_check.run_part(part, dry_run=False, limit_s=120, logs=tmp_path)
    if entry["status"] == "ok":
        pytest.skip("this machine has a CUDA device")
    assert entry["status"] == "failed" and "JAX found no CUDA device" in entry["error"]
    text = device_report.render({"dry_run": False, "parts": {"env": entry}})
    assert "> **Part `env`: failed**" in text and "## Failures" in text


def test_recorder_keeps_each_row_as_it_comes(tmp_path):
    """What a killed part leaves behind: every row recorded before the kill."""
    rec = device_check.Recorder(tmp_path / "part.json", limit_s=100)
    rec.add({"n": 1})
    row = rec.add({"n": 2})
    rec.measure(row, "x_s", lambda: 0.5)
    rec.measure(row, "y_s", lambda: 1 / 0)
    saved = json.loads((tmp_path / "part.json").read_text())
    assert saved["rows"] == [{"n": 1}, {"n": 2, "x_s": 0.5, "y_s": None}]
    assert saved["info"]["errors"] == ["y_s (n 2): ZeroDivisionError: division by zero"]
    assert not rec.out_of_time("next") and device_check.Recorder(tmp_path / "b.json", limit_s=0).out_of_time("next")
