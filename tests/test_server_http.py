"""``jaxkv serve`` over HTTP: the official ``openai`` client against a real uvicorn
server on 127.0.0.1 (a free port, started and stopped by the fixtures).

On a tiny random model (its replies are noise, which is what streaming must
survive): plain chat, streaming equal to the greedy non-streaming reply, every
bad input with its status and OpenAI error, ``/health`` fine afterwards, a full
queue (429 + ``Retry-After``), an interrupted stream that frees its row and
slots (seen through ``/metrics``), a stream kept alive by SSE comments while
its first token is late, ``/metrics`` as Prometheus text whose latency
histograms count what the requests did, API keys (401) and tenants that never
share a session or a cached prefix.

On the embedded agent model: a held-out agent trace driven as real tool-call
round trips (the model calls a tool, the test answers with the trace's recorded
tool result) and solved end to end, with ``cached_tokens`` > 0 from the second
turn on; streamed tool calls; ``tool_choice`` and ``stop``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

import jaxkv  # noqa: E402
from jaxkv.models.loading import EMBEDDED_DIR  # noqa: E402
from jaxkv.server import BackgroundServer, OptionRules, make_app  # noqa: E402

KEYS = ("key-one", "key-two")
MESSAGES = [
    {"role": "system", "content": "You are a research agent."},
    {"role": "user", "content": "In the Meadow project, find facilities k086 and pricing k312. Then answer."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the document index.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "open",
            "description": "Open a document by its id.",
            "parameters": {"type": "object", "properties": {"doc_id": {"type": "string"}}, "required": ["doc_id"]},
        },
    },
]


def client(url: str, key: str = KEYS[0]):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def metrics(url: str, key: str = KEYS[0]) -> dict:
    """``/metrics`` as {'name{labels}': value}."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def wait_until(check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def stream_reply(stream):
    """Concatenated deltas of a chat stream: (content, reasoning, tool calls, finish, usage)."""
    content, reasoning, calls, finish, use = "", "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            use = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or ():
                slot = calls.setdefault(call.index, {"name": "", "arguments": ""})
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, use


def message_parts(message):
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or ()]
    return message.content or "", (message.model_extra or {}).get("reasoning_content") or "", calls


# ============================================================================ tiny random model
@pytest.fixture(scope="module")
def tiny(task_model_dir):
    """A server with two API keys; a pool of 2048 slots (context 4096), so one
    request can be too big for the pool yet fit the context; a queue of 2."""
    model = jaxkv.load_model(task_model_dir)
    rules = OptionRules(allow_policies=frozenset({"snapkv", "h2o"}), max_budget=2048)
    app = make_app(
        model, model_name="tiny", rows=2, max_queue=2, max_positions=4096, num_slots=2049, api_keys=KEYS, rules=rules, max_tokens=16
    )
    with BackgroundServer(app) as running:
        running.server = app.state.jaxkv.server
        yield running


def test_models_and_a_plain_chat(tiny):
    c = client(tiny.url)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens
    # without max_tokens the server's default (16) applies
    assert c.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0).usage.completion_tokens <= 16


def test_metrics_are_prometheus_text_with_latency_histograms(tiny):
    """Every old name with its type, and the three histograms count what the
    requests did: one first token and ``tokens - 1`` inter-token latencies per
    request, streamed or not, one queue wait per turn."""
    from prometheus_client.parser import text_string_to_metric_families
    from test_server_metrics import HISTOGRAMS, OLD_METRICS, check_histogram, exposition_types, samples

    def scrape():
        r = httpx.get(tiny.url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        list(text_string_to_metric_families(r.text))  # the whole body parses
        return r.text

    assert wait_until(lambda: (m := metrics(tiny.url))["jaxkv_rows_busy"] == 0 and m["jaxkv_queue_depth"] == 0)
    before = samples(scrape())
    c = client(tiny.url)
    kw = dict(model="tiny", messages=MESSAGES, temperature=0, extra_body={"session_id": "histograms"})
    plain = c.chat.completions.create(**kw, max_tokens=48)  # 1 token, then decode chunks of up to 32
    streamed = stream_reply(c.chat.completions.create(**kw, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    tokens = (plain.usage.completion_tokens, streamed[4].completion_tokens)
    assert tokens[0] > 33, f"the plain reply ({tokens[0]} tokens) should span several decode calls"

    def after_both_turns_ended():  # their queue waits are observed as the turns end, beside the responses
        text = scrape()
        return (
            text
            if check_histogram(samples(text), "jaxkv_queue_wait_seconds") >= check_histogram(before, "jaxkv_queue_wait_seconds") + 2
            else None
        )

    text = wait_until(after_both_turns_ended, 10)
    assert text, scrape()
    types, after = exposition_types(text), samples(text)
    assert all(types.get(name) == kind and name in after for name, (kind, _, _) in OLD_METRICS.items()), types
    grown = {name: check_histogram(after, name) - check_histogram(before, name) for name in HISTOGRAMS}
    assert all(types[name] == "histogram" for name in HISTOGRAMS)
    assert grown == {
        "jaxkv_time_to_first_token_seconds": 2,
        "jaxkv_inter_token_latency_seconds": sum(tokens) - 2,
        "jaxkv_queue_wait_seconds": 2,
    }


def test_streaming_deltas_equal_the_greedy_non_streaming_reply(tiny):
    c = client(tiny.url)
    for i, (messages, tools) in enumerate(
        [
            (MESSAGES, TOOLS),
            (MESSAGES[1:], None),
            (MESSAGES + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "And pricing?"}], TOOLS),
        ]
    ):
        kw = dict(model="tiny", messages=messages, tools=tools, max_tokens=48, temperature=0, extra_body={"session_id": f"stream-{i}"})
        c.chat.completions.create(**{**kw, "max_tokens": 1})  # cache the prompt, so both runs below prefill alike
        full = c.chat.completions.create(**kw)
        streamed = stream_reply(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        content, reasoning, calls, finish, use = streamed
        assert (content, reasoning, calls) == message_parts(full.choices[0].message)
        assert finish == full.choices[0].finish_reason
        assert use.completion_tokens == full.usage.completion_tokens and use.prompt_tokens == full.usage.prompt_tokens
        assert use.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1


def test_stop_strings_cut_streamed_and_plain_replies_alike(tiny):
    c = client(tiny.url)
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"session_id": "stop"})
    c.chat.completions.create(**{**kw, "max_tokens": 1})
    free = c.chat.completions.create(**kw).choices[0].message
    text = (free.model_extra or {}).get("reasoning_content") or free.content or ""
    words = [w for w in text.split() if len(w) > 2 and text.find(w) > 0]
    assert words, f"no word to stop at in {text!r}"
    stop = words[len(words) // 2]
    cut = c.chat.completions.create(**kw, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 40
    got = message_parts(cut.choices[0].message)
    assert stop not in got[0] + got[1] and (text[: text.find(stop)].strip() in (got[0] + got[1]))
    assert stream_reply(c.chat.completions.create(**kw, stop=[stop], stream=True))[:4] == (*got, "stop")


BAD = [  # (body changes, status, error type, code, param)
    ({"model": "gpt-4"}, 404, "not_found_error", "model_not_found", "model"),
    ({"n": 2}, 400, "invalid_request_error", "invalid_value", "n"),
    ({"ignore_eos": "yes"}, 400, "invalid_request_error", "invalid_value", "ignore_eos"),
    ({"messages": []}, 400, "invalid_request_error", "invalid_value", "messages"),
    ({"messages": "hi"}, 400, "invalid_request_error", "invalid_value", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_request_error", "invalid_value", "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "invalid_request_error",
        "invalid_value",
        "messages[0].content",
    ),
    ({"temperature": -1}, 400, "invalid_request_error", "invalid_value", "temperature"),
    ({"top_p": 0}, 400, "invalid_request_error", "invalid_value", "top_p"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "invalid_value", "max_tokens"),
    ({"max_tokens": 5000}, 400, "invalid_request_error", "context_length_exceeded", "messages"),
    ({"max_tokens": 3000}, 400, "invalid_request_error", "kv_capacity_exceeded", "messages"),
    ({"stop": 7}, 400, "invalid_request_error", "invalid_value", "stop"),
    ({"logprobs": True}, 400, "invalid_request_error", "unsupported_parameter", "logprobs"),
    ({"frequency_penalty": 0.5}, 400, "invalid_request_error", "unsupported_parameter", "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, 400, "invalid_request_error", "unsupported_parameter", "response_format"),
    ({"sesion_id": "typo"}, 400, "invalid_request_error", "unknown_parameter", "sesion_id"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
        400,
        "invalid_request_error",
        "invalid_value",
        "tool_choice",
    ),
    ({"tool_choice": "required"}, 400, "invalid_request_error", "invalid_value", "tool_choice"),
    ({"tools": [{"type": "function"}]}, 400, "invalid_request_error", "invalid_value", "tools[0]"),
    ({"policy": "tova", "budget": 64}, 400, "invalid_request_error", "option_not_allowed", "policy"),
    ({"policy": "snapkv", "budget": 4096}, 400, "invalid_request_error", "option_not_allowed", "budget"),
    ({"stream": "yes"}, 400, "invalid_request_error", "invalid_value", "stream"),
]


def test_every_bad_input_gets_its_status_and_openai_error(tiny):
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    base = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    for change, status, type_, code, param in BAD:
        r = httpx.post(tiny.url + "/v1/chat/completions", json={**base, **change}, headers=headers, timeout=60)
        assert r.status_code == status, (change, r.text)
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == (type_, code, param), (change, err)
        assert isinstance(err["message"], str) and err["message"]
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(tiny.url + "/v1/chat/completions", content=raw, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(tiny.url + "/v1/nothing", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(tiny.url + "/v1/chat/completions", headers=headers)
    assert r.status_code == 405 and "error" in r.json()
    # the official client raises the matching exceptions, with OpenAI's fields
    with pytest.raises(openai.BadRequestError) as err:
        client(tiny.url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5000)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client(tiny.url).chat.completions.create(model="nope", messages=MESSAGES)
    # a session's options are its own
    c = client(tiny.url)
    c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"session_id": "opts", "policy": "snapkv", "budget": 512}
    )
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"session_id": "opts", "policy": "h2o", "budget": 512}
        )
    assert err.value.code == "session_options_mismatch" and err.value.param == "policy"
    # nothing above broke the server
    assert httpx.get(tiny.url + "/health").json() == {"status": "ok", "model": "tiny"}
    assert c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices[0].message.role == "assistant"
    assert metrics(tiny.url).get('jaxkv_http_responses_total{status="500"}', 0) == 0


def test_a_full_queue_answers_429_with_retry_after(tiny):
    scheduler = tiny.server.scheduler
    gate = threading.Event()
    scheduler.call(gate.wait)  # hold the scheduler thread: submitted turns stay queued
    results = {}

    def ask(i):
        try:
            results[i] = client(tiny.url).chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"session_id": f"q{i}"}
            )
        except Exception as err:  # checked below
            results[i] = err

    threads = []
    try:
        for i in range(2):  # fill the queue (max_queue=2)
            threads.append(threading.Thread(target=ask, args=(i,)))
            threads[-1].start()
            assert wait_until(lambda: scheduler.queue_depth == i + 1, 30)
        r = httpx.post(
            tiny.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "session_id": "q2"},
            headers={"Authorization": f"Bearer {KEYS[0]}"},
            timeout=30,
        )
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        assert int(r.headers["Retry-After"]) >= 1
        with pytest.raises(openai.RateLimitError):
            client(tiny.url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"session_id": "q3"})
    finally:
        gate.set()
        for th in threads:
            th.join(60)
    assert all(not isinstance(results[i], Exception) for i in range(2)), results
    assert httpx.get(tiny.url + "/health").status_code == 200


@contextlib.contextmanager
def scheduler_held(server):
    """Hold the scheduler thread (no engine step runs, so no token comes) until
    the returned event is set, or the block ends."""
    gate, holding = threading.Event(), threading.Event()

    def hold():
        holding.set()
        gate.wait(120)

    server.scheduler.call(hold)
    try:
        assert holding.wait(60), "the scheduler thread never took the hold"
        yield gate
    finally:
        gate.set()


def test_a_silent_stream_gets_keepalive_comments_and_still_parses(tiny):
    """While a streamed turn waits for its first token (here: the scheduler held,
    as a long CPU prefill holds it), the server sends ``: keep-alive`` comment
    lines every ``keepalive_s``; the stream then goes on, and the official client
    skips the comments: its deltas equal the greedy non-streaming reply."""
    state = tiny.app.state.jaxkv
    default = state.config
    assert default.keepalive_s == 15.0
    state.config = dataclasses.replace(default, keepalive_s=0.05)  # this test's server: a short interval
    try:
        c = client(tiny.url)
        kw = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
        c.chat.completions.create(**{**kw, "max_tokens": 1}, extra_body={"session_id": "keepalive"})  # cache the prompt: all prefill alike
        plain = message_parts(c.chat.completions.create(**kw, extra_body={"session_id": "keepalive"}).choices[0].message)
        body = {**kw, "stream": True, "session_id": "keepalive"}
        with scheduler_held(tiny.server) as gate:
            with httpx.stream(
                "POST", tiny.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60
            ) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                before = []  # what came before the scheduler could run the turn
                while sum(line == ": keep-alive" for line in before) < 3:
                    before.append(next(lines))
                gate.set()
                after = list(lines)
        data = [line for line in before if line.startswith("data:")]
        assert len(data) == 1 and json.loads(data[0][5:])["choices"][0]["delta"]["role"] == "assistant"
        assert set(before) - set(data) <= {": keep-alive", ""}  # comments (and the blank lines that end events)
        assert [line for line in after if line][-1] == "data: [DONE]"
        assert any(json.loads(line[5:])["choices"][0]["finish_reason"] for line in after if line.startswith("data: {"))

        with scheduler_held(tiny.server) as gate:
            stream = c.chat.completions.create(**kw, stream=True, extra_body={"session_id": "keepalive"})
            threading.Timer(0.5, gate.set).start()  # ten intervals of comments first
            content, reasoning, calls, finish, _ = stream_reply(stream)
        assert (content, reasoning, calls) == plain and finish in ("stop", "length", "tool_calls")
    finally:
        state.config = default


def test_an_interrupted_stream_frees_its_row_and_slots(tiny):
    before = metrics(tiny.url)
    body = {
        "model": "tiny",
        "messages": MESSAGES + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Go on, at length."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "session_id": "interrupted",
    }
    # ignore_eos and a held scheduler: the turn cannot end on its own while the test
    # looks (a random model's greedy reply may reach EOS, and 1,500 tiny-model tokens
    # can take less time than one /metrics round trip)
    with contextlib.ExitStack() as held:
        with httpx.stream(
            "POST", tiny.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["delta"]["role"] == "assistant"
            next(
                line for line in lines if line.startswith("data:")
            )  # a token: the turn has its row (the role chunk may come while it queues)
            held.enter_context(scheduler_held(tiny.server))
            assert tiny.server.snapshot()["rows_busy"] == 1  # the turn runs (/metrics waits for the scheduler)
        # the client leaves while the turn is still running; then the scheduler goes on
    # the client is gone: the turn is cancelled, its row and slots are back
    cancelled = 'jaxkv_turns_total{outcome="cancelled"}'
    after = wait_until(lambda: (m := metrics(tiny.url))[cancelled] == before[cancelled] + 1 and m["jaxkv_rows_busy"] == 0 and m)
    assert after, metrics(tiny.url)
    assert after['jaxkv_pool_slots{state="used"}'] == after["jaxkv_prefix_cache_slots"]  # only the radix cache holds slots
    assert after['jaxkv_pool_slots{state="used"}'] + after['jaxkv_pool_slots{state="free"}'] == after['jaxkv_pool_slots{state="capacity"}']
    assert after["jaxkv_queue_depth"] == 0 and after["jaxkv_live_kv_tokens"] == 0
    # the session is free again at once
    c = client(tiny.url)
    assert c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"session_id": "interrupted"}).choices


def test_api_keys_and_tenants_that_never_share_state(tiny):
    for key in (None, "wrong"):
        r = httpx.post(
            tiny.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": MESSAGES},
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        assert (
            r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"
        )
        assert httpx.get(tiny.url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}).status_code == 401
        assert httpx.get(tiny.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(tiny.url, "wrong").models.list()
    assert httpx.get(tiny.url + "/health").status_code == 200  # health needs no key
    # the same session id and the same conversation, from two tenants
    conversation = [{"role": "system", "content": "Tenant test."}, {"role": "user", "content": "Find payroll k257 in the Juniper project."}]
    kw = dict(model="tiny", messages=conversation, max_tokens=4, temperature=0, extra_body={"session_id": "shared-id"})
    one, two = client(tiny.url, KEYS[0]), client(tiny.url, KEYS[1])
    first = one.chat.completions.create(**kw)
    again = one.chat.completions.create(**kw)
    other = two.chat.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 1  # a new conversation
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1  # tenant one's cache works
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # ...and tenant two (its first request) sees none of it
    store = tiny.app.state.jaxkv.store
    sessions = [e.session for (tenant, key), e in store._entries.items() if key == "explicit:shared-id"]
    assert len(sessions) == 2 and sessions[0] is not sessions[1]
    assert sessions[0].session_id != sessions[1].session_id and sessions[0].cache_namespace != sessions[1].cache_namespace
    assert all(KEYS[0] not in s.session_id and KEYS[1] not in s.session_id for s in sessions)  # keys are never stored


# ============================================================================ the embedded agent model
needs_embedded = pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").is_file(), reason="embedded model not installed")


@pytest.fixture(scope="module")
def embedded():
    app = make_app(jaxkv.load_model("embedded"), model_name="embedded", rows=2, max_positions=4096, max_tokens=160)
    with BackgroundServer(app) as running:
        yield running


@needs_embedded
def test_agent_trace_solved_through_tool_call_round_trips(embedded):
    from jaxkv.demo import MAX_AGENT_STEPS, ToolEnvironment
    from jaxkv.tasks import agent_traces, reply_matches
    from jaxkv.tasks.seeds import EVAL_SEED_BASE

    example = agent_traces(1, EVAL_SEED_BASE + 1903, length=1024)[0]  # held out: an evaluation seed
    env = ToolEnvironment(example)
    c = client(embedded.url)
    messages = [dict(m) for m in example.messages[:2]]
    answer, cached = None, []
    for step in range(MAX_AGENT_STEPS):
        r = c.chat.completions.create(
            model="embedded", messages=messages, tools=example.tools, temperature=0, extra_headers={"X-Session-Id": f"trace-{example.seed}"}
        )
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        message = r.choices[0].message
        if not message.tool_calls:
            assert r.choices[0].finish_reason == "stop"
            answer = message
            break
        assert r.choices[0].finish_reason == "tool_calls"
        messages.append(message)  # as the client returned it (reasoning_content included)
        for call in message.tool_calls:
            json.loads(call.function.arguments)  # a JSON string, as OpenAI's
            messages.append({"role": "tool", "tool_call_id": call.id, "content": env(call.function.name, call.function.arguments)})
    assert answer is not None, f"no answer after {MAX_AGENT_STEPS} steps"
    assert reply_matches(example.targets[-1], {"content": answer.content, "tool_calls": []}), answer.content
    assert len(cached) >= 3 and all(n > 0 for n in cached[1:]), cached


@needs_embedded
def test_ignore_eos_decodes_max_tokens_past_the_stop_token(embedded):
    """vLLM's ``ignore_eos`` (benchmarks time replies of a fixed length): the reply
    that stops at ``<|im_end|>`` goes on to ``max_tokens``, streamed or not."""
    c = client(embedded.url)
    kw = dict(model="embedded", messages=[{"role": "user", "content": "hello"}], temperature=0, max_tokens=60)
    short = c.chat.completions.create(**kw)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 60
    long = c.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 60 and long.choices[0].finish_reason == "length"
    *_, finish, use = stream_reply(
        c.chat.completions.create(**kw, extra_body={"ignore_eos": True}, stream=True, stream_options={"include_usage": True})
    )
    assert use.completion_tokens == 60 and finish == "length"


@needs_embedded
def test_embedded_streams_tool_calls_and_honours_tool_choice_and_stop(embedded):
    c = client(embedded.url)
    kw = dict(model="embedded", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=80)
    full = c.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "tool_calls" and full.choices[0].message.tool_calls[0].function.name == "search"
    content, reasoning, calls, finish, _ = stream_reply(c.chat.completions.create(**kw, stream=True))
    assert (content, reasoning, calls) == message_parts(full.choices[0].message) and finish == "tool_calls"
    assert reasoning  # the model reasons first: it streams as reasoning_content
    named = c.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "open"}})
    assert [t.function.name for t in named.choices[0].message.tool_calls] == ["open"]
    none = c.chat.completions.create(**kw, tool_choice="none")
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason != "tool_calls"
    cut = c.chat.completions.create(**kw, stop=["search"])
    parts = message_parts(cut.choices[0].message)
    assert cut.choices[0].finish_reason == "stop" and not parts[2] and "search" not in parts[0] + parts[1]
    assert stream_reply(c.chat.completions.create(**kw, stop=["search"], stream=True))[:4] == (*parts, "stop")
