"""Every session option per request over HTTP, within the server's allow-list.

The official ``openai`` client against real uvicorn servers on a tiny random
model (head_dim 32, so its KV can be quantized, with a toy TriAxialKV
calibration beside it). Each option a request may set in ``extra_body``
(``policy``, ``budget``, ``layout``, ``repair``, ``kv_quant``, ``kv_bits``,
``reuse``) is shown to take effect through the response's ``jaxkv`` object:
the options the live session runs with, read from its stages, and what each
mechanism did in the turn (evicted, compacted, repaired, reused tokens, average
KV bits), with the counts checked against the arithmetic they must satisfy
(and KV precisions that never share a cached prefix). Then: what the allow-list refuses (400 in OpenAI's shape, ``param`` naming the
field), a session that keeps its options, segment reuse scoped by tenant (API
key), a session's build error as a 400, and allow-lists the server cannot serve
refused at start-up (``ConfigError``).
"""

from __future__ import annotations

import re

import httpx
import pytest

openai = pytest.importorskip("openai")

import jaxkv  # noqa: E402
from jaxkv.errors import ConfigError, RadixError  # noqa: E402
from jaxkv.server import BackgroundServer, OptionRules, make_app  # noqa: E402
from jaxkv.tasks import shared_corpus  # noqa: E402

KEYS = ("key-alpha", "key-beta")
BUDGET = 48


def client(url: str, key: str = KEYS[0]):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0  # a status never answered has no line


def ask(url: str, messages, key: str = KEYS[0], **extra):
    """One greedy request; returns (response, its ``jaxkv`` report)."""
    r = client(url, key).chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body=extra)
    return r, r.model_extra["jaxkv"]


@pytest.fixture(scope="module")
def doc():
    return shared_corpus(5, n_shelves=1, length=600)[0]


def document_chat(doc, system: str = "You are a research agent.", question: str = "What is the first record?"):
    """A document read in an earlier turn, then a short question (the actionable
    query, which retention never evicts): the document is what a policy prunes."""
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Read this document.\n{doc.text}"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": question},
    ]


@pytest.fixture(scope="module")
def model(quant_model_dir):
    return jaxkv.load_model(quant_model_dir)


APPS = {  # the two servers' settings (make_app keywords)
    "served": dict(
        rows=2,
        max_positions=2048,
        max_tokens=4,
        rules=OptionRules(
            allow_policies={"snapkv", "streaming_llm", "kvzip"},
            max_budget=256,
            allow_layouts={"compact"},
            max_repair=16,
            allow_reuse={"segment"},
        ),
    ),
    "quantized": dict(
        rows=1, max_positions=1024, max_tokens=4, rules=OptionRules(kv_quant="triaxial", allow_kv_quant={"int4"}, max_kv_bits=3.5)
    ),
}


@pytest.fixture(scope="module")
def served(model):
    """A float pool, full cache by default; requests may choose snapkv or
    streaming_llm with a budget up to 256, the compact layout, RepairKV up to 16
    rows and segment reuse. Two API keys: two tenants."""
    app = make_app(model, model_name="tiny", api_keys=KEYS, **APPS["served"])
    with BackgroundServer(app) as running:
        running.state = app.state.jaxkv
        yield running


@pytest.fixture(scope="module")
def quantized(model):
    """A triaxial pool (TriAxialKV by default, the calibration's 3.0 bits); requests
    may choose int4 instead, and kv_bits up to 3.5. No API keys."""
    app = make_app(model, model_name="tiny", **APPS["quantized"])
    with BackgroundServer(app) as running:
        yield running


OFF = {"policy": None, "budget": None, "layout": None, "repair": 0, "kv_quant": None, "kv_bits": None, "reuse": None}


# ============================================================================ each option takes effect
def test_policy_and_budget_per_request(served, doc):
    msgs = document_chat(doc)
    _, full = ask(served.url, msgs, session_id="full")
    assert full["options"] == OFF and full["evicted_tokens"] == 0
    evicted_before = metric(served.url, "jaxkv_evicted_tokens_total")
    r, snap = ask(served.url, msgs, session_id="snap-48", policy="snapkv", budget=BUDGET)
    assert snap["options"] == {**OFF, "policy": "snapkv", "budget": BUDGET, "layout": "dead_slot"}
    live = r.usage.prompt_tokens  # every prompt token is live after the prefill: the event keeps B of them
    assert snap["evicted_tokens"] == live - BUDGET > 0
    _, wider = ask(served.url, msgs, session_id="snap-64", policy="snapkv", budget=BUDGET + 16)
    assert wider["evicted_tokens"] == snap["evicted_tokens"] - 16  # the budget is the request's
    _, streaming = ask(served.url, msgs, session_id="stream-48", policy="streaming_llm", budget=BUDGET)
    assert streaming["options"] == {**snap["options"], "policy": "streaming_llm"} and streaming["evicted_tokens"] > 0
    total = snap["evicted_tokens"] + wider["evicted_tokens"] + streaming["evicted_tokens"]
    assert metric(served.url, "jaxkv_evicted_tokens_total") - evicted_before == total  # the server's own count agrees


def test_kvzip_per_request_reports_the_tokens_it_forwarded_to_score(served, doc, model):
    """KVzip chosen per request: its event keeps B of the prompt, and the report
    counts its reconstruction pass (one chunk: the prompt after the template's
    prefix, behind the repeat prompt and the template's suffix); other policies
    forward nothing to score."""
    from jaxkv.policies import kvzip

    msgs = document_chat(doc, question="Which record is in the middle?")
    r, report = ask(served.url, msgs, session_id="kvzip-48", policy="kvzip", budget=BUDGET)
    assert report["options"] == {**OFF, "policy": "kvzip", "budget": BUDGET, "layout": "dead_slot"}
    live = r.usage.prompt_tokens
    assert report["evicted_tokens"] == live - BUDGET > 0
    prefix, suffix = kvzip.template_split(model.tokenizer)
    prompt = len(model.tokenizer.encode(kvzip.FIRST_PROMPT, add_special_tokens=False)) + suffix.size
    assert report["scoring_tokens"] == live - prefix + prompt
    _, snap = ask(served.url, msgs, session_id="kvzip-snap-48", policy="snapkv", budget=BUDGET)
    assert snap["scoring_tokens"] == 0 and snap["evicted_tokens"] == report["evicted_tokens"]


def test_layout_per_request(served, doc):
    msgs = document_chat(doc, question="Which record comes last?")
    _, dead = ask(served.url, msgs, session_id="dead", policy="snapkv", budget=BUDGET)
    _, compact = ask(served.url, msgs, session_id="compact", policy="snapkv", budget=BUDGET, layout="compact")
    assert dead["options"]["layout"] == "dead_slot" and compact["options"]["layout"] == "compact"
    assert dead["evicted_tokens"] == compact["evicted_tokens"] > 0
    assert dead["compacted_tokens"] == 0 and compact["compacted_tokens"] == BUDGET  # the kept rows were copied together
    # a stream carries the same report in its usage chunk
    stream = client(served.url).chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"session_id": "compact-stream", "policy": "snapkv", "budget": BUDGET, "layout": "compact"},
    )
    last = [chunk for chunk in stream][-1]
    assert last.usage is not None and last.model_extra["jaxkv"] == compact


def test_repair_per_request(served, doc):
    first = document_chat(doc, question="Name the first record.")
    second = first + [{"role": "assistant", "content": "The first."}, {"role": "user", "content": "And the second one?"}]
    for sid, k in (("no-repair", 0), ("repair-16", 16)):
        options = dict(session_id=sid, policy="snapkv", budget=BUDGET, repair=k)
        _, one = ask(served.url, first, **options)
        _, two = ask(served.url, second, **options)
        assert one["options"]["repair"] == two["options"]["repair"] == k
        assert one["repaired_rows"] == 0  # nothing was shelved before the first turn
        assert two["repaired_rows"] == k  # K rows evicted by turn one promoted back at the boundary


def test_kv_quant_and_kv_bits_per_request(quantized, doc):
    msgs = [
        {"role": "system", "content": "You are a research agent."},  # the document in the current turn: the toy calibration's INT2 tags
        {"role": "user", "content": f"{doc.text}\nWhat is the first record?"},
    ]
    _, default = ask(quantized.url, msgs, session_id="triaxial")
    assert default["options"] == {**OFF, "kv_quant": "triaxial", "kv_bits": 3.0}  # the pool's mode, the calibration's B
    assert 2.0 < default["kv_avg_bits"] < 4.0  # INT2 where the calibration says, INT4 elsewhere
    r, int4 = ask(quantized.url, msgs, session_id="int4", kv_quant="int4")
    assert int4["options"] == {**OFF, "kv_quant": "int4"} and int4["kv_avg_bits"] == 4.0
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the triaxial session's cached INT2 rows are not INT4 ones
    _, low = ask(quantized.url, msgs, session_id="bits-2", kv_bits=2)
    _, high = ask(quantized.url, msgs, session_id="bits-3.5", kv_bits=3.5)
    assert low["options"]["kv_bits"] == 2.0 and high["options"]["kv_bits"] == 3.5
    assert (
        2.0 <= low["kv_avg_bits"] < default["kv_avg_bits"] <= high["kv_avg_bits"] <= 4.0
    )  # the request's budget sets the precision (2 bits: more INT2 pages)
    r, again = ask(quantized.url, msgs, session_id="triaxial-again")
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1  # the same precision shares its prefix
    for extra, code, param in [
        ({"kv_bits": 4}, "option_not_allowed", "kv_bits"),
        ({"kv_quant": "kivi2"}, "option_not_allowed", "kv_quant"),
        ({"kv_quant": "none"}, "option_not_allowed", "kv_quant"),
        ({"kv_quant": "int4", "kv_bits": 3}, "invalid_value", "kv_bits"),
        ({"kv_bits": 1.5}, "invalid_value", "kv_bits"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            ask(quantized.url, msgs, session_id="refused", **extra)
        assert (err.value.status_code, err.value.body["type"], err.value.code, err.value.param) == (
            400,
            "invalid_request_error",
            code,
            param,
        ), extra


def test_segment_reuse_is_scoped_by_tenant(served):
    """One document behind three different system prompts (so the radix prefix
    cache cannot serve it): tenant alpha stores its segments, tenant beta gets
    none of them, alpha's next conversation splices them. (A document no other
    test sends: nobody stored its segments before.)"""
    alpha, beta = KEYS
    doc = shared_corpus(5, n_shelves=1, length=600)[1]
    reused_before = metric(served.url, "jaxkv_segment_reused_tokens_total")
    _, a1 = ask(served.url, document_chat(doc, "You are agent one."), alpha, session_id="reuse-a1", reuse="segment")
    _, b1 = ask(served.url, document_chat(doc, "You are agent two, a different one."), beta, session_id="reuse-b1", reuse="segment")
    _, a2 = ask(served.url, document_chat(doc, "You are agent three, with another prompt."), alpha, session_id="reuse-a2", reuse="segment")
    assert a1["options"]["reuse"] == b1["options"]["reuse"] == a2["options"]["reuse"] == "segment"
    assert a1["reused_tokens"] == 0  # nothing stored yet
    assert b1["reused_tokens"] == 0  # alpha's segments never serve beta
    assert a2["reused_tokens"] > 0  # ...while they serve alpha
    _, a3 = ask(served.url, document_chat(doc, "You are agent four."), alpha, session_id="reuse-a3")
    assert a3["options"]["reuse"] is None and a3["reused_tokens"] == 0  # reuse is per request
    assert metric(served.url, "jaxkv_segment_reused_tokens_total") - reused_before == a2["reused_tokens"]
    # a session id is the tenant's: beta naming alpha's gets a session of its own (alpha's options are not its)
    _, b2 = ask(served.url, document_chat(doc, "You are agent one."), beta, session_id="reuse-a1")
    assert b2["options"]["reuse"] is None and b2["reused_tokens"] == 0


def test_one_tenants_sessions_prune_one_document_each_their_own_way(served, doc):
    """Two sessions of one tenant prune the same cached document with different
    policies: each owns its holes (when a tenant's sessions shared one radix
    owner, the second turn failed with a 500, RadixError from the hole sync)."""
    system = "You are a research agent."
    _, one = ask(
        served.url, document_chat(doc, system, "What is the first record?"), session_id="prune-1", policy="streaming_llm", budget=BUDGET
    )
    _, two = ask(served.url, document_chat(doc, system, "Which record comes last?"), session_id="prune-2", policy="snapkv", budget=BUDGET)
    assert one["evicted_tokens"] > 0 and two["evicted_tokens"] > 0
    owners = {
        e.session.cache_owner for (tenant, key), e in served.state.store._entries.items() if key in ("explicit:prune-1", "explicit:prune-2")
    }
    assert len(owners) == 2
    served.state.server.radix.check_invariants()


# ============================================================================ HTTP against the library
HTTP_CASES = [  # (fixture, extra_body): each mechanism chosen per request over HTTP
    ("served", {"policy": "snapkv", "budget": BUDGET}),
    ("served", {"policy": "streaming_llm", "budget": BUDGET, "layout": "compact"}),
    ("served", {"policy": "snapkv", "budget": BUDGET, "repair": 16}),
    ("served", {"reuse": "segment"}),
    ("quantized", {"kv_quant": "int4"}),
    ("quantized", {"kv_bits": 2}),
]


@pytest.mark.parametrize("fixture,extra", HTTP_CASES, ids=lambda x: x if isinstance(x, str) else "+".join(x))
def test_every_per_request_option_matches_its_session(model, fixture, extra):
    """A two-turn conversation sent over HTTP with ``extra`` to a fresh app, and
    the same turns through a ``Session`` built with the options that app resolves
    for it on a fresh ``Server`` of the same settings: the same replies and the
    same mechanism counts. (Fresh on both sides: cached prefixes keep the
    precision they were first written at, so what earlier requests left in a
    pool can change a quantized reply.) Reuse runs a first conversation that
    stores the document, then one behind another system prompt that splices it."""
    settings = APPS[fixture]
    app = make_app(model, model_name="tiny", **settings)
    options = settings["rules"].resolve(extra)
    with BackgroundServer(app) as running:
        over_http = _converse_over_http(running.url, extra)
    _compare_with_session(model, settings, options, extra, over_http)


def _conversations(extra) -> list:
    doc = shared_corpus(5, n_shelves=1, length=600)[2]
    systems = (
        ["You compare HTTP with the library.", "You are the second reader of it."]
        if "reuse" in extra
        else ["You compare HTTP with the library."]
    )
    return [[{"role": "system", "content": system}, {"role": "user", "content": f"Read this document.\n{doc.text}"}] for system in systems]


def _converse_over_http(url, extra) -> list:
    """Per conversation: (reply 1, reply 2, report 1, report 2)."""
    tag = "-".join(f"{k}{v}" for k, v in extra.items())
    over_http = []
    for c, msgs in enumerate(_conversations(extra)):
        first, report1 = ask(url, msgs, session_id=f"lib-{tag}-{c}", **extra)
        msgs2 = msgs + [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "What is the first record?"},
        ]
        second, report2 = ask(url, msgs2, session_id=f"lib-{tag}-{c}", **extra)
        over_http.append((first.choices[0].message.content, second.choices[0].message.content, report1, report2))
    return over_http


def _compare_with_session(model, settings, options, extra, over_http) -> None:
    kv_quant = settings["rules"].kv_quant
    with jaxkv.Server(model, rows=settings["rows"], max_positions=settings["max_positions"], kv_quant=kv_quant) as server:
        for (content1, content2, report1, report2), msgs in zip(over_http, _conversations(extra)):
            session = server.session(tenant="reference", **options) if "reuse" in extra else server.session(**options)
            one = session.chat(msgs, max_new_tokens=2)
            msgs2 = msgs + [
                {"role": "assistant", "content": one.get("content") or ""},
                {"role": "user", "content": "What is the first record?"},
            ]
            two = session.chat(msgs2, max_new_tokens=2)
            assert (one.get("content"), two.get("content")) == (content1, content2), extra
            if "reuse" in extra:
                reused = sum(r.spliced_tokens for r in session.reuse.reports)
                assert reused == report1["reused_tokens"] + report2["reused_tokens"], extra
            evicted = sum(c.live_before - c.live_after for c in session.compressions)
            assert evicted == report1["evicted_tokens"] + report2["evicted_tokens"], extra
            assert sum(r.promoted_positions.size for r in session.repairs) == report1["repaired_rows"] + report2["repaired_rows"], extra
    if "reuse" in extra:
        assert over_http[1][2]["reused_tokens"] > 0  # the second conversation did splice
    if "repair" in extra:
        assert over_http[0][3]["repaired_rows"] > 0
    if "policy" in extra:
        assert over_http[0][3]["evicted_tokens"] > 0
    assert all(c1 and c2 for c1, c2, _, _ in over_http)  # replies to compare, not two empty strings


# ============================================================================ what is refused
REFUSED = [  # (extra_body, code, param)
    ({"policy": "tova", "budget": 64}, "option_not_allowed", "policy"),
    ({"policy": "nonsense", "budget": 64}, "invalid_value", "policy"),
    ({"policy": "snapkv", "budget": 512}, "option_not_allowed", "budget"),
    ({"policy": "snapkv"}, "missing_required_parameter", "budget"),
    ({"budget": 64}, "invalid_value", "budget"),  # a budget without a policy
    ({"layout": "compact"}, "invalid_value", "layout"),  # a layout without a policy
    ({"policy": "snapkv", "budget": 64, "layout": "diagonal"}, "invalid_value", "layout"),
    ({"policy": "snapkv", "budget": 64, "repair": 32}, "option_not_allowed", "repair"),
    ({"policy": "snapkv", "budget": 64, "layout": "compact", "repair": 8}, "invalid_value", "repair"),
    ({"repair": 8}, "invalid_value", "repair"),  # nothing to repair in a full cache
    ({"reuse": "cacheblend"}, "option_not_allowed", "reuse"),
    ({"reuse": True}, "invalid_value", "reuse"),
    ({"kv_quant": "int4"}, "option_not_allowed", "kv_quant"),  # a float pool serves full precision only
    ({"kv_bits": 3}, "invalid_value", "kv_bits"),
    ({"tenant": "key-beta"}, "unknown_parameter", "tenant"),  # the tenant is the API key, never a field
]


def test_the_allow_list_refuses_in_openais_shape(served, doc):
    msgs = document_chat(doc)
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    for extra, code, param in REFUSED:
        r = httpx.post(
            served.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": msgs, "max_tokens": 1, "session_id": "refused", **extra},
            headers=headers,
            timeout=60,
        )
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param), (extra, err)
        assert param in err["message"] or code != "option_not_allowed", err
    with pytest.raises(openai.BadRequestError) as err:  # the client's exception carries the same fields
        ask(served.url, msgs, session_id="refused", reuse="cacheblend")
    assert err.value.code == "option_not_allowed" and err.value.param == "reuse" and "allowed" in err.value.message
    assert "refused" not in str(list(served.state.store._entries))  # no session was made for a refused request
    assert metric(served.url, 'jaxkv_http_responses_total{status="500"}') == 0


def test_a_session_keeps_its_options(served, doc):
    msgs = document_chat(doc, question="Keep these options?")
    _, made = ask(served.url, msgs, session_id="kept", policy="snapkv", budget=BUDGET, reuse="segment")
    _, same = ask(served.url, msgs, session_id="kept", policy="snapkv", budget=BUDGET)  # naming the same ones, or none: the session as made
    _, silent = ask(served.url, msgs, session_id="kept")
    assert (
        made["options"]
        == same["options"]
        == silent["options"]
        == {**OFF, "policy": "snapkv", "budget": BUDGET, "layout": "dead_slot", "reuse": "segment"}
    )
    for extra, param in [
        ({"policy": "streaming_llm", "budget": BUDGET}, "policy"),
        ({"policy": "snapkv", "budget": 64}, "budget"),
        ({"reuse": None}, "reuse"),
        ({"policy": "snapkv", "budget": BUDGET, "layout": "compact"}, "layout"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            ask(served.url, msgs, session_id="kept", **extra)
        assert err.value.code == "session_options_mismatch" and err.value.param == param, extra


def test_a_session_that_cannot_be_built_is_a_400(served, doc, monkeypatch):
    def refuse(**options):
        raise RadixError("the stages refuse these options together")

    monkeypatch.setattr(served.state.server, "session", refuse)
    with pytest.raises(openai.BadRequestError) as err:
        ask(served.url, document_chat(doc), session_id="unbuildable", reuse="segment")
    assert err.value.status_code == 400 and err.value.body["type"] == "invalid_request_error" and "refuse" in err.value.message


# ============================================================================ start-up
def test_allow_lists_the_server_cannot_serve_fail_at_start_up(model, tmp_path):
    from jaxkv import cli
    from jaxkv.server.run import rules_from_args

    def rules(*flags):
        return rules_from_args(cli.build_parser().parse_args(["serve", *flags]))

    for flags in (
        ["--allow", "kv_quant=int4"],  # a float pool cannot hold packed rows
        ["--kv-quant", "int4", "--allow", "kv_quant=triaxial"],  # an INT4 pool has no INT2 pages
        ["--kv-quant", "kivi2", "--allow", "kv_quant=int4"],
        ["--kv-quant", "int4", "--allow", "kv_bits=3"],  # kv_bits without a triaxial mode
        ["--kv-quant", "triaxial", "--allow", "kv_bits=5"],
        ["--allow", "policy=snapkv,nonsense"],
        ["--allow", "layout=diagonal"],
        ["--allow", "reuse=everything"],
        ["--allow", "tenant=a"],
        ["--allow", "repair=many"],
        ["--allow", "repair=8", "--max-repair", "16"],
    ):
        with pytest.raises(ConfigError):
            rules(*flags)
    every = rules(
        "--kv-quant", "triaxial", "--allow", "kv_quant=all", "--allow", "policy=snapkv", "--allow-policies", "h2o", "--max-budget", "512"
    )
    assert every.allow_kv_quant == {"int4", "triaxial", "triaxial_no_temporal", "triaxial_no_semantic"}
    assert every.allow_policies == {"snapkv", "h2o"} and every.max_budget == 512
    # the pool and the calibration are checked by building the sessions, before the app exists
    missing = OptionRules(kv_quant="triaxial", kv_allocation=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="calibration"):
        make_app(model, model_name="tiny", rows=1, max_positions=256, rules=missing)
    with pytest.raises(ConfigError, match="the pool has one format"):
        make_app(model, model_name="tiny", rows=1, max_positions=256, rules=OptionRules(kv_quant="int4"), kv_quant="triaxial")


def test_prefill_chunk_reaches_the_engine_from_the_command_line(model):
    """``jaxkv serve --prefill-chunk N``: the engine takes at most N prompt tokens of a
    turn per step, and its step budget is N plus a token of every row."""
    import argparse

    from jaxkv.buckets import token_budget
    from jaxkv.server.run import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "x", "--prefill-chunk", "64", "--rows", "2"])
    app = make_app(model, model_name="tiny", rows=args.rows, max_positions=512, prefill_chunk=args.prefill_chunk)
    try:
        engine = app.state.jaxkv.server.engine
        assert engine.prefill_chunk == 64 and engine.token_budget == token_budget(64, 2) < token_budget(512, 2)
    finally:
        app.state.jaxkv.server.close()
