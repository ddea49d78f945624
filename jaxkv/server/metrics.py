"""``/metrics``: the server's state in Prometheus' text format (version 0.0.4).

Everything comes from one ``Server.snapshot()`` (taken on the scheduler thread,
so it is consistent) plus the HTTP layer's own counts. Gauges describe now,
``*_total`` counters only grow:

* pool: ``jaxkv_pool_slots{state="capacity|used|free"}``, ``jaxkv_pool_occupancy``
  (used / capacity), ``jaxkv_prefix_cache_slots`` (slots only the radix cache
  holds), ``jaxkv_live_kv_tokens`` (KV rows running requests attend to);
* scheduling: ``jaxkv_rows`` / ``jaxkv_rows_busy``, ``jaxkv_queue_depth``,
  ``jaxkv_turns_total{outcome=...}``, ``jaxkv_sessions``;
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
  (times the compiled programs were dropped near the mapping limit);
* HTTP: ``jaxkv_http_responses_total{status=...}``.

No label carries a tenant, a session or any request content.
"""

from __future__ import annotations

import collections
import time

RATE_WINDOW_S = 10.0


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


def _line(out: list, name: str, kind: str, help: str, values) -> None:
    out.append(f"# HELP {name} {help}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in values:
        label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        out.append(f"{name}{label} {float(value):.6g}" if isinstance(value, float) else f"{name}{label} {int(value)}")


def render(snap: dict, *, sessions: int, rate: float, responses: dict, mechanisms: dict | None = None) -> str:
    """The exposition text of one ``Server.snapshot()`` plus the HTTP layer's
    counts (``responses`` by status; ``mechanisms``: summed turn reports)."""
    mechanisms = mechanisms or {}
    out: list[str] = []
    cap = max(snap["slots_capacity"], 1)
    _line(out, "jaxkv_pool_slots", "gauge", "KV pool slots (sentinel excluded).",
          [({"state": "capacity"}, snap["slots_capacity"]), ({"state": "used"}, snap["slots_used"]), ({"state": "free"}, snap["slots_free"])])
    _line(out, "jaxkv_pool_occupancy", "gauge", "Used share of the KV pool.", [({}, snap["slots_used"] / cap)])
    _line(out, "jaxkv_prefix_cache_slots", "gauge", "Slots the radix prefix cache holds.", [({}, snap["radix_slots"])])
    _line(out, "jaxkv_live_kv_tokens", "gauge", "KV rows the running requests attend to.", [({}, snap["live_kv"])])
    _line(out, "jaxkv_rows", "gauge", "Engine rows (turns that can run at once).", [({}, snap["rows"])])
    _line(out, "jaxkv_rows_busy", "gauge", "Engine rows running a turn.", [({}, snap["rows_busy"])])
    _line(out, "jaxkv_queue_depth", "gauge", "Turns waiting for a row.", [({}, snap["queue_depth"])])
    _line(out, "jaxkv_sessions", "gauge", "Live sessions in the HTTP session store.", [({}, sessions)])
    _line(out, "jaxkv_turns_total", "counter", "Turns ended, by outcome.",
          [({"outcome": o}, snap.get(f"turns_{o}", 0)) for o in ("done", "failed", "cancelled")])
    _line(out, "jaxkv_prompt_tokens_total", "counter", "Prompt tokens of all turns.", [({}, snap["prompt_tokens"])])
    _line(out, "jaxkv_cached_prompt_tokens_total", "counter", "Prompt tokens taken from the radix prefix cache.", [({}, snap["cached_tokens"])])
    _line(out, "jaxkv_prefix_hit_rate", "gauge", "Cached prompt tokens / prompt tokens, over all turns.",
          [({}, snap["cached_tokens"] / snap["prompt_tokens"] if snap["prompt_tokens"] else 0.0)])
    _line(out, "jaxkv_evicted_tokens_total", "counter", "KV positions evicted by retention policies.", [({}, snap["evicted_tokens"])])
    _line(out, "jaxkv_prefix_cache_evicted_slots_total", "counter", "Slots the prefix cache gave back under pool pressure.", [({}, snap["radix_evicted_slots"])])
    _line(out, "jaxkv_repaired_rows_total", "counter", "KV rows RepairKV promoted back from the host tier.", [({}, snap["repaired_rows"])])
    _line(out, "jaxkv_segment_reused_tokens_total", "counter", "Prompt tokens spliced from stored KV segments (cross-query reuse).",
          [({}, mechanisms.get("reused_tokens", 0))])
    _line(out, "jaxkv_host_tier_rows", "gauge", "Evicted KV rows shelved in the host tier.", [({}, snap["host_tier_rows"])])
    _line(out, "jaxkv_generated_tokens_total", "counter", "Tokens generated.", [({}, snap.get("tokens_generated", 0))])
    _line(out, "jaxkv_prefill_tokens_total", "counter", "Prompt tokens prefilled (not cached).", [({}, snap.get("prefill_tokens", 0))])
    _line(out, "jaxkv_generated_tokens_per_second", "gauge", f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.", [({}, float(rate))])
    _line(out, "jaxkv_engine_seconds_total", "counter", "Seconds spent in batched engine steps, by phase.",
          [({"phase": p}, float(snap.get(f"{p}_seconds", 0.0))) for p in ("prefill", "decode")])
    _line(out, "jaxkv_decode_steps_total", "counter", "Batched decode calls (each up to decode_chunk steps of every decoding row).", [({}, snap.get("steps", 0))])
    _line(out, "jaxkv_xla_compiles_total", "counter", "XLA programs this process compiled or loaded from the persistent cache (after warm-up a request adds none).",
          [({}, snap.get("xla_compiles", 0))])
    _line(out, "jaxkv_xla_cache_hits_total", "counter", "XLA programs loaded from the persistent compilation cache.", [({}, snap.get("xla_cache_hits", 0))])
    _line(out, "jaxkv_xla_releases_total", "counter", "Times the compiled programs were dropped near the process's memory-mapping limit (reloaded from the persistent cache on next use).",
          [({}, snap.get("xla_releases", 0))])
    _line(out, "jaxkv_http_responses_total", "counter", "HTTP responses, by status.",
          [({"status": str(s)}, n) for s, n in sorted(responses.items())] or [({"status": "200"}, 0)])
    return "\n".join(out) + "\n"
