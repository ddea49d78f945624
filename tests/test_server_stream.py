"""What the HTTP server builds on, without HTTP: streamed deltas, stop strings,
tool_choice, the positional reasoning split, radix-cache namespaces, tenants and
the options a request may set.

* ``ReplyStream``: for any token sequence, any split into pieces, any forced
  prefix, think state and stop strings, the deltas concatenate exactly to the
  final parse; no markup fragment or broken character is sent on the way.
* ``Session.start_chat(stop=...)`` cuts the reply and ends the turn early; the
  turn is still cached. ``ChatHandle.stop`` does the same from outside.
* ``NamespacedRadix``: namespaces never match each other's prefixes and share
  one pool's accounting.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv.cache.allocator import SlotAllocator
from jaxkv.cache.radix import NamespacedRadix, RadixTree
from jaxkv.chat import ReplyFormat, forced_call_prefix, parse_assistant
from jaxkv.chat.toy import schema
from jaxkv.errors import ChatError, SessionBusyError
from jaxkv.server.errors import APIError
from jaxkv.server.sessions import OptionRules, SessionStore, Tenants, load_api_keys, tenant_of
from jaxkv.server.streaming import MARKERS, ReplyStream
from jaxkv.tasks import embedded_tokenizer

TOKENIZER = embedded_tokenizer()
PIECES = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|im_end|>",
    "\n",
    "\n\n",
    " ",
    "  ",
    '{"name": "search", "arguments": {"query": "Ember"}}',
    '{"name": "open", "arguments": {"doc_id": "d019"}}',
    '{"name": "nope"',
    "Answer",
    ":",
    " k086",
    " v276",
    " the",
    " report",
    ".",
    "<",
    "é",
    "日本",
]


def token_ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def stream_all(ids, fmt: ReplyFormat, cuts):
    """Feed ``ids`` in pieces split at ``cuts``; returns (deltas during the stream, final deltas, final reply)."""
    stream = ReplyStream(TOKENIZER, fmt, iter(f"call_{i}" for i in range(100)).__next__)
    during = []
    for a, b in zip([0, *cuts], [*cuts, len(ids)]):
        seen = fmt.prefix + TOKENIZER.decode(ids[:b], skip_special_tokens=False)
        during += [{**d, "seen": seen} for d in stream.feed(ids[a:b])]
    text = fmt.prefix + TOKENIZER.decode(ids, skip_special_tokens=False)
    cut = fmt.find_stop(text)
    final = fmt.parse(text if cut is None else text[:cut])
    return during, stream.finish(final), final


def joined(deltas, field):
    return "".join(d[field] for d in deltas if field in d)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(st.sampled_from(PIECES), min_size=0, max_size=24),
    n_cuts=st.integers(0, 8),
    seed=st.integers(0, 2**16),
    think_open=st.booleans(),
    forced=st.sampled_from([None, "required", "search"]),
    stops=st.lists(st.sampled_from(["report", "k086", "</tool_call>", "\n\n", "zz"]), max_size=2),
    tools=st.sampled_from([None, ("search", "open"), ()]),
)
def test_stream_deltas_concatenate_to_the_final_message(parts, n_cuts, seed, think_open, forced, stops, tools):
    prefix = "" if forced is None else forced_call_prefix("chatml", None if forced == "required" else forced)
    fmt = ReplyFormat(prefix, think_open and not prefix, tools, tuple(stops))
    ids = token_ids("".join(parts))
    rng = np.random.default_rng(seed)
    cuts = sorted(set(rng.integers(0, len(ids) + 1, size=n_cuts).tolist())) if ids else []
    during, end, final = stream_all(ids, fmt, cuts)
    deltas = during + end
    assert joined(deltas, "content") == final["content"]
    assert joined(deltas, "reasoning_content") == (final["reasoning_content"] or "")
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == list(range(len(final["tool_calls"])))
    assert [c["function"] for c in calls] == [c["function"] for c in final["tool_calls"]]
    text = fmt.prefix + TOKENIZER.decode(ids, skip_special_tokens=False)
    sent = ""
    for d in during:  # on the way: no broken character, and no markup fragment as content: what was sent
        # is a prefix of the content of the text seen so far without its trailing partial marker
        assert "\ufffd" not in d.get("content", "") + d.get("reasoning_content", "")
        sent += d.get("content", "")
        if "content" in d and fmt.find_stop(text) is None:
            seen = d["seen"]
            j = seen.rfind("<")
            if j >= 0 and any(m.startswith(seen[j:]) and m != seen[j:] for m in MARKERS):
                seen = seen[:j]
            assert fmt.parse(seen)["content"].startswith(sent), (d, seen)


def test_a_tool_call_reply_streams_reasoning_then_one_call_and_no_markup():
    text = '<think>\nFirst, the search for Ember.\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {"query": "Ember"}}\n</tool_call><|im_end|>'
    ids = token_ids(text)
    fmt = ReplyFormat(tool_names=("search",))
    during, end, final = stream_all(ids, fmt, list(range(1, len(ids))))  # one token at a time
    assert joined(during, "reasoning_content") == "First, the search for Ember."
    assert all("content" not in d or d["content"] == "" for d in during + end)
    calls = [d for d in during if "tool_calls" in d]
    assert len(calls) == 1 and calls[0]["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"query": "Ember"}'}
    assert final["tool_calls"][0]["function"]["name"] == "search"


@pytest.mark.parametrize(
    "text",
    [
        '  Answer <tool_call>\n{"name": "search", "arguments": {"query": "Ember"}}\n</tool_call>',  # a call strips content
        'Answer  \n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call> then more',
        "<think>\nplan  \n</think>\n\n  Answer: v276<|im_end|>",
    ],
)
def test_whitespace_a_later_call_strips_is_never_sent_early(text):
    ids = token_ids(text)
    fmt = ReplyFormat(tool_names=("search",))
    during, end, final = stream_all(ids, fmt, list(range(1, len(ids))))
    assert joined(during + end, "content") == final["content"]
    assert joined(during + end, "reasoning_content") == (final["reasoning_content"] or "")


def test_multibyte_characters_are_never_split():
    ids = token_ids("Answer: 日本 é ok")
    assert len(ids) > len("Answer: 日本 é ok".split())  # the characters are spelled in bytes
    during, end, final = stream_all(ids, ReplyFormat(), list(range(1, len(ids))))
    assert final["content"] == "Answer: 日本 é ok"
    assert all("\ufffd" not in d.get("content", "") for d in during)
    assert joined(during + end, "content") == "Answer: 日本 é ok"


def test_positional_reasoning_split():
    # the prompt opened the block: everything up to </think> is reasoning
    assert parse_assistant("hmm\n</think>\n\nok", think_open=True)["reasoning_content"] == "hmm"
    # it did not: a stray </think> is content, and so is a <think> that does not start the reply
    msg = parse_assistant("ok </think> more", think_open=False)
    assert (msg["reasoning_content"], msg["content"]) == (None, "ok </think> more")
    assert parse_assistant("ok </think> more")["reasoning_content"] == "ok "  # the guess (think_open=None) differs
    msg = parse_assistant("a <think>b</think> c", think_open=False)
    assert msg["content"] == "a <think>b</think> c" and msg["reasoning_content"] is None
    msg = parse_assistant("  <think>\nplan\n</think>\n\nAnswer: x", think_open=False)
    assert (msg["reasoning_content"], msg["content"]) == ("plan", "Answer: x")
    msg = parse_assistant("<think>cut off", think_open=False)
    assert msg["reasoning_content"] == "cut off" and msg["parse_errors"] == ["unterminated <think> block"]


def test_forced_call_prefixes_and_stop_lookup():
    assert forced_call_prefix("chatml", "open") == '<tool_call>\n{"name": "open", "arguments": '
    assert forced_call_prefix("chatml") == '<tool_call>\n{"name": "'
    assert forced_call_prefix("llama3", "f") == '<|python_tag|>{"name": "f", "parameters": '
    with pytest.raises(ValueError):
        forced_call_prefix("unknown", "f")
    fmt = ReplyFormat(prefix="ab", stop=("b", "cd"))
    assert fmt.find_stop("abxcdxb") == 3  # only after the prefix; the earliest of all stops
    assert fmt.find_stop("abxx") is None


# ----------------------------------------------------------------------------- sessions
@pytest.fixture(scope="module")
def model(task_model_dir):
    return jaxkv.load_model(task_model_dir)


@pytest.fixture(scope="module")
def server(model):
    with jaxkv.Server(model, rows=2, max_positions=1024) as srv:
        yield srv


MESSAGES = [
    {"role": "system", "content": "You are a research agent."},
    {"role": "user", "content": "In the Meadow project, find facilities k086."},
]
TOOLS = [schema("search", "Search the index.", query="words"), schema("open", "Open a document.", doc_id="the id")]


def test_stop_string_cuts_the_reply_and_the_turn_is_still_cached(server):
    tok = server.model.tokenizer
    server.session().start_chat(MESSAGES, None, max_new_tokens=1).result()  # cache the prompt: both runs below reuse it
    free = server.session().start_chat(MESSAGES, None, max_new_tokens=40).result()
    text = tok.decode(free.reply_ids, skip_special_tokens=False)
    words = [w for w in text.split() if len(w) > 2 and text.find(w) > 0]
    assert words, f"the random model's reply has no word to stop at: {text!r}"
    stop = words[len(words) // 2]
    session = server.session()
    turn = session.start_chat(MESSAGES, None, max_new_tokens=40, stop=[stop]).result()
    assert turn.cached_tokens == free.cached_tokens == free.prompt_tokens - 1
    assert turn.finish_reason == "stop" and turn.text == text[: text.find(stop)]
    # reply_ids end with the token that completed the stop string (greedy: the free reply's start)
    assert turn.reply_ids == free.reply_ids[: len(turn.reply_ids)] and len(turn.reply_ids) < len(free.reply_ids)
    assert stop in tok.decode(turn.reply_ids, skip_special_tokens=False)
    assert stop not in tok.decode(turn.reply_ids[:-1], skip_special_tokens=False)
    again = session.start_chat(MESSAGES, None, max_new_tokens=4).result()
    assert again.cached_tokens == again.prompt_tokens - 1  # the stopped turn entered the radix cache
    with pytest.raises(ChatError):
        session.start_chat(MESSAGES, None, stop=[1, 2])


def test_handle_stop_ends_the_reply_early(server):
    from jaxkv.serving.scheduler import DECODE_CHUNK

    got, box = [], {}

    def on_tokens(ids):  # on the scheduler thread, between decode chunks
        got.extend(ids)
        if "handle" in box:
            box["handle"].stop()

    box["handle"] = handle = server.session().start_chat(MESSAGES, None, max_new_tokens=200, on_tokens=on_tokens)
    turn = handle.result()
    assert turn.finish_reason == "stop" and turn.reply_ids == got
    assert turn.reply_ids[-1] not in server.stop_token_ids  # it was our stop, not the model's
    assert len(turn.reply_ids) <= 1 + 2 * DECODE_CHUNK
    assert server.engine.free_rows == server.engine.rows


def test_tool_choice_none_and_errors(server):
    session = server.session()
    turn = session.start_chat(MESSAGES, TOOLS, max_new_tokens=8, tool_choice="none").result()
    assert turn.reply["tool_calls"] == [] and turn.finish_reason in ("stop", "length")
    with_tools = server.session().start_chat(MESSAGES, TOOLS, max_new_tokens=1).result()
    assert turn.prompt_tokens < with_tools.prompt_tokens  # rendered without the tool schemas
    forced = (
        server.session()
        .start_chat(MESSAGES, TOOLS, max_new_tokens=1, tool_choice={"type": "function", "function": {"name": "open"}})
        .result()
    )
    assert forced.text.startswith('<tool_call>\n{"name": "open", "arguments": ')
    for bad in ("sometimes", {"type": "function", "function": {"name": "rm"}}):
        with pytest.raises(ChatError):
            server.session().start_chat(MESSAGES, TOOLS, tool_choice=bad)
    with pytest.raises(ChatError):
        server.session().start_chat(MESSAGES, None, tool_choice="required")


# ----------------------------------------------------------------------------- namespaces
def test_radix_namespaces_never_share_a_prefix():
    alloc = SlotAllocator(64)
    tree = RadixTree(alloc)
    a, b = NamespacedRadix(tree, 0), NamespacedRadix(tree, 1)
    tokens = np.arange(10, 20)
    slots = alloc.allocate(10)
    owner = 5  # a session of namespace a whose policy will punch a hole: its rows are private
    a.insert(tokens, slots, owner=owner, private_from=0)
    alloc.release(slots)  # the tree holds them now
    assert a.match(tokens, lock=False, owner=owner).length == 10
    assert np.array_equal(a.match(tokens, lock=False, owner=owner).slots, slots)
    assert a.match(tokens, lock=False).length == 0  # private to its owner
    assert b.match(tokens, lock=False, owner=owner).length == 0 and tree.match(tokens, lock=False, owner=owner).length == 0
    m = b.match(tokens, owner=owner)
    assert m.length == 0
    b.unlock(m.handle)
    assert alloc.num_used == 10 and np.array_equal(np.sort(tree.held_slots()), np.sort(slots))
    tree.check_invariants()
    # holes: the view's positions exclude the namespace token
    holed = slots.copy()
    holed[3] = 0
    freed, filled = a.sync_holes(tokens, holed, owner=owner)
    assert freed.tolist() == [slots[3]] and filled.size == 0
    fresh = alloc.allocate(1)
    holed[3] = fresh[0]
    freed, filled = a.sync_holes(tokens, holed, owner=owner)
    assert filled.tolist() == [3]
    assert tree.evict(100).size == 9 and alloc.num_used == 1  # the filled slot keeps our own reference
    tree.check_invariants()


def test_sessions_in_other_namespaces_do_not_hit_each_others_cache(server):
    first = server.session(cache_namespace="tenant-a").start_chat(MESSAGES, None, max_new_tokens=2).result()
    other = server.session(cache_namespace="tenant-b").start_chat(MESSAGES, None, max_new_tokens=2).result()
    same = server.session(cache_namespace="tenant-a").start_chat(MESSAGES, None, max_new_tokens=2).result()
    assert first.cached_tokens == 0
    assert other.cached_tokens == 0
    assert same.cached_tokens == same.prompt_tokens - 1


# ----------------------------------------------------------------------------- tenants, options, store
def test_api_keys_from_values_and_files(tmp_path):
    keyfile = tmp_path / "keys.txt"
    keyfile.write_text("# team keys\nalpha\n\n beta \n")
    assert load_api_keys(["gamma", str(keyfile)]) == ["gamma", "alpha", "beta"]
    tenants = Tenants(["alpha", "beta"])
    assert tenants.authenticate("Bearer alpha") == tenant_of("alpha") != tenants.authenticate("bearer beta")
    for header in (None, "", "Bearer", "Bearer wrong", "Basic alpha", "alpha"):
        with pytest.raises(APIError) as err:
            tenants.authenticate(header)
        assert err.value.status == 401 and err.value.type == "authentication_error"
    assert "alpha" not in tenant_of("alpha")
    assert Tenants().authenticate(None) == "public"


def test_option_rules_allow_only_what_the_server_allows():
    rules = OptionRules("snapkv", 512, repair=16, allow_policies=frozenset({"h2o", "full"}), max_budget=1024, max_repair=32)
    assert rules.resolve({}) == {"keep_reasoning": False, "policy": "snapkv", "budget": 512, "layout": "dead_slot", "repair": 16}
    assert rules.resolve({"policy": "h2o", "budget": 256, "repair": 0}) == {
        "keep_reasoning": False,
        "policy": "h2o",
        "budget": 256,
        "layout": "dead_slot",
    }
    assert rules.resolve({"policy": None}) == {"keep_reasoning": False}  # the default repair needs a policy: off with the full cache
    for bad, code in [
        ({"policy": "tova"}, "option_not_allowed"),
        ({"budget": 4096}, "option_not_allowed"),
        ({"repair": 64}, "option_not_allowed"),
        ({"budget": 0}, "invalid_value"),
        ({"repair": "x"}, "invalid_value"),
    ]:
        with pytest.raises(APIError) as err:
            rules.resolve(bad)
        assert err.value.status == 400 and err.value.code == code and err.value.param == next(iter(bad))


def test_session_store_is_lru_never_evicts_in_use_and_bounds_waiters():
    import asyncio

    made, closed = [], []

    async def run():
        store = SessionStore(lambda key, opts: made.append(key) or object(), closed.append, capacity=2, max_waiting=1)
        a = store.checkout(("t", "a"), {}, set())
        b = store.checkout(("t", "b"), {}, set())
        store.checkin(b)
        c = store.checkout(("t", "c"), {}, set())  # evicts b (a is in use)
        await asyncio.sleep(0.05)
        assert [k for k in store._entries] == [("t", "a"), ("t", "c")] and len(closed) == 1
        store.checkout(("t", "a"), {}, set())  # one waiter allowed
        with pytest.raises(SessionBusyError):
            store.checkout(("t", "a"), {}, set())
        with pytest.raises(APIError) as err:
            store.checkout(("t", "c"), {"policy": "h2o"}, {"policy"})
        assert err.value.code == "session_options_mismatch"
        store.checkin(c)
        assert store.checkout(("t", "c"), {}, set()) is c  # unnamed options: the session's own

    asyncio.run(run())
    assert made == [("t", "a"), ("t", "b"), ("t", "c")]
