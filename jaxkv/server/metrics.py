"""``/metrics``: the server's state and request latencies for Prometheus.

What it is for: a Prometheus scraper (and the Grafana dashboards built on it,
like vLLM's and SGLang's) reads how full the KV pool is, how the scheduler and
the prefix cache do, and how long requests wait, through ``prometheus_client``.
``ServerMetrics`` owns one ``CollectorRegistry`` per app (never the
process-global default one, so several apps in one process never collide), and
``ServerMetrics.exposition`` writes it in Prometheus' text format 0.0.4
(``generate_latest``; served as ``CONTENT_TYPE``).

Two kinds of metric live in that registry:

* computed from the server's state at scrape time (``STATE_METRICS``, through
  ``ServerStateCollector``): one ``Server.snapshot()`` (taken on the scheduler
  thread, so it is consistent) plus the HTTP layer's own counts. Gauges describe
  now; counters are the server's running totals and only grow;
* observed as requests run (``prometheus_client.Histogram``): time to first
  token, inter-token latency and queue wait, each with ``_bucket``, ``_sum``,
  ``_count`` and ``_created`` series.

Metrics, as a scraper sees them (a counter's name is its ``_total`` series):

* pool: ``jaxkv_pool_slots{state="capacity|used|free"}``, ``jaxkv_pool_occupancy``
  (used / capacity), ``jaxkv_prefix_cache_slots`` (slots only the radix cache
  holds), ``jaxkv_live_kv_tokens`` (KV rows running requests attend to);
* scheduling: ``jaxkv_rows`` / ``jaxkv_rows_busy``, ``jaxkv_queue_depth``,
  ``jaxkv_turns_total{outcome="done|failed|cancelled"}``, ``jaxkv_sessions``;
* cache: ``jaxkv_prompt_tokens_total``, ``jaxkv_cached_prompt_tokens_total`` and
  their ratio ``jaxkv_prefix_hit_rate``; ``jaxkv_evicted_tokens_total``
  (retention), ``jaxkv_prefix_cache_evicted_slots_total`` (LRU under pool
  pressure), ``jaxkv_repaired_rows_total`` (RepairKV), ``jaxkv_host_tier_rows``,
  ``jaxkv_segment_reused_tokens_total`` (prompt tokens spliced by segment reuse,
  summed by the HTTP layer over the turns it served);
* throughput: ``jaxkv_generated_tokens_total``, ``jaxkv_prefill_tokens_total``
  and ``jaxkv_generated_tokens_per_second`` over the last ``RATE_WINDOW_S``;
* engine: ``jaxkv_engine_seconds_total{phase="prefill|decode"}`` (seconds the
  scheduler spent in batched engine steps), ``jaxkv_decode_steps_total`` (batched
  decode calls, each up to ``decode_chunk`` steps for every decoding row),
  ``jaxkv_xla_compiles_total`` / ``jaxkv_xla_cache_hits_total`` (XLA programs
  the process compiled or loaded, ``jaxkv.compiles``: flat after warm-up while
  every program fits the process's memory mappings), ``jaxkv_xla_releases_total``
  (times the compiled programs were dropped near the mapping limit),
  ``jaxkv_warmup_programs`` / ``jaxkv_warmup_seconds`` (what the start-up
  warm-up compiled, and how long it took);
* HTTP: ``jaxkv_http_responses_total{status=...}``;
* latency histograms of chat requests (``TokenTimes``):
  ``jaxkv_time_to_first_token_seconds`` (the route starts handling the request
  -> the scheduler thread has its first generated token; waiting for the
  session's previous turn, rendering, queueing and prefill all count),
  ``jaxkv_inter_token_latency_seconds`` (between generated tokens) and
  ``jaxkv_queue_wait_seconds`` (``Scheduler.submit`` -> the scheduler gives the
  turn a row; observed when the turn ends, for every turn that was admitted).

Inter-token latency, the rule: tokens reach the HTTP layer in pieces, the first
token alone, then one piece per batched decode call (up to ``decode_chunk``
tokens). A piece of ``n`` tokens that arrives ``dt`` seconds after the previous
piece is ``n`` observations of ``dt / n``; the first token is the time to first
token instead. So a request that generates ``m`` tokens adds one observation to
the first histogram and ``m - 1`` to the second, whose ``_sum`` is the time from
its first token to its last.

Invariants: the exposed names, types and labels of the computed metrics are the
ones ``/metrics`` had before ``prometheus_client`` wrote it (a counter's
``CounterMetricFamily`` drops ``_total`` from its name and the exposition puts it
back, so every counter here is named with ``_total``); the registry rejects two
metrics of one name when the app is made; no label carries a tenant, a session
or any request content.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxkv.errors import JaxKVError

RATE_WINDOW_S = 10.0
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes (legacy names, no escaping needed)

# Bucket upper bounds in seconds (+Inf is added). Time to first token spans a
# cached prompt on an accelerator (milliseconds) to a long prefill on the CPU
# behind a queue (minutes); inter-token latency spans accelerator decode (a few ms)
# to a loaded CPU (~50 ms per token, more with many rows); queue wait is zero
# while a row is free and grows with the load.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class TokenRate:
    """Generated tokens per second over a sliding window of samples."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = float(window_s)
        self._samples: collections.deque = collections.deque()

    def sample(self, total: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, int(total)))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


# ============================================================================ computed at scrape time
@dataclasses.dataclass(frozen=True)
class ServerState:
    """What one scrape reports besides the histograms.

    Attributes:
      snapshot: one ``Server.snapshot()``.
      sessions: live sessions in the HTTP session store.
      tokens_per_second: ``TokenRate.rate()``.
      responses: HTTP responses so far, by status code.
      mechanisms: the HTTP layer's sums of its turns' reports (``reused_tokens``).
    """

    snapshot: Mapping[str, float]
    sessions: int
    tokens_per_second: float
    responses: Mapping[int, int]
    mechanisms: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StateMetric:
    """One metric computed from a ``ServerState``.

    Attributes:
      name: the name a scraper sees (a counter's ends in ``_total``).
      kind: ``"gauge"`` or ``"counter"``.
      help: its HELP text.
      read: the value of a state; with ``label``, ``{label value: value}``.
      label: the name of its one label (None: unlabelled).
    """

    name: str
    kind: str
    help: str
    read: Callable[[ServerState], float | Mapping[str, float]]
    label: str | None = None

    def __post_init__(self):
        if self.kind not in ("gauge", "counter"):
            raise JaxKVError(f"{self.name}: kind must be 'gauge' or 'counter', not {self.kind!r}")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise JaxKVError(f"the counter {self.name} must be named with _total (the exposition appends it)")

    def family(self, state: ServerState | None) -> Metric:
        """Its metric family: the samples of ``state``, none for ``None`` (describe)."""
        make = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        family = make(self.name, self.help, labels=(self.label,) if self.label else ())
        if state is None:
            return family
        value = self.read(state)
        if self.label is None:
            family.add_metric((), float(value))
        else:
            for label_value, v in value.items():
                family.add_metric((str(label_value),), float(v))
        return family


def _snapshot(key: str) -> Callable[[ServerState], float]:
    """A snapshot value that is always there."""
    return lambda state: state.snapshot[key]


def _counted(key: str) -> Callable[[ServerState], float]:
    """A scheduler count (absent from the snapshot until it first counts)."""
    return lambda state: state.snapshot.get(key, 0)


def _occupancy(state: ServerState) -> float:
    return state.snapshot["slots_used"] / max(state.snapshot["slots_capacity"], 1)


def _prefix_hit_rate(state: ServerState) -> float:
    prompt = state.snapshot["prompt_tokens"]
    return state.snapshot["cached_tokens"] / prompt if prompt else 0.0


def _responses(state: ServerState) -> dict[str, int]:
    return {str(status): n for status, n in sorted(state.responses.items())} or {"200": 0}


STATE_METRICS = (
    StateMetric(
        "jaxkv_pool_slots",
        "gauge",
        "KV pool slots (sentinel excluded).",
        lambda s: {state: s.snapshot[f"slots_{state}"] for state in ("capacity", "used", "free")},
        label="state",
    ),
    StateMetric("jaxkv_pool_occupancy", "gauge", "Used share of the KV pool.", _occupancy),
    StateMetric("jaxkv_prefix_cache_slots", "gauge", "Slots the radix prefix cache holds.", _snapshot("radix_slots")),
    StateMetric("jaxkv_live_kv_tokens", "gauge", "KV rows the running requests attend to.", _snapshot("live_kv")),
    StateMetric("jaxkv_rows", "gauge", "Engine rows (turns that can run at once).", _snapshot("rows")),
    StateMetric("jaxkv_rows_busy", "gauge", "Engine rows running a turn.", _snapshot("rows_busy")),
    StateMetric("jaxkv_queue_depth", "gauge", "Turns waiting for a row.", _snapshot("queue_depth")),
    StateMetric("jaxkv_sessions", "gauge", "Live sessions in the HTTP session store.", lambda s: s.sessions),
    StateMetric(
        "jaxkv_turns_total",
        "counter",
        "Turns ended, by outcome.",
        lambda s: {outcome: s.snapshot.get(f"turns_{outcome}", 0) for outcome in ("done", "failed", "cancelled")},
        label="outcome",
    ),
    StateMetric("jaxkv_prompt_tokens_total", "counter", "Prompt tokens of all turns.", _snapshot("prompt_tokens")),
    StateMetric(
        "jaxkv_cached_prompt_tokens_total", "counter", "Prompt tokens taken from the radix prefix cache.", _snapshot("cached_tokens")
    ),
    StateMetric("jaxkv_prefix_hit_rate", "gauge", "Cached prompt tokens / prompt tokens, over all turns.", _prefix_hit_rate),
    StateMetric("jaxkv_evicted_tokens_total", "counter", "KV positions evicted by retention policies.", _snapshot("evicted_tokens")),
    StateMetric(
        "jaxkv_prefix_cache_evicted_slots_total",
        "counter",
        "Slots the prefix cache gave back under pool pressure.",
        _snapshot("radix_evicted_slots"),
    ),
    StateMetric("jaxkv_repaired_rows_total", "counter", "KV rows RepairKV promoted back from the host tier.", _snapshot("repaired_rows")),
    StateMetric(
        "jaxkv_segment_reused_tokens_total",
        "counter",
        "Prompt tokens spliced from stored KV segments (cross-query reuse).",
        lambda state: state.mechanisms.get("reused_tokens", 0),
    ),
    StateMetric("jaxkv_host_tier_rows", "gauge", "Evicted KV rows shelved in the host tier.", _snapshot("host_tier_rows")),
    StateMetric("jaxkv_generated_tokens_total", "counter", "Tokens generated.", _counted("tokens_generated")),
    StateMetric("jaxkv_prefill_tokens_total", "counter", "Prompt tokens prefilled (not cached).", _counted("prefill_tokens")),
    StateMetric(
        "jaxkv_generated_tokens_per_second",
        "gauge",
        f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.",
        lambda s: s.tokens_per_second,
    ),
    StateMetric(
        "jaxkv_engine_seconds_total",
        "counter",
        "Seconds spent in batched engine steps, by phase.",
        lambda s: {phase: s.snapshot.get(f"{phase}_seconds", 0.0) for phase in ("prefill", "decode")},
        label="phase",
    ),
    StateMetric(
        "jaxkv_decode_steps_total",
        "counter",
        "Batched decode calls (each up to decode_chunk steps of every decoding row).",
        _counted("steps"),
    ),
    StateMetric(
        "jaxkv_xla_compiles_total",
        "counter",
        "XLA programs this process compiled or loaded from the persistent cache (after warm-up a request adds none).",
        _counted("xla_compiles"),
    ),
    StateMetric(
        "jaxkv_xla_cache_hits_total", "counter", "XLA programs loaded from the persistent compilation cache.", _counted("xla_cache_hits")
    ),
    StateMetric(
        "jaxkv_warmup_programs",
        "gauge",
        "XLA programs the start-up warm-up compiled or loaded (0: no warm-up).",
        _counted("warmup_programs"),
    ),
    StateMetric("jaxkv_warmup_seconds", "gauge", "Seconds the start-up warm-up took (0: no warm-up).", _counted("warmup_seconds")),
    StateMetric(
        "jaxkv_xla_releases_total",
        "counter",
        "Times the compiled programs were dropped near the process's memory-mapping limit (reloaded from the persistent cache on next use).",
        _counted("xla_releases"),
    ),
    StateMetric("jaxkv_http_responses_total", "counter", "HTTP responses, by status.", _responses, label="status"),
)


class ServerStateCollector(Collector):
    """The ``STATE_METRICS`` of the state ``ServerMetrics.exposition`` is writing
    (nothing outside an exposition: the state needs the scheduler thread, which
    a synchronous ``collect`` must not wait on)."""

    def __init__(self, metrics: Iterable[StateMetric] = STATE_METRICS):
        self.metrics = tuple(metrics)
        self.state: ServerState | None = None

    def describe(self) -> list[Metric]:
        return [m.family(None) for m in self.metrics]

    def collect(self) -> list[Metric]:
        state = self.state
        return [] if state is None else [m.family(state) for m in self.metrics]


# ============================================================================ observed per request
class ServerMetrics:
    """One app's registry: the computed metrics and the latency histograms."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self._state = ServerStateCollector()
        self.registry.register(self._state)
        self.time_to_first_token = Histogram(
            "jaxkv_time_to_first_token_seconds",
            "Seconds from a chat request's arrival to its first generated token.",
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "jaxkv_inter_token_latency_seconds",
            "Seconds between generated tokens (a decode chunk's interval shared evenly by its tokens).",
            buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "jaxkv_queue_wait_seconds",
            "Seconds a turn waited in the scheduler's queue for a row.",
            buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry,
        )
        self._exposing = threading.Lock()

    def exposition(self, state: ServerState) -> bytes:
        """The text format of every metric, the computed ones from ``state``."""
        with self._exposing:
            self._state.state = state
            try:
                return generate_latest(self.registry)
            finally:
                self._state.state = None

    def token_times(self, arrived: float) -> "TokenTimes":
        """A request's token listener timing it from ``arrived`` (``time.perf_counter()``)."""
        return TokenTimes(self, arrived)

    def observe_queue_wait(self, task) -> None:
        """The queue wait of an ended ``scheduler.TurnTask`` (none if it never got a row)."""
        if task.admitted_at is not None and task.submitted_at is not None:
            self.queue_wait.observe(task.admitted_at - task.submitted_at)


class TokenTimes:
    """Times one request's generated tokens (module docstring: the rule).

    ``on_tokens(ids)`` is the turn's token listener: it runs on the scheduler
    thread as soon as the engine step that sampled ``ids`` returns.
    """

    def __init__(self, metrics: ServerMetrics, arrived: float, clock: Callable[[], float] = time.perf_counter):
        self.metrics = metrics
        self.arrived = float(arrived)
        self.clock = clock
        self.last_piece_at: float | None = None

    def on_tokens(self, ids) -> None:
        count = len(ids)
        if count == 0:
            return
        now = self.clock()
        if self.last_piece_at is None:
            self.metrics.time_to_first_token.observe(now - self.arrived)
            count -= 1  # tokens sampled together with the first one (none from the turn pipeline) arrive with it
            interval = 0.0
        else:
            interval = (now - self.last_piece_at) / count
        for _ in range(count):
            self.metrics.inter_token_latency.observe(interval)
        self.last_piece_at = now
