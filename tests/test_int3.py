"""The INT3 tier of the dual quantized pool (issue 74, item 3).

* INT3 codes (``jaxkv.kernels.quant``): the 2 + 1 bit-plane packing byte for byte
  against a NumPy reference, codes as a NumPy float32 reference computes them, every
  element within half a step, and the round-trip error between INT2's and INT4's.
* INT3 pages (``jaxkv.kernels.quant3``: one-byte scale codes and zero points, values
  in groups of 64 channels): parameters and codes against NumPy, every element
  within half its step, the round-trip error between INT2 pages' and INT4's (and at
  or above the float16-parameter INT3 layout's).
* The device pool: INT2 pages, INT3 pages and INT4 rows written by one plan read
  back within half a step through the one page reader (``page_params``); an INT2
  page in a pool with INT3 pages holds the bytes it holds without them; a pool's
  bytes per INT3 token are ``bytes_per_token``'s (3.375 stored bits at head dim 64,
  every scale and zero counted).
* A mixed 2/3/4 pool end to end: the page-completion rule per kind; shelved INT3
  rows come back bit-identical. (The CPU decode window, the per-step gather, the
  blocked reader and the fused kernels in interpret mode on mixed 2/3/4 pools,
  rotation off and on, are ``test_triaxial``'s and ``test_rotation``'s parity tests,
  whose pools carry INT3 pages and whose prompts write all three widths.)
* The allocation chooses among 2, 3 and 4 bits (against brute force), and a pinned
  allocation's table reaches a session's records; with ``rewrite_history`` earlier
  turns' INT4 leftovers move into INT3 pages once they fill one; with
  ``sink_tokens`` a request's first positions are INT4 in its prefill and its
  rewrite.
* The mse fit of a rotated pool's INT3 pages (``quant3``'s ``fit="mse"``): against
  a NumPy search over the same tries, never worse than the covering fit, stored
  and read back by the pool as ``dequantize_pages3`` gives it.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache.quantized import INT2, INT3, INT4, DualPool, Geometry, dequantize_slots, page_params, write_tokens
from jaxkv.cache.quantized_host import DualAllocator, bytes_per_token, elements_per_token, stored_bits
from jaxkv.engine import Engine
from jaxkv.errors import ConfigError, SlotError
from jaxkv.kernels.quant import PAGE, dequantize_int2_pool, dequantize_rows, quantize_int2_pool, quantize_rows, unpack
from jaxkv.kernels.quant3 import SCALE_TABLE, dequantize_pages3, quantize_pages3
from jaxkv.policies import layouts
from jaxkv.policies.quant_allocation import Allocation, solve


# The pool's writer and reader jit'd: one program each per geometry (op by op, a
# write and its reads were ~250 small programs). (The mse test compares the pool's
# bytes with quant3's op by op, bit for bit: it writes op by op too.)
_write = jax.jit(write_tokens, static_argnums=(1, 2, 8))
_read = jax.jit(dequantize_slots, static_argnums=1)


def _outlier_rows(seed, n, K=2, D=64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, K, D)) * rng.uniform(0.1, 5, (n, 1, 1)) + rng.uniform(-3, 3, (n, 1, D))
    x[..., 5] *= 6.0  # an outlier channel
    return x.astype(np.float32)


def _np_pack3(codes):
    """The 2 + 1 split by hand: low two bits as a 2-bit row (byte j, plane i: channel
    i * D/4 + j), then the high bit as a 1-bit row (byte j, plane i: channel i * D/8 + j)."""
    D = codes.shape[-1]
    low = np.zeros((*codes.shape[:-1], D // 4), np.uint8)
    high = np.zeros((*codes.shape[:-1], D // 8), np.uint8)
    for i in range(4):
        low |= ((codes[..., i * (D // 4) : (i + 1) * (D // 4)] & 3) << (2 * i)).astype(np.uint8)
    for i in range(8):
        high |= (((codes[..., i * (D // 8) : (i + 1) * (D // 8)] >> 2) & 1) << i).astype(np.uint8)
    return np.concatenate([low, high], axis=-1)


def test_int3_codes_against_numpy_and_their_error_between_int2_and_int4():
    x = _outlier_rows(0, 256)
    rms = {}
    for bits in (2, 3, 4):
        p = quantize_rows(jnp.asarray(x), bits)
        scale = np.asarray(p.scale, np.float32)[..., None]  # [T, K, D/32, 1]
        zero = np.asarray(p.zero, np.float32)[..., None]
        g = x.reshape(*x.shape[:-1], -1, 32)
        want = np.where(scale > 0, np.clip(np.rint((g - zero) / np.where(scale > 0, scale, 1)), 0, 2**bits - 1), 0)
        want = want.astype(np.uint8).reshape(x.shape)
        codes = np.asarray(unpack(p.data, bits))
        assert np.array_equal(codes, want), bits  # IEEE float32 division, round half to even
        if bits == 3:
            assert p.data.shape[-1] == 64 * 3 // 8 and np.array_equal(np.asarray(p.data), _np_pack3(want))
        out = np.asarray(dequantize_rows(p), np.float64)
        step = np.repeat(scale[..., 0], 32, axis=-1).astype(np.float64)
        assert (np.abs(out - x) <= step / 2 + 2.0**-20 * (np.abs(x) + 1)).all(), bits
        rms[bits] = float(np.sqrt(np.mean((out - x) ** 2)))
    # each extra bit about halves the step: (2^b - 1) levels, 3 -> 7 -> 15
    assert 0.35 < rms[3] / rms[2] < 0.55 and 0.4 < rms[4] / rms[3] < 0.6, rms
    with pytest.raises(ConfigError):
        quantize_rows(jnp.asarray(x), 5)


def test_int3_pages_one_byte_parameters_against_numpy_and_their_error_between_int2_and_int4():
    x = _outlier_rows(3, 128)
    k, v = jnp.asarray(x), jnp.asarray(x[::-1].copy())
    p = quantize_pages3(k, v)
    pages = x.reshape(4, 32, 2, 64).transpose(0, 2, 1, 3)  # [Q, K, 32, D]
    for data, s_code, offset, groups in (
        (p.k_data, p.k_scale, p.k_zero, pages.transpose(0, 1, 3, 2)),  # keys: per channel over the page's tokens
        (p.v_data, p.v_scale, p.v_zero, x[::-1].reshape(4, 32, 2, 1, 64).transpose(0, 2, 1, 3, 4)),  # values: the head's 64 channels
    ):
        lo, hi = groups.min(-1), groups.max(-1)
        need = np.maximum((hi - lo) * np.float32(1 / 7), np.abs(lo) * np.float32(1 / 127))
        want_code = np.searchsorted(SCALE_TABLE, need, side="left")  # the smallest table entry at least the need
        assert np.array_equal(np.asarray(s_code).reshape(want_code.shape), want_code)
        scale = SCALE_TABLE[want_code]
        assert np.array_equal(np.asarray(offset).reshape(lo.shape), np.clip(np.rint(lo / scale), -127, 127).astype(np.int8))
        want = np.clip(np.rint(groups / scale[..., None] - np.rint(lo / scale)[..., None]), 0, 7).astype(np.uint8)
        codes = np.asarray(unpack(data, 3))
        got = codes.transpose(0, 1, 3, 2) if groups.shape[-1] == PAGE else codes.reshape(want.shape)  # keys: tokens last
        assert np.array_equal(got, want)  # IEEE float32 division, round half to even
    kd, vd = (np.asarray(a, np.float64) for a in dequantize_pages3(p))
    ks = SCALE_TABLE[np.asarray(p.k_scale)].astype(np.float64)  # [Q, K, D]
    vs = SCALE_TABLE[np.asarray(p.v_scale)][..., 0].astype(np.float64)  # [Q, K, 32]
    tiny = 2.0**-20 * (np.abs(x) + 1)
    assert (np.abs(kd - x).reshape(4, 32, 2, 64) <= ks[:, None] / 2 + tiny.reshape(4, 32, 2, 64)).all()
    assert (np.abs(vd - x[::-1]).reshape(4, 32, 2, 64) <= vs.transpose(0, 2, 1)[..., None] / 2 + tiny.reshape(4, 32, 2, 64)).all()
    err = lambda a, b: float(np.sqrt(np.mean((a - b) ** 2)))  # noqa: E731
    ref = {b: [np.asarray(a, np.float64) for a in dequantize_int2_pool(quantize_int2_pool(k, v, b))] for b in (2, 3, 4)}
    for i, y in enumerate((x, x[::-1])):  # keys, values: INT4 < INT3 (float16, groups of 32) < INT3 pages < INT2
        e = {b: err(ref[b][i], y) for b in (2, 3, 4)}
        e3 = err((kd, vd)[i], y)
        assert e[4] < e[3] <= e3 < e[2], (i, e, e3)
    assert err(kd, x) < 1.15 * err(ref[3][0], x)  # the one-byte key scale costs at most its 9% grid step


def test_pool_pages_of_both_widths_round_trip_and_count_their_bytes():
    geo = Geometry(pages=4, int4_slots=40, pages3=2)  # INT2 page 1, INT3 pages 2 and 3
    assert (geo.first3, geo.off3, geo.off4) == (2, 64, 128)
    assert geo.kind(np.asarray([1, 63, 64, 127, 128])).tolist() == [INT2, INT2, INT3, INT3, INT4]
    with pytest.raises(ConfigError):
        Geometry(pages=2, int4_slots=4, pages3=2)  # page 0 must stay an INT2 page
    x = _outlier_rows(1, 96)
    k, v = jnp.asarray(x), jnp.asarray(x[::-1].copy())
    slots = jnp.asarray(np.concatenate([np.arange(32, 96), geo.off4 + np.arange(32)]))  # page 1 (INT2), page 2 (INT3), INT4
    src, ids = jnp.arange(64).reshape(2, PAGE), jnp.asarray([1, 2])
    create = lambda g: DualPool.create(g, num_layers=1, num_kv_heads=2, head_dim=64, dtype=jnp.float32)  # noqa: E731
    pool = _write(create(geo), geo, 0, k, v, slots, src, ids, "cover").layer(0)
    kd, vd = (np.asarray(a, np.float64) for a in _read(pool, geo, slots))
    tiny = 2.0**-20 * (np.abs(x) + 1)
    # the scales the one page reader gives (page 1: float16; page 2: the one-byte parameters, expanded)
    ks = np.asarray(page_params(pool, geo, 0, lambda a, p=ids: a[p], ids)[0], np.float64)  # [2, K, D] per channel over each page
    assert (np.abs(kd[:64] - x[:64]).reshape(2, 32, 2, 64) <= ks[:, None] / 2 + tiny[:64].reshape(2, 32, 2, 64)).all()
    vs = np.asarray(page_params(pool, geo, 1, lambda a, p=ids: a[p], ids)[0], np.float64).transpose(0, 2, 1, 3).reshape(64, 2, 2)
    assert (np.abs(vd[:64] - x[::-1][:64]).reshape(64, 2, 2, 32) <= vs[..., None] / 2 + tiny[:64].reshape(64, 2, 2, 32)).all()
    assert np.array_equal(ks[0], np.asarray(pool.int2.k.scale[1], np.float64)) and np.isin(ks[1], SCALE_TABLE).all()
    assert (vs[32:, :, 0] == vs[32:, :, 1]).all()  # an INT3 page's value group is the head's 64 channels
    err = lambda a, b: float(np.sqrt(np.mean((a - b) ** 2)))  # noqa: E731
    assert err(kd[32:64], x[32:64]) < 0.6 * err(kd[:32], x[:32])  # the INT3 page is the finer one
    # the INT2 page is the bytes a pool without INT3 pages holds
    plain = Geometry(pages=2, int4_slots=40)
    old = _write(create(plain), plain, 0, k[:32], v[:32], jnp.arange(32, 64), src[:1], ids[:1], "cover").layer(0)
    for a, b in zip(jax.tree.leaves(old.int2), jax.tree.leaves(pool.int2)):
        assert np.array_equal(np.asarray(a)[:2], np.asarray(b)[:2])
    assert pool.int2.k.scale.shape[0] == pool.int2.v.scale.shape[0] == geo.first3  # INT3 pages hold no float16 parameters
    assert np.asarray(pool.hi[0][0]).any() and not np.asarray(pool.hi[0][1]).any()  # page 2's high plane; page 3 unwritten
    assert np.asarray(pool.p3[0][0]).any() and not np.asarray(pool.p3[0][1]).any()
    # device bytes per INT3 token (low planes, high planes, one-byte scales and zero points) = bytes_per_token
    size = lambda g: sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(jax.eval_shape(lambda: create(g))))  # noqa: E731
    per_token = (size(Geometry(5, 1, 0, 2)) - size(Geometry(4, 1, 0, 1))) / PAGE
    assert per_token == bytes_per_token(INT3, head_dim=64, num_layers=1, num_kv_heads=2) == 2 * (48 + 4 + 2)
    assert stored_bits(per_token, elements_per_token(head_dim=64, num_layers=1, num_kv_heads=2)) == 3.375
    assert (
        stored_bits(
            bytes_per_token(INT3, head_dim=32, num_layers=1, num_kv_heads=1), elements_per_token(head_dim=32, num_layers=1, num_kv_heads=1)
        )
        == 3.5
    )


def test_allocator_hands_out_pages_of_each_kind():
    geo = Geometry(pages=4, int4_slots=8, pages3=2)
    alloc = DualAllocator(geo)
    assert alloc.pages_free_of(INT2) == 1 and alloc.pages_free_of(INT3) == 2 and alloc.pages_free == 3
    pages, slots = alloc.allocate_pages([32, 3], INT3)
    assert pages.tolist() == [2, 3] and alloc.pages_free_of(INT3) == 0 and alloc.pages_free_of(INT2) == 1
    with pytest.raises(SlotError):
        alloc.allocate_pages([32], INT4)
    alloc.release(slots)
    assert alloc.pages_free_of(INT3) == 2 and alloc.pages_free == 3


def _kinds(engine, row):
    return engine.pool.geometry.kind(np.asarray(engine.row_state[row].slots, np.int64))


def test_shelved_int3_rows_are_promoted_back_bit_identical(qmodel):
    """(The engine of ``test_triaxial``'s shelving test: its programs, compiled once.)"""
    e = Engine(qmodel, rows=3, max_positions=1024, prefill_chunk=128, kv_quant="triaxial")
    rng = np.random.default_rng(2)
    row = e.open_row()
    e.prefill([row], [rng.integers(5, 500, 200).tolist()], kv_bits=[np.tile([2, 3, 3, 4], 50)])
    e.decode([row], [7], 3)
    kinds = _kinds(e, row)
    for kind in (INT2, INT3):  # per chunk and kind, the kind's tokens in position order fill pages; the rest INT4
        for c in (0, 128):
            want = np.flatnonzero(np.tile([2, 3, 3, 4], 50)[c : c + 128] == kind) + c
            assert (np.flatnonzero(kinds[c : c + 128] == kind) + c).tolist() == want[: want.size // PAGE * PAGE].tolist()
    pick = np.sort(np.concatenate([np.flatnonzero(kinds == INT3)[[0, 5, 40]], np.flatnonzero(kinds == INT2)[[1, 9]], [199]]))
    slots = np.asarray(e.row_state[row].slots)[pick]
    before = e.kv.gather_rows(slots)
    k_before = np.asarray(e.kv.gather_keys(row))
    keep = np.setdiff1d(np.arange(kinds.size), pick)
    shelved = e.kv.apply_layout(row, layouts.dead_slot(e.row_state[row].slots, keep), keep_evicted=True)
    assert before[0][0, :, 0, 0].tolist() == kinds[pick].tolist()  # the blob's kind byte: 2, 3 or 4
    fresh = e.kv.restore_rows(row, pick, *shelved)
    assert (fresh != slots).any() and (e.pool.geometry.kind(fresh) == kinds[pick]).all()
    assert all(np.array_equal(x, y) for x, y in zip(e.kv.gather_rows(fresh), before))
    assert np.array_equal(np.asarray(e.kv.gather_keys(row)), k_before)


def test_allocation_chooses_among_2_3_and_4_bits():
    rng = np.random.default_rng(5)
    for trial in range(40):
        n = int(rng.integers(1, 7))
        D4 = rng.uniform(0, 1, n)
        D3 = D4 + rng.exponential(0.5, n)
        D2 = D3 + rng.exponential(1.0, n)
        N = np.where(rng.random(n) < 0.15, 0, rng.integers(1, 500, n)).astype(float)
        B = float(rng.uniform(2, 4))
        got = solve(D2, D4, N, B, D3=D3)
        table = np.stack([D2, D3, D4], axis=1)
        best = min(
            table[np.arange(n), np.asarray(b) - 2][N > 0].sum()
            for b in itertools.product((2, 3, 4), repeat=n)
            if (N * b).sum() <= B * N.sum() + 1e-9
        )
        assert (N * got).sum() <= B * N.sum() + 1e-9, trial
        assert table[np.arange(n), got - 2][N > 0].sum() == pytest.approx(best), trial
        assert (got[N == 0] == 4).all()
    # three widths pay where two cannot: at B = 3 a tag that 2 bits ruin and 4 barely improve takes 3
    assert solve([100.0, 100.0], [0.0, 0.0], [10.0, 10.0], 3.0, D3=[1.0, 1.0]).tolist() == [3, 3]
    assert sorted(solve([100.0, 100.0], [0.0, 0.0], [10.0, 10.0], 3.0).tolist()) == [2, 4]
    many = rng.integers(1, 50, 20).astype(float)  # beyond the exhaustive search: the greedy, within budget
    got = solve(rng.uniform(2, 3, 20), rng.uniform(0, 1, 20), many, 2.7, D3=rng.uniform(1, 2, 20))
    assert set(got.tolist()) <= {2, 3, 4} and (many * got).sum() <= 2.7 * many.sum() + 1e-9


def test_a_pinned_allocation_writes_int3_and_records_its_bytes(qmodel):
    from jaxkv.serving import Session

    rows = [{"index": s, "N": 10.0, "D2": 1.0, "D4": 0.5, "bits": 3} for s in range(7)]
    alloc = Allocation.from_dict({"axes": ["semantic"], "budget": 3.0, "tags": rows})
    assert alloc.bits(2.0) == alloc.bits(4.0) and set(alloc.bits().values()) == {3}
    with pytest.raises(ConfigError):
        Allocation.from_dict({"axes": ["semantic"], "budget": 3.0, "tags": [dict(rows[0], bits=5)]})
    with pytest.raises(ConfigError):
        Allocation.from_dict({"axes": ["semantic"], "budget": 3.0, "tags": [rows[0], {k: v for k, v in rows[1].items() if k != "bits"}]})
    s = Session(qmodel, kv_quant="triaxial", kv_allocation=alloc, max_positions=512, protect_query=False)
    try:
        s.replay([{"role": "user", "content": " ".join(["report budget travel legal"] * 40)}, {"role": "assistant", "content": "ok"}])
        r = s.quantization.records[0]
    finally:
        s.close()
    cfg = qmodel.config
    size = dict(head_dim=cfg.head_dim, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads)
    assert r.int3 >= 3 * PAGE and r.int2 == 0 and r.int3 % PAGE == 0
    assert r.bytes == r.int3 * bytes_per_token(INT3, **size) + r.int4 * bytes_per_token(INT4, **size) + r.full * bytes_per_token(16, **size)
    assert r.bits == 3.0 * r.int3 + 4.0 * r.int4 + 16.0 * r.full


def test_rewrite_history_moves_earlier_leftovers_into_pages(qmodel):
    """An allocation with ``rewrite_history``: the page-completion rule's leftovers
    (INT4) of earlier turns, reused from the radix cache, go to INT3 pages once they
    fill one, before the turn's prefill; without the rule they stay INT4."""
    from jaxkv.serving import Session

    rows = [{"index": s, "N": 10.0, "D2": 1.0, "D4": 0.5, "bits": 3} for s in range(7)]
    msgs = []
    for n in (20, 5, 7, 3):  # prompts whose chunks leave 24, 0, 8 and 0 INT4 leftovers
        msgs += [{"role": "user", "content": " ".join(["report budget travel legal"] * n)}, {"role": "assistant", "content": "ok"}]
    records = {}
    for rewrite in (False, True):
        alloc = Allocation.from_dict({"axes": ["semantic"], "budget": 3.0, "tags": rows, "rewrite_history": rewrite})
        assert alloc.rewrite_history is rewrite
        s = Session(qmodel, kv_quant="triaxial", kv_allocation=alloc, max_positions=512, protect_query=False)
        try:
            s.replay(msgs)
            records[rewrite] = s.quantization.records
        finally:
            s.close()
    before, after = records[False], records[True]
    assert [r.tokens for r in before] == [r.tokens for r in after]
    assert [(r.int3, r.int4) for r in before[:3]] == [(r.int3, r.int4) for r in after[:3]]  # fewer than a page of leftovers: none move
    assert before[2].int4 >= PAGE and before[3].int4 > before[2].int4  # the last turn reuses a page's worth of INT4 leftovers
    assert after[3].int3 == before[3].int3 + PAGE and after[3].int4 == before[3].int4 - PAGE and after[3].bytes < before[3].bytes


def test_rewrite_from_float_prefills_the_leftovers_again_and_the_tree_keeps_them(qmodel):
    """``rewrite_from_float``: a turn reuses the cache only up to the first INT4
    leftover of the earlier turns (a token tagged 3 bits), prefills the rest again
    and so writes the leftovers once, from float, into INT3 pages beside the new
    tokens; the radix tree takes the fresh slots, so the next turn's cut starts
    after them and no superseded INT4 slot stays held."""
    from jaxkv.serving import Session

    rows = [{"index": s, "N": 10.0, "D2": 1.0, "D4": 0.5, "bits": 3} for s in range(7)]
    msgs = []
    for n in (20, 5, 7, 3):  # every tag 3 bits: each prefill's last (tokens mod 32) tokens are INT4 leftovers
        msgs += [{"role": "user", "content": " ".join(["report budget travel legal"] * n)}, {"role": "assistant", "content": "ok"}]
    runs = {}
    for from_float in (False, True):
        alloc = Allocation.from_dict(
            {"axes": ["semantic"], "budget": 3.0, "tags": rows, "rewrite_history": True, "rewrite_from_float": from_float}
        )
        s = Session(qmodel, kv_quant="triaxial", kv_allocation=alloc, max_positions=512, protect_query=False)
        try:
            s.replay(msgs)
            srv = s.server
            srv.radix.check_invariants()
            held = srv.radix.held_slots()
            refs = srv.engine.allocator.refcounts()
            assert (refs == np.bincount(held, minlength=refs.size)).all()  # after the turns, every used slot is the tree's
            tree_int4 = int((srv.engine.pool.geometry.kind(held) == INT4).sum())
            runs[from_float] = (s.quantization.records, [r.prefix_hit_tokens for r in s.metrics.requests], tree_int4, held.size)
        finally:
            s.close()
    (before, hits_before, int4_before, _), (after, hits, int4_after, cached) = runs[False], runs[True]
    assert [r.tokens for r in before] == [r.tokens for r in after]
    assert hits_before == [0, before[0].tokens, before[1].tokens, before[2].tokens]  # the INT4 rewrite reuses every match
    # each turn after one with leftovers starts at its first leftover (the earlier turn's last int4 tokens)
    assert hits[0] == 0 and all(hits[i] == after[i - 1].tokens - after[i - 1].int4 for i in (1, 2, 3))
    assert after[0].int4 > 0 and after[1].int4 > 0 and hits[1] < hits[2] < hits[3]  # the cut moves on: the tree kept the fresh slots
    assert after[2].int4 == 0 and after[2].int3 == after[2].tokens  # 24 + 40 leftovers and new tokens fill whole pages
    assert after[2].bytes < before[2].bytes
    # the tree holds INT4 only for the last turn's leftovers and reply (it kept every superseded one before)
    assert int4_after == after[3].int4 + (cached - after[3].tokens) and int4_before > int4_after


def test_reuse_cut_reaches_back_at_most_refresh_tokens_never_across_a_hole():
    """``QuantizationStage.reuse_cut``: the first INT4 token tagged below 4 bits
    among the last ``REFRESH_TOKENS`` reused ones and past the sinks; None without
    one, across a hole, or without ``rewrite_from_float`` (which needs
    ``rewrite_history``: ``ConfigError``)."""
    import types

    from jaxkv.cache.allocator import SENTINEL_SLOT
    from jaxkv.chat.tags import TRIAXIAL_DTYPE
    from jaxkv.serving.stages.quantization import REFRESH_TOKENS, QuantizationStage

    rows = [{"index": s, "N": 10.0, "D2": 1.0, "D4": 0.5, "bits": 3 if s != 6 else 4} for s in range(7)]
    with pytest.raises(ConfigError):
        Allocation.from_dict({"axes": ["semantic"], "budget": 3.0, "tags": rows, "rewrite_from_float": True})
    alloc = Allocation.from_dict({"axes": ["semantic"], "budget": 3.0, "tags": rows, "rewrite_history": True, "rewrite_from_float": True})
    n = REFRESH_TOKENS + 40
    tags = np.zeros(n, TRIAXIAL_DTYPE)
    tags["semantic"] = 5  # 3 bits
    tags["semantic"][n - 20 : n - 10] = 6  # 4 bits: INT4 by its tag, never a leftover
    geo = Geometry(pages=8, int4_slots=4 * n, pages3=4)
    int4 = geo.off4 + 1 + np.arange(n)  # every reused token in the token region ...
    slots = int4.copy()
    slots[: n - 30] = 1 + np.arange(n - 30)  # ... but the first n - 30, paged
    turn = types.SimpleNamespace(
        rendered=types.SimpleNamespace(triaxial=tags), engine=types.SimpleNamespace(pool=types.SimpleNamespace(geometry=geo))
    )
    stage = lambda **kw: QuantizationStage("triaxial", 3.0, alloc.table(), rewrite_history=True, **kw)
    assert stage(rewrite_from_float=True).reuse_cut(turn, slots) == n - 30
    assert stage().reuse_cut(turn, slots) is None  # the INT4 rewrite: no cut
    assert stage(rewrite_from_float=True).reuse_cut(turn, int4) == n - REFRESH_TOKENS  # all INT4: only the last REFRESH_TOKENS
    assert stage(rewrite_from_float=True, sink_tokens=n - 25).reuse_cut(turn, slots) == n - 25
    tail4 = slots.copy()
    tail4[n - 30 : n - 20] = 1 + np.arange(n - 30, n - 20)  # the 3-bit leftovers paged: the 4-bit tag's INT4 tokens are no cut
    tail4[n - 10 :] = 1 + np.arange(n - 10, n)
    assert stage(rewrite_from_float=True).reuse_cut(turn, tail4) is None
    holed = slots.copy()
    holed[n - 5] = SENTINEL_SLOT
    assert stage(rewrite_from_float=True).reuse_cut(turn, holed) is None


def test_sink_tokens_are_written_int4_and_the_rewrite_leaves_them():
    """``Allocation.sink_tokens``: the request's first positions get INT4 whatever
    their tag, in the prefill that writes them and in the rewrite rule's history;
    parsed from a variant or from the file level, bad values refused."""
    import types

    from jaxkv.chat.tags import TRIAXIAL_DTYPE, triaxial_codes
    from jaxkv.policies.quant_allocation import variant_dict
    from jaxkv.serving.stages.quantization import QuantizationStage, resolve_allocation

    rows = [{"index": s, "N": 10.0, "D2": 1.0, "D4": 0.5, "bits": 3} for s in range(7)]
    alloc = resolve_allocation(
        None, "triaxial", {"budget": 3.0, "sink_tokens": 3, "variants": {"triaxial": {"axes": ["semantic"], "tags": rows}}}
    )
    assert alloc.sink_tokens == 3 and Allocation.from_dict({"axes": ["semantic"], "budget": 3.0, "tags": rows}).sink_tokens == 0
    assert variant_dict({"budget": 3.0, "sink_tokens": 3, "variants": {"v": {"sink_tokens": 1}}}, "v")["sink_tokens"] == 1
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError):
            Allocation.from_dict({"axes": ["semantic"], "budget": 3.0, "tags": rows, "sink_tokens": bad})
    tags = np.zeros(10, TRIAXIAL_DTYPE)
    tags["semantic"] = [0, 1, 1, 2, 5, 5, 5, 6, 1, 1]
    table = alloc.table()
    moved = []
    for reused, want_history in ((0, None), (2, [4, 4]), (5, [4, 4, 4, 3, 3])):
        stage = QuantizationStage("triaxial", 3.0, table, rewrite_history=True, sink_tokens=alloc.sink_tokens)
        kv = types.SimpleNamespace(requantize=lambda row, pos, bits: moved.append((pos.tolist(), bits.tolist())))
        turn = types.SimpleNamespace(
            reused=reused, rendered=types.SimpleNamespace(triaxial=tags), engine=types.SimpleNamespace(kv=kv), row=0
        )
        job = types.SimpleNamespace(kv_bits=None)
        stage.before_prefill(turn, job)
        want = table[triaxial_codes(tags)].copy()
        want[:3] = 4
        assert set(table[triaxial_codes(tags)].tolist()) == {3}
        assert job.kv_bits.tolist() == want[reused:].tolist()
        if want_history is None:
            assert not moved
        else:
            assert moved.pop() == (list(range(reused)), want_history)


def test_int3_mse_fit_against_numpy_no_worse_than_cover_and_its_pool_reads_back_its_values():
    """``fit="mse"`` (a rotated pool's): per group the chosen (scale code, zero point)
    is one of the tries (the covering code and the ``MSE_STEPS`` below it, zero points
    ``rint(m / scale) + {0, -1, 1}``), its codes are the NumPy float32 codes of that
    pair, its squared error is the least of the tries' (float32 sums: within 1e-5)
    and at most the covering fit's; a rotated pool's INT3 pages hold exactly these."""
    from jaxkv.kernels.quant3 import MSE_STEPS

    x = _outlier_rows(7, 64)
    k, v = jnp.asarray(x), jnp.asarray(x[::-1].copy())
    p, c = quantize_pages3(k, v, "mse"), quantize_pages3(k, v)
    pages = x.reshape(2, 32, 2, 64).transpose(0, 2, 1, 3)
    for data, s_code, offset, groups, cover_code in (
        (p.k_data, p.k_scale, p.k_zero, pages.transpose(0, 1, 3, 2), c.k_scale),
        (p.v_data, p.v_scale, p.v_zero, x[::-1].reshape(2, 32, 2, 1, 64).transpose(0, 2, 1, 3, 4), c.v_scale),
    ):
        lo = groups.min(-1)
        s_code, offset = np.asarray(s_code).reshape(lo.shape).astype(np.int64), np.asarray(offset).reshape(lo.shape).astype(np.int64)
        cover_code = np.asarray(cover_code).reshape(lo.shape).astype(np.int64)

        def decoded(code, off, groups=groups):
            scale = SCALE_TABLE[code][..., None]
            codes = np.clip(np.rint(groups / scale - off[..., None]), 0, 7)
            return codes, (off[..., None] * scale + codes * scale).astype(np.float64)

        errs = []
        for ds in range(MSE_STEPS + 1):
            scale = SCALE_TABLE[cover_code - ds]
            for do in (0, -1, 1):
                off = np.clip(np.rint(lo / scale) + do, -127, 127).astype(np.int64)
                errs.append(np.sum((decoded(cover_code - ds, off)[1] - groups) ** 2, -1))
        assert np.isin(cover_code - s_code, np.arange(MSE_STEPS + 1)).all() and (np.abs(offset) <= 127).all()
        codes, got = decoded(s_code, offset)
        err = np.sum((got - groups) ** 2, -1)
        assert (err <= np.min(errs, 0) * (1 + 1e-5) + 1e-12).all() and (err <= errs[0] * (1 + 1e-5) + 1e-12).all()
        assert (err < errs[0] * 0.999).any()  # clipping pays somewhere: the fit is not the covering one
        raw = np.asarray(unpack(data, 3))
        assert np.array_equal(raw.transpose(0, 1, 3, 2) if groups.shape[-1] == PAGE else raw.reshape(codes.shape), codes.astype(np.uint8))
    from jaxkv.cache.quantized import page3_fit

    assert page3_fit(None) == "cover" and page3_fit(object()) == "mse"
    geo = Geometry(pages=3, int4_slots=4, pages3=2)  # INT3 pages 1 and 2
    create = lambda g: DualPool.create(g, num_layers=1, num_kv_heads=2, head_dim=64, dtype=jnp.float32)  # noqa: E731
    slots = jnp.arange(PAGE, 3 * PAGE)
    pool = write_tokens(create(geo), geo, 0, k, v, slots, jnp.arange(64).reshape(2, PAGE), jnp.asarray([1, 2]), "mse")
    kd, vd = dequantize_slots(pool.layer(0), geo, slots)
    want = dequantize_pages3(p)
    assert np.array_equal(np.asarray(kd), np.asarray(want[0])) and np.array_equal(np.asarray(vd), np.asarray(want[1]))
    with pytest.raises(ConfigError):
        quantize_pages3(k, v, "nearest")
