"""Sessions over the engine: radix prefix reuse across turns, parity of every turn
with the cache-free oracle, chat parsing, bad input."""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
from jaxkv.chat import build_tokenizer
from jaxkv.chat.toy import schema
from jaxkv.config import ModelConfig
from jaxkv.serving import Server, Session

WORDS = "weather paris london rome tokyo sunny rainy cloudy degrees find city compare the is and in what then answer ok".split()
TOOLS = [schema("get_weather", "current weather", city="city name"), schema("convert", "units", value="number")]


@pytest.fixture(scope="module")
def agent_model():
    tok = build_tokenizer(WORDS)
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
        max_position_embeddings=2048,
        eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
    )
    return jaxkv.model_from_config(cfg, seed=0, tokenizer=tok)


def _call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def six_turn_conversation():
    msgs = [
        {"role": "system", "content": "find the weather and answer"},
        {"role": "user", "content": "what is the weather in paris and rome"},
    ]
    cities = ["paris", "rome", "london", "tokyo", "paris"]
    for i, city in enumerate(cities):
        msgs.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"find {city} then compare",
                "tool_calls": [_call("get_weather", city=city)],
            }
        )
        msgs.append({"role": "tool", "content": f"{city} is {['sunny', 'rainy', 'cloudy'][i % 3]} and {10 + i} degrees"})
    msgs.append({"role": "assistant", "content": "paris is sunny and rome is rainy", "reasoning_content": "compare"})
    return msgs


def test_six_turn_replay_reuses_prefix_and_matches_oracle(agent_model):
    msgs = six_turn_conversation()
    session = Session(agent_model, keep_reasoning=True, max_positions=1024)
    turns = session.replay(msgs, TOOLS, return_logits=True)
    assert len(turns) == 6
    # The cache-free oracle of every turn: one causal run over the last turn's
    # request, cut at each turn's length (each request extends the previous one,
    # asserted below; a row's logits depend only on the tokens up to it).
    last = np.concatenate([turns[-1].prompt_ids, turns[-1].target_ids])
    oracle_all = np.asarray(jaxkv.score_logits(agent_model, last[None]))[0]
    previous = None
    for t, turn in enumerate(turns):
        full = np.concatenate([turn.prompt_ids, turn.target_ids])
        assert last[: full.size].tolist() == full.tolist()
        oracle = oracle_all[: full.size]
        got = np.concatenate([turn.prompt_logits, turn.target_logits])
        ref = oracle[turn.prefix_hit :]
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-4
        if previous is not None:
            # The whole previous request (its prompt and its recorded reply) is reused.
            assert turn.prefix_hit == previous.size
            assert turn.prompt_ids[: previous.size].tolist() == previous.tolist()
        previous = full
    m = session.metrics.as_dict()
    prompt_tokens = sum(t.prompt_ids.size for t in turns)
    assert m["prefix_hit_tokens"] == sum(t.prefix_hit for t in turns)
    assert m["prefix_hit_rate"] == pytest.approx(m["prefix_hit_tokens"] / prompt_tokens)
    assert m["prefix_hit_rate"] > 0.7
    print(f"6-turn replay prefix-hit rate: {m['prefix_hit_rate']:.3f}")
    # return_logits="reply": the prompt's last row only, and the reply's rows, as with True
    lean = Session(agent_model, keep_reasoning=True, max_positions=1024).replay(msgs, TOOLS, return_logits="reply")
    for turn, every in zip(lean, turns):
        assert turn.prompt_logits.shape == (1, every.prompt_logits.shape[1])
        assert np.abs(turn.prompt_logits[0] - every.prompt_logits[-1]).max() <= 1e-5 * np.abs(every.prompt_logits[-1]).max()
        assert np.abs(turn.target_logits - every.target_logits).max() <= 1e-5 * np.abs(every.target_logits).max()
    with pytest.raises(ValueError, match="return_logits"):
        Session(agent_model, max_positions=1024).replay(msgs, TOOLS, return_logits="all")


def test_dropped_reasoning_diverges_and_is_handled(agent_model):
    """Qwen3's template drops earlier reasoning: the prefix match stops at the
    divergence and everything after it is prefilled again, still exactly."""
    msgs = six_turn_conversation()[:6] + [{"role": "user", "content": "and tokyo"}, {"role": "assistant", "content": "ok"}]
    session = Session(agent_model, keep_reasoning=False, max_positions=1024)
    turns = session.replay(msgs, TOOLS, return_logits=True)
    last = turns[-1]
    first = np.concatenate([turns[0].prompt_ids, turns[0].target_ids])
    diverge = jaxkv.cache.radix.common_prefix_length(first, last.prompt_ids)
    assert diverge < first.size  # the old reasoning is gone from the new prompt
    assert last.prefix_hit >= diverge
    oracle = np.asarray(jaxkv.score_logits(agent_model, last.prompt_ids[None]))[0][last.prefix_hit :]
    assert np.abs(last.prompt_logits - oracle).max() / np.abs(oracle).max() <= 1e-4


def test_chat_returns_parsed_message_and_shares_server(agent_model):
    server = Server(agent_model, max_positions=1024)  # the replay tests' engine shape: their programs
    a, b = server.session(), server.session()
    conv = [{"role": "system", "content": "find the weather"}, {"role": "user", "content": "weather in paris"}]
    reply = a.chat(conv, TOOLS, max_new_tokens=8)
    assert reply["role"] == "assistant" and isinstance(reply.get("content"), str)
    hit_before = b.metrics.as_dict()["prefix_hit_tokens"]
    b.chat([conv[0], {"role": "user", "content": "weather in rome"}], TOOLS, max_new_tokens=4)
    assert b.metrics.as_dict()["prefix_hit_tokens"] > hit_before  # shared system prompt + tools
    assert a.session_id != b.session_id
    # After both turns, only the radix cache holds slots.
    assert server.engine.allocator.num_used == server.radix.held_slots().size


def test_bad_input(agent_model):
    session = Session(agent_model, max_positions=256)
    with pytest.raises(jaxkv.errors.ChatError):
        session.chat([])
    with pytest.raises(jaxkv.errors.ChatError, match="wizard"):
        session.chat([{"role": "wizard", "content": "hi"}])
    with pytest.raises(jaxkv.errors.ChatError, match="fly"):  # malformed: arguments neither JSON text nor an object
        session.chat(
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "fly", "arguments": 7}}]},
                {"role": "user", "content": "y"},
            ],
            TOOLS,
        )
    # A call to a tool that was not offered is well formed: it renders and the turn runs.
    assert (
        session.chat(
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [_call("fly", to="rome")]},
                {"role": "user", "content": "y"},
            ],
            max_new_tokens=2,
        )["role"]
        == "assistant"
    )
    long = [{"role": "user", "content": " ".join(["weather"] * 400)}]
    with pytest.raises(jaxkv.ContextLengthError, match=r"\d+ tokens \+ 16 new tokens exceeds the context of 256"):
        session.chat(long, max_new_tokens=16)
    # Nothing leaked: no row open, no slot held.
    assert session.server.engine.allocator.num_used == session.server.radix.held_slots().size
    assert all(r is None for r in session.server.engine.row_state)


def test_private_server_stops_with_its_session(agent_model):
    """A session's private server (its scheduler thread holds the pool) stops on
    close, and when the session is dropped without close; a shared one keeps going."""
    import gc
    import weakref

    conv = [{"role": "user", "content": "weather in paris"}]
    session = Session(agent_model, max_positions=256)
    session.chat(conv, max_new_tokens=2)
    thread = session.server.scheduler._thread
    session.close()
    session.close()  # idempotent
    assert session.closed and not thread.is_alive()
    with pytest.raises(jaxkv.JaxKVError, match="closed"):
        session.chat(conv, max_new_tokens=2)

    dropped = Session(agent_model, max_positions=256)
    dropped.chat(conv, max_new_tokens=2)
    thread, engine = dropped.server.scheduler._thread, weakref.ref(dropped.server.engine)
    del dropped
    gc.collect()  # the session (a cycle with its stages): its finalizer stops the server
    thread.join(10)
    gc.collect()  # then the server, engine and pool are garbage
    assert not thread.is_alive() and engine() is None

    server = Server(agent_model, max_positions=256)
    shared = server.session()
    shared.chat(conv, max_new_tokens=2)
    shared.close()
    assert not shared.closed and server.scheduler._thread.is_alive()
    assert server.session().chat(conv, max_new_tokens=2)["role"] == "assistant"
    server.close()


def test_closing_a_session_frees_its_pool_without_a_garbage_collection(agent_model):
    """A private server and its engine refer to each other (the reclaim hook), so
    the pool's device arrays used to wait for the cycle collector: an evaluation
    replaying one session per example grew ~380 MB of SmolLM2 KV per example.
    Closing frees them at once; the closed engine then refuses work (typed)."""
    import gc

    import jax

    conv = [{"role": "user", "content": "weather in paris"}]
    gc.collect()
    gc.disable()
    try:
        before = {id(a) for a in jax.live_arrays()}
        for _ in range(3):
            session = Session(agent_model, max_positions=384)  # a pool shape no other test makes
            session.chat(conv, max_new_tokens=2)
            engine, pool_shape = session.server.engine, session.server.engine.cache.k.shape
            session.close()
            del session
        left = [a.shape for a in jax.live_arrays() if id(a) not in before]
    finally:
        gc.enable()
    assert pool_shape not in left, left
    assert engine.closed
    with pytest.raises(jaxkv.JaxKVError, match="engine is closed"):
        engine.open_row()
