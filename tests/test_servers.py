"""``eval.common.servers``: the benches' one server runner and ``/metrics`` reader,
on a stand-in server (``python -m http.server``), no jaxkv process."""

from __future__ import annotations

import sys

import pytest

from eval.common.servers import ServerProcess, free_port, metric, port_in_use

pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

EXPOSITION = """\
# HELP jaxkv_engine_seconds Busy seconds by phase.
# TYPE jaxkv_engine_seconds counter
jaxkv_engine_seconds_total{phase="prefill"} 1.5
jaxkv_engine_seconds_total{phase="decode"} 2.25
# HELP jaxkv_decode_steps Decode calls.
# TYPE jaxkv_decode_steps counter
jaxkv_decode_steps_total 7.0
# HELP jaxkv_warmup_programs Programs the warm-up compiled.
# TYPE jaxkv_warmup_programs gauge
jaxkv_warmup_programs 12.0
"""


def test_metric_reads_samples_by_name_and_labels():
    assert metric(EXPOSITION, "jaxkv_engine_seconds_total", phase="decode") == 2.25
    assert metric(EXPOSITION, "jaxkv_engine_seconds_total", phase="prefill") == 1.5
    assert metric(EXPOSITION, "jaxkv_decode_steps_total") == 7.0 and metric(EXPOSITION, "jaxkv_warmup_programs") == 12.0
    with pytest.raises(KeyError):
        metric(EXPOSITION, "jaxkv_engine_seconds_total", phase="idle")
    with pytest.raises(KeyError):
        metric(EXPOSITION, "jaxkv_xla_compiles_total")


def test_a_server_is_started_polled_and_stopped(tmp_path):
    port = free_port()
    (tmp_path / "ready").write_text("ok")
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with ServerProcess(argv, port, name="stand-in", ready_path="/ready", log=tmp_path / "log", timeout=60, poll_s=0.1) as server:
        assert server.start_s > 0 and server.proc.poll() is None and port_in_use(port)
        with pytest.raises(RuntimeError, match="already in use"):  # a second server would not be the one answering
            ServerProcess(argv, port).__enter__()
    assert server.proc.poll() is not None and not port_in_use(port)


def test_a_server_that_dies_while_starting_says_so_with_its_output(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with 3 while starting.*no model here"):
        ServerProcess(argv, free_port(), name="broken", log=tmp_path / "log", timeout=60, poll_s=0.1).__enter__()
