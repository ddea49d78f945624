"""The peer bench's driver (eval/bench/peers.py) on a stub OpenAI server: the same
client code that times jaxkv, vLLM and llama.cpp, checked without installing a peer.

The stub streams a known reply (one token per chunk, a fixed delay before the
first), with or without a usage chunk, so the driver's token counts, cache hit
rate, latencies and the agent level's bookkeeping can be asserted exactly.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

openai = pytest.importorskip("openai")

from eval.bench import peers as bench_peers  # noqa: E402

FIRST_TOKEN_DELAY = 0.05


class Stub(BaseHTTPRequestHandler):
    usage = True  # send a usage chunk (jaxkv, vLLM) or not (llama.cpp's server)
    requests: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.requests.append(body)
        n = body["max_tokens"]
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(obj):
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        base = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        send({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        time.sleep(FIRST_TOKEN_DELAY)
        for i in range(n):
            send({**base, "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]})
            time.sleep(0.002)
        send({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if Stub.usage and body.get("stream_options", {}).get("include_usage"):
            send(
                {
                    **base,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt,
                        "completion_tokens": n,
                        "total_tokens": prompt + n,
                        "prompt_tokens_details": {"cached_tokens": prompt // 2},
                    },
                }
            )
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Stub.requests, Stub.usage = [], True
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none", max_retries=0)
    yield client
    server.shutdown()


MESSAGES = [{"role": "user", "content": "one two three four"}]


def test_a_stream_is_timed_and_counted_from_usage(stub):
    t = bench_peers.stream_chat(stub, "m", MESSAGES, 8, {"extra_body": {"ignore_eos": True}})
    assert t.tokens == 8 and t.prompt_tokens == 4 and t.cached_tokens == 2
    assert t.text == "".join(f"t{i} " for i in range(8)) and t.finish == "length"
    assert FIRST_TOKEN_DELAY <= t.ttft < t.total
    assert t.itl == pytest.approx((t.total - t.ttft) / 7)
    assert Stub.requests[-1]["ignore_eos"] is True and Stub.requests[-1]["temperature"] == 0 and Stub.requests[-1]["stream"]


def test_without_usage_a_length_reply_counts_max_tokens(stub):
    Stub.usage = False
    t = bench_peers.stream_chat(stub, "m", MESSAGES, 5, {"logit_bias": {"2": -100}})
    assert t.tokens == 5 and t.prompt_tokens is None and t.cached_tokens is None
    assert Stub.requests[-1]["logit_bias"] == {"2": -100}


def test_an_agent_level_runs_every_session_in_order_and_sums_its_tokens(stub):
    sessions = [[[{"role": "user", "content": f"s{i} turn {t} " + "w " * t}] for t in range(3)] for i in range(4)]
    level = bench_peers.agent_level(stub, "m", sessions, 6, {})
    assert len(Stub.requests) == 12
    for i in range(4):  # each session's turns went out in order
        mine = [r["messages"][0]["content"] for r in Stub.requests if r["messages"][0]["content"].startswith(f"s{i} ")]
        assert mine == [s[0]["content"] for s in sessions[i]]
    assert level["texts"] == [["".join(f"t{k} " for k in range(6))] * 3] * 4
    prompts = [len(m[0]["content"].split()) for s in sessions for m in s]
    assert level["prefix_hit"] == pytest.approx(sum(p // 2 for p in prompts) / sum(prompts))
    assert level["gen_tok_s"] == pytest.approx(4 * 3 * 6 / level["wall_s"])
    assert level["prompt_tok_s"] == pytest.approx(sum(prompts) / level["wall_s"])
    assert FIRST_TOKEN_DELAY <= level["ttft_p50"] <= level["ttft_p95"]


def test_agent_traces_flatten_to_plain_chat_with_the_calls_as_text():
    sessions = bench_peers.agent_sessions(2, "n0")
    assert len(sessions) == 2
    for turns in sessions:
        assert 1 <= len(turns) <= bench_peers.AGENT_TURNS
        for a, b in zip(turns, turns[1:]):
            assert b[: len(a)] == a  # every turn extends the previous prompt
        for m in turns[-1]:
            assert m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str)
        assert turns[0][0]["content"].startswith("[n0] ")
        assert any('"name"' in m["content"] for m in turns[-1] if m["role"] == "assistant") or len(turns) == 1


def test_percentile_interpolates_and_ignores_missing():
    assert bench_peers.percentile([3, 1, None, 2], 0.5) == 2
    assert bench_peers.percentile([1, 2], 0.95) == pytest.approx(1.95)
    assert bench_peers.percentile([], 0.5) != bench_peers.percentile([], 0.5)  # nan


def test_peer_environments_live_in_the_one_user_cache(tmp_path, monkeypatch):
    """The peers' virtual environments follow ``jaxkv.models.registry.user_cache_dir``:
    ``$XDG_CACHE_HOME`` moves them, ``$JAXKV_CACHE`` wins over it."""
    from eval.bench import peer_stacks

    monkeypatch.delenv("JAXKV_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert peer_stacks.VLLM.venv == tmp_path / "xdg" / "jaxkv" / "peers" / peer_stacks.VLLM.name
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path / "mine"))
    assert peer_stacks.LLAMA_CPP.venv == tmp_path / "mine" / "peers" / peer_stacks.LLAMA_CPP.name
