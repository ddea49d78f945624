"""The scheduler: many sessions served at once on one server (continuous batching).

* Eight sessions with mixed retention / repair options replay held-out agent
  traces of two lengths from eight threads on one ``Server(rows=8)``: their
  replies equal each session run alone, or differ through a near tie of the solo
  run (a compression decision or a reply token within 1e-4, each logged with its
  margin), and afterwards nothing leaks.
* A hypothesis state machine of arrivals, cancellations and pool pressure: every
  turn ends (a reply or a typed error) in bounded time, a turn that can never fit
  is refused with ``CapacityError``, a full queue with ``QueueFullError``, and no
  slot, row or radix lock leaks.
* asyncio: ``achat`` from concurrent tasks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv.chat import render
from jaxkv.models.loading import EMBEDDED_DIR
from jaxkv.serving import Server, Session
from conftest import TINY_WORDS, tiny_chat_model

OPTIONS = [
    {},
    {},
    {"policy": "snapkv", "budget": 768},
    {"policy": "snapkv", "budget": 768},
    {"policy": "h2o", "budget": 768, "repair": 32},
    {"policy": "h2o", "budget": 768, "repair": 32},
    {"policy": "intentkv_memory", "budget": 768},
    {"policy": "intentkv_memory", "budget": 768},
]


def assert_nothing_leaked(server: Server) -> None:
    """Only the radix cache holds slots, every allocator count agrees, no lock or row."""
    alloc = server.engine.allocator
    held = server.radix.held_slots()
    assert alloc.num_free + alloc.num_used == alloc.capacity
    assert np.array_equal(alloc.refcounts(), np.bincount(held, minlength=alloc.num_slots))
    assert alloc.num_used == np.unique(held).size
    assert server.radix.num_locked_nodes == 0
    assert all(state is None for state in server.engine.row_state)
    assert server.scheduler.idle()
    server.radix.check_invariants()


TRACE_LENGTHS = (1024, 2048)  # two trace lengths (1,536 dropped for the suite's time), batched together
TURNS = 2  # assistant turns replayed per trace (the suite's time)
NEAR_TIE = 1e-4  # a difference must come from a choice this close in the solo run
CHUNK = 128  # prefill tokens per piece: step buckets 16-144, five programs per step variant (512: seven)


def explain_differences(alone, together, alone_sessions, together_sessions):
    """For every turn whose reply differs between a session run alone and batched,
    the cause in the solo run: the first compression decision that flipped (its
    score margin, ``CompressionReport.decision_margin``) or else the first
    divergent reply token (its top-2 logit margin). Returns
    ``(turns, same, [(session, turn, what, margin)])``."""
    turns = same = 0
    diffs = []
    for i, (a_turns, b_turns) in enumerate(zip(alone, together)):
        assert len(a_turns) == len(b_turns)
        a_rep, b_rep = alone_sessions[i].compressions, together_sessions[i].compressions
        flip = next((k for k, (x, y) in enumerate(zip(a_rep, b_rep)) if not np.array_equal(x.kept_positions, y.kept_positions)), None)
        if flip is None and len(a_rep) != len(b_rep):
            flip = min(len(a_rep), len(b_rep))
        for t, (a, b) in enumerate(zip(a_turns, b_turns)):
            turns += 1
            if a.reply_ids == b.reply_ids:
                same += 1
                continue
            if flip is not None:
                margin = a_rep[flip].decision_margin if flip < len(a_rep) else float("inf")
                diffs.append((i, t, f"compression decision {flip} flipped", margin))
                continue
            k = next((k for k, (x, y) in enumerate(zip(a.reply_ids, b.reply_ids)) if x != y), min(len(a.reply_ids), len(b.reply_ids)))
            margin = float(a.reply_margins[k]) if k < len(a.reply_margins) else float("inf")
            diffs.append(
                (
                    i,
                    t,
                    f"reply token {k} ({a.reply_ids[k] if k < len(a.reply_ids) else None} alone, "
                    f"{b.reply_ids[k] if k < len(b.reply_ids) else None} batched)",
                    margin,
                )
            )
    return turns, same, diffs


def test_differences_are_explained_by_the_first_flip_or_token():
    """``explain_differences`` blames a compression flip before any token, else the
    first divergent reply token, with the solo run's margin."""
    from types import SimpleNamespace as NS

    turn = lambda ids, margins: NS(reply_ids=ids, reply_margins=np.asarray(margins, np.float32))  # noqa: E731
    report = lambda kept, margin: NS(kept_positions=np.asarray(kept), decision_margin=margin)  # noqa: E731
    alone = [[turn([1, 2, 3], [5, 3e-6, 1])], [turn([4, 5], [2, 2]), turn([6], [1])]]
    together = [[turn([1, 9, 3], [5, 1, 1])], [turn([4, 5], [2, 2]), turn([7], [1])]]
    alone_s = [NS(compressions=[]), NS(compressions=[report([0, 1], 0.5), report([0, 2], 2e-5)])]
    together_s = [NS(compressions=[]), NS(compressions=[report([0, 1], 0.5), report([0, 3], 2e-5)])]
    turns, same, diffs = explain_differences(alone, together, alone_s, together_s)
    assert (turns, same) == (3, 1)
    assert [(i, t, m) for i, t, _, m in diffs] == [(0, 0, pytest.approx(3e-6)), (1, 1, 2e-5)]
    assert "reply token 1" in diffs[0][2] and "compression decision 1" in diffs[1][2]


@pytest.mark.slow
@pytest.mark.skipif(not (EMBEDDED_DIR / "config.json").is_file(), reason="embedded model not installed")
def test_eight_concurrent_sessions_reply_as_if_alone():
    """8 sessions, each option kind at both trace lengths, batched together: every
    batched reply equals the session's solo reply, or differs through a near tie of
    the solo run (logged with its margin)."""
    from jaxkv.tasks import agent_traces
    from jaxkv.tasks.seeds import EVAL_SEED_BASE

    model = jaxkv.load_model("embedded")
    # Session i replays trace i of the batch of its length; OPTIONS lists each kind twice, so each kind
    # replays a trace of either length, and the server batches rows of both.
    traces = {length: agent_traces(8, EVAL_SEED_BASE + 4242, length=length) for length in TRACE_LENGTHS}
    examples = [traces[TRACE_LENGTHS[i % 2]][i] for i in range(8)]

    def replay(session, ex):
        last = sorted(t.message_index for t in ex.targets)[:TURNS][-1]
        return session.replay(ex.messages[: last + 1], ex.tools, generate=True, max_new_tokens=24, reply_margins=True)

    def run_alone(opt, ex):  # alone on a server of the batched one's shapes (its compiled programs)
        with Server(model, rows=8, max_positions=4096, prefill_chunk=CHUNK) as server:
            session = server.session(keep_reasoning=True, **opt)
            return session, replay(session, ex)

    alone_sessions, alone = zip(*(run_alone(opt, ex) for opt, ex in zip(OPTIONS, examples)))

    server = Server(model, rows=8, max_positions=4096, prefill_chunk=CHUNK)
    sessions = [server.session(keep_reasoning=True, **opt) for opt in OPTIONS]
    together: list = [None] * 8
    errors: list = []

    def run(i):
        try:
            together[i] = replay(sessions[i], examples[i])
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=900)
    assert not errors, errors
    turns, same, diffs = explain_differences(alone, together, alone_sessions, sessions)
    print(f"\n{same}/{turns} turns identical to the session run alone")
    for i, t, what, margin in diffs:
        print(
            f"  session {i} ({OPTIONS[i] or 'full cache'}, {TRACE_LENGTHS[i % 2]} tokens) turn {t}:"
            f" first difference at {what}; solo margin {margin:.2e}"
        )
    assert all(margin < NEAR_TIE for *_, margin in diffs), diffs
    assert turns >= 8 * 2
    assert server.scheduler.stats["turns_done"] == turns
    assert_nothing_leaked(server)
    server.close()


# ============================================================================ property test
WORDS = TINY_WORDS


@pytest.fixture(scope="module")
def small_model():
    return tiny_chat_model()


# (rows, slots): one row (every turn queues) in a roomy pool, and three rows (a padded
# decode bucket of 4) in a tight one, where concurrent turns press on the pool. Each pair
# is a compile set of its own; the tests below use only these two, with 32-token prefill
# pieces (step buckets 16, 32, 48), so they share their programs.
POOLS = ((1, 420), (3, 160))


def small_server(model, rows: int, slots: int, **options) -> Server:
    return Server(model, rows=rows, max_positions=256, num_slots=slots, decode_chunk=4, prefill_chunk=32, **options)


SESSION_KINDS = [
    {},
    {"policy": "snapkv", "budget": 24, "w": 4},
    {"policy": "h2o", "budget": 24, "repair": 4},
    {"policy": "random", "budget": 20, "layout": "compact"},
]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["turn", "turn", "turn", "cancel", "huge"]), st.integers(0, 5), st.integers(1, 60), st.integers(0, 24)),
        min_size=4,
        max_size=14,
    ),
    pool=st.sampled_from(POOLS),
    max_queue=st.integers(1, 4),
)
def test_scheduler_never_leaks_under_arrivals_cancellations_and_pressure(small_model, ops, pool, max_queue):
    rows, slots = pool
    rng = np.random.default_rng(len(ops) * 1000 + slots)
    server = small_server(small_model, rows, slots, max_queue=max_queue)
    sessions = [server.session(session_id=f"s{i}", **SESSION_KINDS[i % len(SESSION_KINDS)]) for i in range(6)]
    history = {i: [{"role": "system", "content": "answer"}] for i in range(6)}
    handles: dict = {}
    outcomes = []
    for kind, who, words, new in ops:
        handle = handles.get(who)
        if kind == "cancel":
            if handle is not None:
                handle.cancel()
            continue
        if handle is not None and not handle.future.done():
            continue  # one turn at a time per session
        if handle is not None:
            outcomes.append(handle.future)
        msg = " ".join(rng.choice(WORDS, words if kind == "turn" else 200))
        history[who].append({"role": "user", "content": msg})
        try:
            handles[who] = sessions[who].start_chat(history[who], max_new_tokens=new)
        except jaxkv.CapacityError:  # the turn needs more slots than the whole pool holds
            prompt = render(small_model.tokenizer, history[who]).ids.size
            assert sessions[who]._reservation(prompt + new) > server.engine.allocator.capacity
            history[who].pop()
        except jaxkv.ContextLengthError:
            history[who].pop()
        except jaxkv.QueueFullError:
            assert server.scheduler.queue_depth >= max_queue
            history[who].pop()
    outcomes += [h.future for h in handles.values()]
    done, pending = concurrent.futures.wait(outcomes, timeout=300)
    assert not pending, "every turn ends in bounded time"
    for f in done:
        if f.cancelled():
            continue
        err = f.exception()
        assert err is None or isinstance(err, jaxkv.JaxKVError), repr(err)
    assert_nothing_leaked(server)
    server.close()


def test_achat_from_concurrent_asyncio_tasks(small_model):
    server = small_server(small_model, *POOLS[1])
    a, b, c = (server.session(session_id=f"a{i}") for i in range(3))
    conv = [{"role": "system", "content": "answer"}, {"role": "user", "content": "weather in paris"}]

    async def main():
        return await asyncio.gather(a.achat(conv, max_new_tokens=6), b.achat(conv, max_new_tokens=6), c.achat(conv, max_new_tokens=6))

    replies = asyncio.run(main())
    with small_server(small_model, *POOLS[0]) as solo:
        alone = Session(small_model, server=solo).chat(conv, max_new_tokens=6)
    assert all(r == alone for r in replies)
    assert_nothing_leaked(server)
    server.close()


def test_a_session_runs_one_turn_at_a_time_and_bad_options_are_typed(small_model):
    server = small_server(small_model, *POOLS[0])
    s = server.session()
    conv = [{"role": "user", "content": "weather in paris " * 20}]
    h = s.start_chat(conv, max_new_tokens=30)
    with pytest.raises(jaxkv.SessionBusyError):
        s.start_chat(conv, max_new_tokens=2)
    h.result(timeout=120)
    with pytest.raises(jaxkv.ConfigError, match="unknown policy"):
        server.session(policy="nope", budget=10)
    with pytest.raises(jaxkv.ConfigError, match="unknown layout"):
        server.session(policy="snapkv", budget=10, layout="diagonal")
    with pytest.raises(jaxkv.ConfigError, match="repair policy"):
        server.session(policy="snapkv", budget=10, repair=4, repair_policy="psychic")
    with pytest.raises(jaxkv.OptionError, match="colour"):
        server.session(colour="blue")
    assert_nothing_leaked(server)
    server.close()


def test_a_decoding_row_never_waits_behind_a_long_prompt(small_model, monkeypatch):
    """While a long prompt is prefilled piece by piece, every engine step also gives
    each decoding row its next token (chunked prefill on a token budget): a reply
    that started first keeps growing, one token per step, and nothing leaks. (The
    steps' numbers are the engine tests': a row's tokens beside others are its
    solo tokens, ``tests/test_engine.py``.)"""
    import time

    server = Server(small_model, rows=2, max_positions=1024, prefill_chunk=32)  # the tiny model's context
    short = [{"role": "user", "content": "weather in paris"}]
    long = [{"role": "user", "content": " ".join(TINY_WORDS[i % len(TINY_WORDS)] for i in range(300))}]
    steps = []
    real_run = server.engine.run

    def run(step):  # every step the scheduler packs (``jaxkv.engine.packing``)
        steps.append((len(step.pieces), len(step.decode)))
        return real_run(step)

    monkeypatch.setattr(server.engine, "run", run)
    monkeypatch.setattr(server.scheduler, "decode_chunk", 1)  # the short turn decodes one token per call: still going when the prompt comes
    a, b = server.session(), server.session()
    first = a.start_chat(short, max_new_tokens=400)
    deadline = time.perf_counter() + 120
    while server.scheduler.stats["tokens_generated"] < 2:  # the short turn is decoding
        assert time.perf_counter() < deadline
        time.sleep(0.01)
    second = b.start_chat(long, max_new_tokens=4)
    first.result(timeout=300), second.result(timeout=300)
    mixed = [(p, d) for p, d in steps if p and d]
    assert len(mixed) >= 5, steps  # the long prompt took several steps, each with the short turn's next token in it
    assert_nothing_leaked(server)
    server.close()
