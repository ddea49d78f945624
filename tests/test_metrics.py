"""Metrics: IntentKV §4.1 accounting on a scripted trace with hand-computed values."""

import pytest

from jaxkv.metrics import METRIC_KEYS, Metrics


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def scripted():
    clock = FakeClock()
    m = Metrics(clock=clock)
    # session A, turn 1: 10-token prompt, nothing cached; 3 decode steps, pruning
    # kicks in at the third (budget 8 live positions).
    m.start_request(prompt_tokens=10, prefix_hit_tokens=0, session_id="A")
    m.on_live(10)
    m.on_decode_step(11, 11)
    m.on_decode_step(12, 12)
    m.on_live(8)  # compression event
    m.on_decode_step(13, 9)
    clock.t = 2.0
    m.end_request()
    # session A, turn 2: 16-token prompt, 12 from the radix cache; 2 decode steps
    clock.t = 5.0
    m.start_request(prompt_tokens=16, prefix_hit_tokens=12, session_id="A")
    m.on_live(14)
    m.on_decode_step(17, 15)
    m.on_decode_step(18, 16)
    clock.t = 5.5
    m.end_request()
    # session B: 20-token prompt sharing 5 system tokens; no decode step
    clock.t = 6.0
    m.start_request(prompt_tokens=20, prefix_hit_tokens=5, session_id="B")
    m.on_live(20)
    clock.t = 6.25
    m.end_request()
    return m


def test_per_session_values_by_hand():
    m = scripted()
    assert m.as_dict("A") == {
        "peak_request_tokens": 18,  # max(10, 11, 12, 13 | 16, 17, 18)
        "peak_live_kv": 16,  # max(10, 11, 12, 8, 9 | 14, 15, 16)
        "raw_kv_reads": 11 + 12 + 13 + 17 + 18,  # 71
        "effective_kv_reads": 11 + 12 + 9 + 15 + 16,  # 63
        "prefix_hit_tokens": 12,
        "prefix_hit_rate": 12 / 26,
        "wall_s": 2.0 + 0.5,
    }
    assert m.as_dict("B") == {
        "peak_request_tokens": 20,
        "peak_live_kv": 20,
        "raw_kv_reads": 0,
        "effective_kv_reads": 0,
        "prefix_hit_tokens": 5,
        "prefix_hit_rate": 0.25,
        "wall_s": 0.25,
    }


def test_totals_and_request_records():
    m = scripted()
    total = m.as_dict()
    assert tuple(total) == METRIC_KEYS
    assert total == {
        "peak_request_tokens": 20,
        "peak_live_kv": 20,
        "raw_kv_reads": 71,
        "effective_kv_reads": 63,
        "prefix_hit_tokens": 17,
        "prefix_hit_rate": 17 / 46,
        "wall_s": 2.75,
    }
    first = m.requests[0]
    assert (first.peak_request_tokens, first.peak_live_kv, first.decode_steps) == (13, 12, 3)
    assert m.sessions() == ["A", "B"]


def test_table_lists_sessions_and_total():
    lines = str(scripted()).splitlines()
    assert lines[0].split()[:3] == ["session", "requests", "peak_request_tokens"]
    assert [line.split()[0] for line in lines[1:]] == ["A", "B", "TOTAL"]
    assert lines[3].split()[1:5] == ["3", "20", "20", "71"]


def test_misuse_is_rejected():
    m = Metrics(clock=FakeClock())
    with pytest.raises(ValueError):
        m.on_decode_step(3, 3)  # no open request
    with pytest.raises(ValueError):
        m.start_request(prompt_tokens=4, prefix_hit_tokens=5)
    r1 = m.start_request(prompt_tokens=4)
    with pytest.raises(ValueError):
        m.on_decode_step(5, 6)  # effective larger than raw
    r2 = m.start_request(prompt_tokens=4)
    with pytest.raises(ValueError):
        m.on_live(3)  # two open requests: ambiguous
    m.on_decode_step(5, 4, request=r2)
    m.end_request(r1)
    m.on_decode_step(6, 4)  # only r2 is open now
    assert (r2.raw_kv_reads, r2.effective_kv_reads) == (11, 8)
    assert m.as_dict()["prefix_hit_rate"] == 0.0
