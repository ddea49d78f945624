"""``jaxkv.server.metrics``: the ``/metrics`` exposition through ``prometheus_client``.

Without a model: the exposition of a made-up ``Server.snapshot()`` keeps every
name, type and label ``/metrics`` had when it was written by hand
(``OLD_METRICS``, the contract with scrapers and dashboards), each app has a
registry of its own, and the inter-token latency rule (a decode chunk's interval
shared evenly by its tokens). ``tests/test_server_http.py`` checks the same
against a running server.
"""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxkv.errors import JaxKVError
from jaxkv.server import metrics as prom

# name -> (type, label name or None, label values that are always there), as
# /metrics exposed them before prometheus_client wrote it (and one added since)
OLD_METRICS = {
    "jaxkv_pool_slots": ("gauge", "state", {"capacity", "used", "free"}),
    "jaxkv_pool_occupancy": ("gauge", None, None),
    "jaxkv_prefix_cache_slots": ("gauge", None, None),
    "jaxkv_live_kv_tokens": ("gauge", None, None),
    "jaxkv_rows": ("gauge", None, None),
    "jaxkv_rows_busy": ("gauge", None, None),
    "jaxkv_queue_depth": ("gauge", None, None),
    "jaxkv_sessions": ("gauge", None, None),
    "jaxkv_turns_total": ("counter", "outcome", {"done", "failed", "cancelled"}),
    "jaxkv_prompt_tokens_total": ("counter", None, None),
    "jaxkv_cached_prompt_tokens_total": ("counter", None, None),
    "jaxkv_prefix_hit_rate": ("gauge", None, None),
    "jaxkv_evicted_tokens_total": ("counter", None, None),
    "jaxkv_prefix_cache_evicted_slots_total": ("counter", None, None),
    "jaxkv_repaired_rows_total": ("counter", None, None),
    "jaxkv_host_tier_rows": ("gauge", None, None),
    "jaxkv_generated_tokens_total": ("counter", None, None),
    "jaxkv_prefill_tokens_total": ("counter", None, None),
    "jaxkv_generated_tokens_per_second": ("gauge", None, None),
    "jaxkv_engine_seconds_total": ("counter", "phase", {"prefill", "decode"}),
    "jaxkv_decode_steps_total": ("counter", None, None),
    "jaxkv_xla_compiles_total": ("counter", None, None),
    "jaxkv_xla_cache_hits_total": ("counter", None, None),
    "jaxkv_xla_releases_total": ("counter", None, None),
    "jaxkv_http_responses_total": ("counter", "status", {"200"}),
    "jaxkv_segment_reused_tokens_total": ("counter", None, None),  # added with per-request reuse
}
HISTOGRAMS = ("jaxkv_time_to_first_token_seconds", "jaxkv_inter_token_latency_seconds", "jaxkv_queue_wait_seconds")

SNAPSHOT = {  # a Server.snapshot() (the scheduler's counts appear once they count)
    "rows": 4,
    "rows_busy": 1,
    "slots_capacity": 400,
    "slots_used": 100,
    "slots_free": 300,
    "radix_slots": 60,
    "live_kv": 40,
    "queue_depth": 2,
    "host_tier_rows": 7,
    "turns_done": 5,
    "turns_cancelled": 1,
    "tokens_generated": 90,
    "prefill_tokens": 120,
    "steps": 9,
    "prefill_seconds": 0.5,
    "decode_seconds": 2.25,
    "xla_compiles": 30,
    "xla_cache_hits": 3,
    "xla_releases": 0,
    "prompt_tokens": 200,
    "cached_tokens": 80,
    "evicted_tokens": 11,
    "repaired_rows": 4,
    "radix_evicted_slots": 6,
}


def exposition_types(text: str) -> dict[str, str]:
    """``# TYPE`` lines as {name: type}: the names a scraper sees."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def samples(text: str) -> dict[str, list]:
    """Parsed samples by their exposed name."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def check_histogram(by_name: dict[str, list], name: str) -> float:
    """Cumulative bucket counts never fall and end at ``_count``; returns ``_count``."""
    buckets = sorted(by_name[name + "_bucket"], key=lambda s: float(s.labels["le"]))
    counts = [s.value for s in buckets]
    assert buckets[-1].labels["le"] == "+Inf" and len(buckets) > 5, buckets
    assert counts == sorted(counts), f"{name}: bucket counts fall: {counts}"
    (count,) = by_name[name + "_count"]
    assert counts[-1] == count.value
    return count.value


def test_exposition_keeps_every_name_type_and_label():
    metrics = prom.ServerMetrics()
    text = metrics.exposition(prom.ServerState(SNAPSHOT, sessions=3, tokens_per_second=12.5, responses={200: 9, 429: 2})).decode()
    types = exposition_types(text)
    by_name = samples(text)
    for name, (kind, label, values) in OLD_METRICS.items():
        assert types.get(name) == kind, f"{name}: exposed as {types.get(name)}, was {kind}"
        assert name in by_name, f"no sample named {name}"
        labels = {tuple(s.labels) for s in by_name[name]}
        assert labels == {(label,) if label else ()}, f"{name}: labels {labels}"
        if values:
            assert values <= {s.labels[label] for s in by_name[name]}, name
    for name in HISTOGRAMS:
        assert types[name] == "histogram" and check_histogram(by_name, name) == 0
    # the computed values are the old ones
    value = {s.name + str(sorted(s.labels.items())): s.value for group in by_name.values() for s in group}
    assert value["jaxkv_pool_occupancy[]"] == 0.25 and value["jaxkv_prefix_hit_rate[]"] == 0.4
    assert value["jaxkv_turns_total[('outcome', 'failed')]"] == 0 and value["jaxkv_turns_total[('outcome', 'done')]"] == 5
    assert value["jaxkv_engine_seconds_total[('phase', 'decode')]"] == 2.25 and value["jaxkv_sessions[]"] == 3
    assert value["jaxkv_http_responses_total[('status', '429')]"] == 2 and value["jaxkv_generated_tokens_per_second[]"] == 12.5
    assert "jaxkv_turns_total_total" not in text  # the counters' _total is not doubled
    # before any response the status counter still shows (as before)
    quiet = metrics.exposition(prom.ServerState(SNAPSHOT, sessions=0, tokens_per_second=0.0, responses={})).decode()
    assert 'jaxkv_http_responses_total{status="200"} 0.0' in quiet


def test_each_app_has_its_own_registry():
    first, second = prom.ServerMetrics(), prom.ServerMetrics()  # the global registry would refuse the second
    first.queue_wait.observe(0.2)
    state = prom.ServerState(SNAPSHOT, sessions=0, tokens_per_second=0.0, responses={})
    assert samples(first.exposition(state).decode())["jaxkv_queue_wait_seconds_count"][0].value == 1
    assert samples(second.exposition(state).decode())["jaxkv_queue_wait_seconds_count"][0].value == 0


def test_a_counter_must_be_named_with_total():
    with pytest.raises(JaxKVError, match="_total"):
        prom.StateMetric("jaxkv_turns", "counter", "Turns.", lambda s: 0)


def test_inter_token_latency_shares_a_chunk_interval_among_its_tokens():
    metrics = prom.ServerMetrics()
    now = [0.0]
    times = prom.TokenTimes(metrics, arrived=0.0, clock=lambda: now[0])
    for at, piece in ((0.25, [7]), (0.75, list(range(32))), (1.125, [1, 2, 3]), (2.0, [])):  # exact in binary
        now[0] = at
        times.on_tokens(piece)
    by_name = samples(metrics.exposition(prom.ServerState(SNAPSHOT, 0, 0.0, {})).decode())
    assert check_histogram(by_name, "jaxkv_time_to_first_token_seconds") == 1
    assert by_name["jaxkv_time_to_first_token_seconds_sum"][0].value == 0.25
    assert check_histogram(by_name, "jaxkv_inter_token_latency_seconds") == 32 + 3  # one per token after the first
    assert by_name["jaxkv_inter_token_latency_seconds_sum"][0].value == 1.125 - 0.25  # first token -> last
    itl = {s.labels["le"]: s.value for s in by_name["jaxkv_inter_token_latency_seconds_bucket"]}
    # 32 tokens 0.5 / 32 = 0.015625 s apart, then 3 tokens 0.375 / 3 = 0.125 s apart
    assert (itl["0.01"], itl["0.02"], itl["0.1"], itl["0.15"]) == (0, 32, 32, 35)
