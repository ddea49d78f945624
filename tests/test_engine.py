"""Incremental consistency: chunked prefill + decode through the paged cache equals
the cache-free oracle, also on a fragmented pool; tables mirror the host."""

from __future__ import annotations

import numpy as np
import pytest

import jaxkv
from jaxkv.cache.allocator import SENTINEL_SLOT
from oracles import logits_over_kept


def _rel(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def qwen3(hf_checkpoint):
    return jaxkv.load_model(hf_checkpoint("qwen3")[0])


# One engine shape for the module (4 rows of 256 positions, 32-token chunks, the
# default 48-token budget: token buckets 16, 32, 48): every test builds a fresh
# engine of it, so the step and decode programs compile once for all of them.
ROWS, POSITIONS, CHUNK = 4, 256, 32


def _engine(model, **options):
    return jaxkv.Engine(model, rows=ROWS, max_positions=POSITIONS, prefill_chunk=CHUNK, **options)


def _run_incremental(model, engine, seqs, prefill_lens, n_decode):
    rows = [engine.open_row() for _ in seqs]
    pre = engine.prefill(rows, [s[:n] for s, n in zip(seqs, prefill_lens)], all_logits=True)
    _, dec = engine.decode(
        rows,
        [s[n] for s, n in zip(seqs, prefill_lens)],
        n_decode,
        return_logits=True,
        forced_tokens=[s[n + 1 : n + 1 + n_decode] for s, n in zip(seqs, prefill_lens)],
    )
    return rows, [np.concatenate([p, d]) for p, d in zip(pre, dec)]


def test_chunked_prefill_and_decode_match_score_logits(qwen3):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1024, 120).tolist(), rng.integers(0, 1024, 120).tolist()]
    engine = _engine(qwen3)  # 2-3 chunks
    prefill_lens, n_decode = [70, 45], 24
    rows, logits = _run_incremental(qwen3, engine, seqs, prefill_lens, n_decode)
    for seq, n, got in zip(seqs, prefill_lens, logits):
        # the oracle over the whole 120 tokens (one program for both rows: causal, so its first n + n_decode rows)
        ref = np.asarray(jaxkv.score_logits(qwen3, np.asarray([seq])))[0, : n + n_decode]
        assert got.shape == ref.shape
        assert _rel(got, ref) <= 1e-4
    _assert_tables_mirror_host(engine, rows)


def test_fragmented_pool_gives_same_logits(qwen3):
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 1024, 120).tolist()
    engine = _engine(qwen3)
    # Fragment the pool: another row takes 120 slots, then frees every other one.
    other = engine.open_row()
    engine.prefill([other], [rng.integers(0, 1024, 120).tolist()])
    taken = np.asarray(engine.row_state[other].slots)
    engine.close_row(other)
    held = engine.allocator.allocate(len(taken))  # re-take all ...
    engine.allocator.release(held[::2])  # ... and free every other: holes everywhere
    rows, logits = _run_incremental(qwen3, engine, [seq], [60], 24)
    slots = np.asarray(engine.row_state[rows[0]].slots)
    assert (np.diff(slots) != 1).any(), "the request's slots should not be contiguous"
    ref = np.asarray(jaxkv.score_logits(qwen3, np.asarray([seq])))[0, :84]  # test_chunked_prefill_...'s oracle program
    assert _rel(logits[0], ref) <= 1e-4
    _assert_tables_mirror_host(engine, rows)
    # Freed slots are reused: closing the row returns exactly its slots.
    freed = engine.close_row(rows[0])
    assert sorted(freed.tolist()) == sorted(slots.tolist())


def test_prefix_with_holes_is_neither_read_nor_refilled(qwen3):
    """A row installed with sentinel holes attends only to its live slots."""
    rng = np.random.default_rng(2)
    seq = rng.integers(0, 1024, 40).tolist()
    engine = _engine(qwen3)
    a = engine.open_row()
    engine.prefill([a], [seq[:30]])
    slots = list(engine.row_state[a].slots)
    holed = [SENTINEL_SLOT if 5 <= p < 12 else s for p, s in enumerate(slots)]
    b = engine.open_row(holed)
    assert engine.row_state[b].seq_len == 30 and len(engine.row_state[b].live) == 23
    got = engine.prefill([b], [seq[30:32]], all_logits=True)[0]
    keep = [p for p in range(30) if not 5 <= p < 12]
    ref = logits_over_kept(qwen3, seq[:30], keep, seq[30:32])
    assert _rel(got, ref) <= 1e-4


def test_a_step_serves_decode_rows_beside_prefill_pieces_within_its_budget(qwen3, monkeypatch):
    """One engine step takes the next token of every decoding row and prefill
    pieces of the waiting rows in what is left of the token budget, padded to a
    token bucket; each row's tokens and logits are those it gets alone."""
    import jaxkv.engine.runner as engine_mod
    from jaxkv import buckets

    rng = np.random.default_rng(3)
    decoding, long_prompt, short_prompt = (rng.integers(0, 1024, n).tolist() for n in (50, 80, 20))
    solo = _engine(qwen3)
    r = solo.open_row()
    solo.prefill([r], [decoding])
    want_tokens, _ = solo.decode([r], [7], 3)
    solo.close_row(r)
    r = solo.open_row()
    want_long = solo.prefill([r], [long_prompt], all_logits=True)[0]

    seen = []
    real_step = engine_mod.run_step
    monkeypatch.setattr(engine_mod, "run_step", lambda *a, **k: (seen.append(np.asarray(a[3].q_len_R)), real_step(*a, **k))[1])
    engine = _engine(qwen3)
    assert engine.token_budget == 48
    a, b, c = (engine.open_row() for _ in range(3))
    engine.prefill([a], [decoding])
    seen.clear()
    dec = engine.start_decode(a, 7, 3)
    jobs = [engine.start_prefill(b, long_prompt, all_logits=True), engine.start_prefill(c, short_prompt)]
    engine.step(prefill_jobs=jobs, decode_jobs=[dec])
    assert seen[0][:3].tolist() == [1, 32, 15]  # the decode token, a whole chunk, the rest of the 48-token budget
    assert dec.fed == 1 and jobs[0].done == 32 and jobs[1].done == 15
    while not (dec.finished and all(j.finished for j in jobs)):
        engine.step(prefill_jobs=jobs, decode_jobs=[dec])
    assert all(q.sum() <= 48 for q in seen)
    assert dec.tokens == want_tokens[0]
    assert _rel(jobs[0].result_logits(), want_long) <= 1e-5
    assert buckets.token_buckets(48) == [16, 32, 48] and buckets.token_buckets(160) == [16, 32, 64, 128, 160]


def test_a_step_is_padded_to_its_token_bucket(qwen3, monkeypatch):
    """The flat batch is padded to the smallest token bucket that holds it, so the
    steps compile once per bucket whatever the rows' lengths."""
    import jaxkv.engine.runner as engine_mod

    widths = []
    real_step = engine_mod.run_step
    monkeypatch.setattr(engine_mod, "run_step", lambda *a, **k: (widths.append(a[3].tokens_T.shape[0]), real_step(*a, **k))[1])
    engine = _engine(qwen3)
    assert engine.token_budget == 48  # a whole 32-token chunk beside a decode token per row, rounded up to 16
    rows = [engine.open_row(), engine.open_row()]
    for ns, width in (((20,), 32), ((3,), 16), ((20, 20), 48)):  # (20, 20): two rows' pieces in one step
        engine.prefill(rows[: len(ns)], [np.arange(n) % 1000 for n in ns])
        assert widths[-1] == width, (ns, widths)
    _assert_tables_mirror_host(engine, rows)


def test_out_of_slots_changes_nothing(qwen3):
    engine = _engine(qwen3)
    engine.allocator.allocate(engine.allocator.num_free - 49)  # 49 slots left
    row = engine.open_row()
    engine.prefill([row], [list(range(30))])
    before = (engine.allocator.refcounts(), engine.allocator.num_free, list(engine.row_state[row].slots))
    tables = [np.asarray(x).copy() for x in (engine.cache.slot_map, engine.cache.live_idx, engine.cache.live_len)]
    with pytest.raises(jaxkv.OutOfSlotsError):
        engine.prefill([row], [list(range(30))])
    with pytest.raises(jaxkv.OutOfSlotsError):
        engine.decode([row], [1], 25)
    assert (engine.allocator.refcounts() == before[0]).all()
    assert engine.allocator.num_free == before[1]
    assert engine.row_state[row].slots == before[2]
    for old, new in zip(tables, (engine.cache.slot_map, engine.cache.live_idx, engine.cache.live_len)):
        assert (old == np.asarray(new)).all()


def test_context_length_errors(qwen3):
    engine = jaxkv.Engine(qwen3, rows=1, max_positions=32)
    row = engine.open_row()
    with pytest.raises(jaxkv.ContextLengthError, match="32"):
        engine.prefill([row], [list(range(40))])
    with pytest.raises(jaxkv.ContextLengthError, match="512"):
        jaxkv.generate(qwen3, [[1, 2, 3]], 600)
    with pytest.raises(jaxkv.ContextLengthError):
        jaxkv.Engine(qwen3, max_positions=10_000)


def _assert_tables_mirror_host(engine, rows):
    slot_map = np.asarray(engine.cache.slot_map)
    live_idx = np.asarray(engine.cache.live_idx)
    live_len = np.asarray(engine.cache.live_len)
    seq_len = np.asarray(engine.cache.seq_len)
    for r in rows:
        st = engine.row_state[r]
        assert seq_len[r] == st.seq_len and (live_len[:, r] == len(st.live)).all()
        assert slot_map[r, : st.seq_len].tolist() == st.slots
        for j in range(live_idx.shape[0]):  # every layer's list (one, unless per-layer sets)
            assert live_idx[j, r, : live_len[j, r]].tolist() == st.live
        assert SENTINEL_SLOT not in st.live
        assert all(engine.allocator.refcount(s) >= 1 for s in st.live)


def test_decode_window_equals_per_step_gather(qwen3):
    """The CPU decode loop's once-per-call window (``jaxkv.backends.cpu_float.take_window``) gives
    the tokens, logits and query rows of gathering key blocks from the pool every
    step, on rows of different lengths, one with dead slots in its live list, and
    the window holds the call's own new tokens."""
    from jaxkv.policies import layouts

    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (90, 37, 61)]
    runs = {}
    for window in (True, False):
        engine = _engine(qwen3)
        engine.runner.use_window = window
        rows = [engine.open_row() for _ in prompts]
        engine.prefill(rows, prompts)
        keep = np.setdiff1d(np.arange(90), [2, 3, 40, 41, 77])  # dead slots inside row 0's list
        engine.kv.apply_layout(rows[0], layouts.dead_slot(engine.row_state[rows[0]].slots, keep))
        runs[window] = engine.decode(rows, [5, 6, 7], 12, return_logits=True, query_rows=True)
        assert engine.runner.uses_window(4, 256) == window
    (tok_w, log_w, aux_w), (tok_g, log_g, aux_g) = runs[True], runs[False]
    assert tok_w == tok_g
    for a, b in zip(log_w, log_g):
        assert _rel(a, b) <= 1e-6
    for a, b in zip(aux_w["q_rows"], aux_g["q_rows"]):  # layer > 0 queries carry the rounding of the layers below
        assert _rel(a, b) <= 1e-5


def test_a_kept_decode_window_equals_per_step_gather_across_calls(qwen3):
    """A decode call keeps its window (``DecodeState``) and the next call over the
    same rows starts from it, its new entries folded into the blocks
    (``DecodeWindow.roll``): consecutive calls, a truncation between two calls
    (kept), another row's prefill between two calls (dropped: copied again) and
    per-layer live lists give the tokens and logits of gathering key blocks from
    the pool every step."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (70, 29)]
    other = rng.integers(0, 1024, 21).tolist()
    runs = {}
    for window in (True, False):
        engine = _engine(qwen3, layer_lists=True)
        engine.runner.use_window = window
        rows = [engine.open_row() for _ in prompts]
        engine.prefill(rows, prompts)
        mask = np.ones((qwen3.config.num_layers, 70), bool)
        mask[0, [3, 9, 40]] = False  # layer 0 reads fewer entries than layer 1
        engine.kv.set_layer_live(rows[0], mask)
        calls = []
        first = [5, 6]
        for call in range(5):
            if call == 2:  # drop the last call's tokens of row 1: its lists shrink to prefixes
                n = len(engine.row_state[rows[1]].slots) - 3
                engine.truncate_row(rows[1], n)
            if call == 3:  # another row's prefill writes the cache: the window is copied again
                engine.prefill([engine.open_row()], [other])
            tokens, logits = engine.decode(rows, first, 6, return_logits=True)
            kept = engine.runner.kept
            calls.append((tokens, logits, kept is not None))
            first = [t[-1] for t in tokens]
        runs[window] = (calls, engine.runner.regathers)
    calls_w, gathered = runs[True]
    calls_g, _ = runs[False]
    assert gathered == 2  # the first call and the one after the other row's prefill
    assert all(kept for *_, kept in calls_w) and not any(kept for *_, kept in calls_g)
    for (tok_w, log_w, _), (tok_g, log_g, _) in zip(calls_w, calls_g):
        assert tok_w == tok_g
        for a, b in zip(log_w, log_g):
            assert _rel(a, b) <= 1e-6


def test_regrouped_decode_calls_give_the_same_tokens(qwen3):
    """``step_decode(..., regroup=True)`` ends a call once half its rows stopped and
    the caller goes on with the rest: each row's tokens and logits are those of one
    uninterrupted call."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (50, 33, 71, 12)]
    limits = [3, 4, 24, 24]  # two rows stop early
    runs = {}
    for regroup in (False, True):
        engine = _engine(qwen3)
        rows = [engine.open_row() for _ in prompts]
        engine.prefill(rows, prompts)
        jobs = [engine.start_decode(r, 5, n, return_logits=True) for r, n in zip(rows, limits)]
        calls = 0
        while not all(j.finished for j in jobs):
            engine.step_decode(jobs, 32, regroup=regroup)
            calls += 1
        runs[regroup] = ([j.tokens for j in jobs], [np.concatenate(j.logits) for j in jobs], calls)
    assert runs[False][2] == 1 and runs[True][2] == 2  # the two long rows went on in a 2-row call
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert _rel(a, b) <= 1e-5
