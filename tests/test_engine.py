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
    engine = jaxkv.Engine(qwen3, rows=2, max_positions=256, prefill_chunk=32)  # 3-4 chunks
    prefill_lens, n_decode = [70, 45], 24
    rows, logits = _run_incremental(qwen3, engine, seqs, prefill_lens, n_decode)
    for seq, n, got in zip(seqs, prefill_lens, logits):
        ref = np.asarray(jaxkv.score_logits(qwen3, np.asarray([seq[: n + n_decode]])))[0]
        assert got.shape == ref.shape
        assert _rel(got, ref) <= 1e-4
    _assert_tables_mirror_host(engine, rows)


def test_fragmented_pool_gives_same_logits(qwen3):
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 1024, 100).tolist()
    engine = jaxkv.Engine(qwen3, rows=2, max_positions=128, num_slots=400, prefill_chunk=16)
    # Fragment the pool: another row takes 200 slots, then frees every other one.
    other = engine.open_row()
    engine.prefill([other], [rng.integers(0, 1024, 120).tolist()])
    taken = np.asarray(engine.row_state[other].slots)
    engine.close_row(other)
    held = engine.allocator.allocate(len(taken))  # re-take all ...
    engine.allocator.release(held[::2])  # ... and free every other: holes everywhere
    rows, logits = _run_incremental(qwen3, engine, [seq], [60], 30)
    slots = np.asarray(engine.row_state[rows[0]].slots)
    assert (np.diff(slots) != 1).any(), "the request's slots should not be contiguous"
    ref = np.asarray(jaxkv.score_logits(qwen3, np.asarray([seq[:90]])))[0]
    assert _rel(logits[0], ref) <= 1e-4
    _assert_tables_mirror_host(engine, rows)
    # Freed slots are reused: closing the row returns exactly its slots.
    freed = engine.close_row(rows[0])
    assert sorted(freed.tolist()) == sorted(slots.tolist())


def test_prefix_with_holes_is_neither_read_nor_refilled(qwen3):
    """A row installed with sentinel holes attends only to its live slots."""
    rng = np.random.default_rng(2)
    seq = rng.integers(0, 1024, 40).tolist()
    engine = jaxkv.Engine(qwen3, rows=2, max_positions=64)
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


def test_short_piece_batched_with_a_long_one_keeps_its_own_width(qwen3, monkeypatch):
    """One prefill step per chunk width: a 40-token piece next to a 300-token prompt
    runs at width 128 (not padded to 512) and gets its solo logits bit for bit."""
    import jaxkv.engine as engine_mod

    rng = np.random.default_rng(3)
    long_prompt, short_prompt = rng.integers(0, 1024, 300).tolist(), rng.integers(0, 1024, 40).tolist()  # model context: 512
    solo = jaxkv.Engine(qwen3, rows=2, max_positions=512, prefill_chunk=512)
    ref = solo.prefill([solo.open_row()], [short_prompt], all_logits=True)[0]
    widths = []
    real_step = engine_mod.prefill_step
    monkeypatch.setattr(engine_mod, "prefill_step", lambda *a, **k: (widths.append(a[3].tokens_BT.shape), real_step(*a, **k))[1])
    engine = jaxkv.Engine(qwen3, rows=2, max_positions=512, prefill_chunk=512)
    a, b = engine.open_row(), engine.open_row()
    jobs = [engine.start_prefill(a, long_prompt), engine.start_prefill(b, short_prompt, all_logits=True)]
    engine.step_prefill(jobs)
    assert all(j.finished for j in jobs)
    assert sorted(w[1] for w in widths) == [128, 512] and all(w[0] == 1 for w in widths)
    got = np.concatenate(jobs[1].logits)
    assert got.shape == ref.shape and (got == ref).all()


def test_prefill_width_is_the_power_of_two_above_the_piece(qwen3, monkeypatch):
    """Pieces of 40, 200 and 300 tokens run at widths 128, 256 and 512 (a piece is
    padded less than 2x), each with its solo logits."""
    import jaxkv.engine as engine_mod

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (40, 200, 300)]
    solo = []
    for p in prompts:
        e = jaxkv.Engine(qwen3, rows=1, max_positions=512, prefill_chunk=512)
        solo.append(e.prefill([e.open_row()], [p], all_logits=True)[0])
    widths = []
    real_step = engine_mod.prefill_step
    monkeypatch.setattr(engine_mod, "prefill_step", lambda *a, **k: (widths.append(a[3].tokens_BT.shape[1]), real_step(*a, **k))[1])
    engine = jaxkv.Engine(qwen3, rows=3, max_positions=512, prefill_chunk=512)
    jobs = [engine.start_prefill(engine.open_row(), p, all_logits=True) for p in prompts]
    engine.step_prefill(jobs)
    assert sorted(widths) == [128, 256, 512] and all(j.finished for j in jobs)
    for job, ref in zip(jobs, solo):
        assert _rel(np.concatenate(job.logits), ref) <= 1e-5


def test_prefill_batches_split_into_power_of_two_groups_without_padding_rows(qwen3, monkeypatch):
    """Three pieces of one width run as a step of 2 rows and a step of 1 (no
    padding row: it would run the whole forward), longest contexts together, and
    each row's logits match its solo prefill."""
    import jaxkv.engine as engine_mod

    rng = np.random.default_rng(4)
    contexts = [rng.integers(0, 1024, n).tolist() for n in (10, 200, 90)]
    pieces = [rng.integers(0, 1024, 20).tolist() for _ in contexts]
    solo = []
    for ctx, piece in zip(contexts, pieces):
        e = jaxkv.Engine(qwen3, rows=1, max_positions=512)
        r = e.open_row()
        e.prefill([r], [ctx])
        solo.append(e.prefill([r], [piece], all_logits=True)[0])
    engine = jaxkv.Engine(qwen3, rows=3, max_positions=512)
    rows = [engine.open_row() for _ in contexts]
    engine.prefill(rows, contexts)
    steps = []
    real_step = engine_mod.prefill_step
    monkeypatch.setattr(engine_mod, "prefill_step", lambda *a, **k: (steps.append(np.asarray(a[3].rows_B).tolist()), real_step(*a, **k))[1])
    jobs = [engine.start_prefill(r, p, all_logits=True) for r, p in zip(rows, pieces)]
    engine.step_prefill(jobs)
    assert steps == [[rows[2], rows[1]], [rows[0]]]  # the two longer contexts first, then the shortest; no padding row
    for job, ref in zip(jobs, solo):
        assert _rel(np.concatenate(job.logits), ref) <= 1e-5


def test_out_of_slots_changes_nothing(qwen3):
    engine = jaxkv.Engine(qwen3, rows=2, max_positions=64, num_slots=50)
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
        assert seq_len[r] == st.seq_len and live_len[r] == len(st.live)
        assert slot_map[r, : st.seq_len].tolist() == st.slots
        assert live_idx[r, : live_len[r]].tolist() == st.live
        assert SENTINEL_SLOT not in st.live
        assert all(engine.allocator.refcount(s) >= 1 for s in st.live)


def test_decode_window_equals_per_step_gather(qwen3):
    """The CPU decode loop's once-per-chunk window (``engine.gather_window``) gives
    the tokens, logits and attention mass of gathering from the pool every step,
    on rows of different lengths, one with dead slots in its live list, and the
    window holds the chunk's own new tokens."""
    from jaxkv.engine import gather_window
    from jaxkv.models.transformer import Features
    from jaxkv.policies import layouts

    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (90, 37, 61)]
    runs = {}
    for window in (True, False):
        engine = jaxkv.Engine(qwen3, rows=3, max_positions=256, prefill_chunk=32)
        engine.decode_window = window
        rows = [engine.open_row() for _ in prompts]
        engine.prefill(rows, prompts)
        keep = np.setdiff1d(np.arange(90), [2, 3, 40, 41, 77])  # dead slots inside row 0's list
        engine.apply_layout(rows[0], layouts.dead_slot(engine.row_state[rows[0]].slots, keep))
        runs[window] = engine.decode(
            rows, [5, 6, 7], 20, return_logits=True, features=Features(attn_mass=True, query_rows=True)
        )
        assert gather_window(engine.cache, 4, 128, engine.backend, None, engine.pool.uses_window)
    (tok_w, log_w, aux_w), (tok_g, log_g, aux_g) = runs[True], runs[False]
    assert tok_w == tok_g
    for a, b in zip(log_w, log_g):
        assert _rel(a, b) <= 1e-6
    for a, b in zip(aux_w["attn_mass"], aux_g["attn_mass"]):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for a, b in zip(aux_w["q_rows"], aux_g["q_rows"]):  # layer > 0 queries carry the rounding of the layers below
        assert _rel(a, b) <= 1e-5


def test_regrouped_decode_calls_give_the_same_tokens(qwen3):
    """``step_decode(..., regroup=True)`` ends a call once half its rows stopped and
    the caller goes on with the rest: each row's tokens and logits are those of one
    uninterrupted call."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 1024, n).tolist() for n in (50, 33, 71, 12)]
    limits = [3, 4, 24, 24]  # two rows stop early
    runs = {}
    for regroup in (False, True):
        engine = jaxkv.Engine(qwen3, rows=4, max_positions=256, prefill_chunk=32)
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
