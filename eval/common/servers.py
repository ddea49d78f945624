"""The one runner for a server in a subprocess, and the one reader of its ``/metrics``.

``ServerProcess`` starts a command on ``127.0.0.1`` for the length of a ``with``
block: it refuses a port something already answers on (a server left from an earlier
run would answer in this one's place), polls ``ready_path`` until it answers 200,
fails fast when the process exits while starting or misses its ``timeout``, and on
leaving terminates it (killed if it does not stop within ``stop_timeout``).
``start_s`` is the seconds from the start to the first 200. Every bench that runs
``jaxkv serve`` or a peer stack (``eval.bench.server``, ``eval.bench.peers``,
``eval.bench.warmup``) goes through it.

``metric`` reads one sample of a Prometheus text exposition with
``prometheus_client``'s parser, the one the server's tests use.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

LOCALHOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (the OS's pick)."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((LOCALHOST, port)) == 0


class ServerProcess:
    """``argv`` (a server listening on ``port``) as a context manager.

    Attributes:
      base: ``http://127.0.0.1:<port>``.
      proc: the ``subprocess.Popen`` while the block runs.
      start_s: seconds from the start to the first 200 from ``ready_path``.
    """

    def __init__(
        self,
        argv: list[str],
        port: int,
        *,
        name: str = "server",
        env: dict | None = None,
        cwd: str | Path | None = None,
        log: Path | None = None,
        ready_path: str = "/v1/models",
        timeout: float = 300.0,
        stop_timeout: float = 30.0,
        poll_s: float = 0.5,
    ):
        self.argv, self.port, self.name, self.env, self.cwd = list(argv), port, name, env, cwd
        self.log, self.ready_path, self.timeout, self.stop_timeout, self.poll_s = log, ready_path, timeout, stop_timeout, poll_s
        self.base = f"http://{LOCALHOST}:{port}"
        self.proc = None
        self.start_s = None

    def __enter__(self) -> "ServerProcess":
        import httpx

        if port_in_use(self.port):
            raise RuntimeError(f"port {self.port} is already in use (a server left running?); stop it or pick another port")
        self._out = open(self.log, "w") if self.log is not None else None
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv, env=self.env, cwd=self.cwd, stdout=self._out, stderr=subprocess.STDOUT if self._out is not None else None
        )
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting{self._log_tail()}")
                try:
                    if httpx.get(self.base + self.ready_path, timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > self.timeout:
                    raise RuntimeError(f"{self.name} did not answer {self.ready_path} within {self.timeout:.0f} s{self._log_tail()}")
                time.sleep(self.poll_s)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.start_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._out is not None:
            self._out.close()

    def _log_tail(self, chars: int = 3000) -> str:
        if self.log is None:
            return ""
        self._out.flush()
        return f"; its output ({self.log}) ends:\n" + Path(self.log).read_text(errors="replace")[-chars:]

    def metrics(self) -> str:
        """The server's ``/metrics`` text."""
        import httpx

        return httpx.get(self.base + "/metrics", timeout=60).text


def metric(text: str, name: str, **labels) -> float:
    """The value of sample ``name`` (with exactly these ``labels``, if any) in a
    Prometheus text exposition; a KeyError when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (not labels or sample.labels == labels):
                return float(sample.value)
    raise KeyError(f"{name}{labels or ''} not in the metrics")
