"""TriAxialKV end to end on a tiny random model: the dual pool's address split and
allocator, INT2-first page tables and the page-completion rule, decode tokens to
INT4 (KIVI's residual for kivi2), first precision kept through the radix cache,
packed rows shelved and promoted bit-identical, quantized decode = attention over
the dequantized K/V, the allocation solver vs brute force, and a quantized session
with retention (both layouts) and RepairKV."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache.quantized import FLOAT, INT2, INT4, Geometry, dequantize_slots
from jaxkv.cache.quantized_host import KIVI_RESIDUAL, DualAllocator
from jaxkv.engine import Engine, KVSource
from jaxkv.errors import ConfigError, JaxKVError, OutOfSlotsError, SlotError
from jaxkv.kernels.quant import PAGE
from jaxkv.policies import layouts
from jaxkv.policies.quant_allocation import solve
from jaxkv.serving import Server, Session


# One engine shape for the module's engine tests: engines of one shape and pool format
# share their compiled programs (the step and decode programs are keyed on the pool's and
# the step's shapes), so each format compiles them once per module, not once per test.
# Prompts are whole chunks where the length is not the point (the step programs are
# keyed on the step's token bucket and outputs too), and the sessions' server has the
# engine tests' shape and pool.
SHAPE = dict(rows=3, max_positions=1024, prefill_chunk=128)
ONE_CHUNK = dict(SHAPE, prefill_chunk=256)  # a 200-token prompt in one chunk
SERVER = dict(SHAPE, num_slots=3 * 1024 + 1, kv_quant="triaxial")  # Engine(**SHAPE, kv_quant="triaxial")'s pool


def allocation(int2_semantics=(1, 5), budget=3.0):
    """A calibration table over the semantic axis: the listed semantics are cheap to
    quantize (they go to INT2 first), the others costly."""
    return {
        "axes": ["semantic"],
        "budget": budget,
        "tags": [{"index": s, "N": 10.0, "D2": 1.0 if s in int2_semantics else 100.0, "D4": 0.5} for s in range(7)],
    }


def kinds_of(engine, row):
    return engine.pool.geometry.kind(np.asarray(engine.row_state[row].slots, np.int64))


# ----------------------------------------------------------------------------- pool
def test_address_split_and_one_allocator_per_region():
    geo = Geometry(pages=4, int4_slots=10)
    assert (geo.off4, geo.off_float, geo.num_slots) == (128, 138, 138)
    assert geo.kind(np.asarray([1, 127, 128, 137])).tolist() == [INT2, INT2, INT4, INT4]
    alloc = DualAllocator(geo)
    assert alloc.capacity == alloc.num_free == 10 and alloc.pages_free == 3  # page 0 is reserved
    pages, slots = alloc.allocate_pages([32, 5])
    assert pages.tolist() == [1, 2] and slots.tolist() == list(range(32, 64)) + list(range(64, 69))
    s4 = alloc.allocate(3)
    assert s4.tolist() == [128, 129, 130] and alloc.num_free == 7 and alloc.pages_free == 1
    with pytest.raises(OutOfSlotsError):
        alloc.allocate_pages([32, 32])
    with pytest.raises(SlotError):
        alloc.ref([69])  # an unused row of a handed-out page is not allocated
    with pytest.raises(SlotError):
        alloc.release([0])
    alloc.ref(slots[:2])
    assert alloc.release(slots[:31]).size == 0  # page 1 still holds slots 32, 33 and 63
    assert alloc.release([32, 33, 63]).tolist() == list(range(32, 64)) and alloc.pages_free == 2
    assert alloc.release(slots[32:]).tolist() == list(range(64, 96)) and alloc.pages_free == 3
    assert alloc.release(s4).tolist() == [128, 129, 130] and alloc.num_free == 10
    assert not alloc.refcounts().any()


def test_int2_first_page_table_and_page_completion_rule(qmodel):
    e = Engine(qmodel, **SHAPE, kv_quant="triaxial")
    rng = np.random.default_rng(0)
    n = 256  # two chunks
    bits = np.where(rng.random(n) < 0.7, 2, 4)
    row = e.open_row()
    e.prefill([row], [rng.integers(5, 500, n).tolist()], kv_bits=[bits])
    want = np.full(n, INT4)
    for c in range(0, n, 128):  # per chunk: INT2 tokens in position order fill pages, the rest INT4
        two = np.flatnonzero(bits[c : c + 128] == 2) + c
        want[two[: two.size // PAGE * PAGE]] = INT2
    got = kinds_of(e, row)
    assert got.tolist() == want.tolist() and (got == INT2).sum() >= 2 * PAGE
    slots = np.asarray(e.row_state[row].slots)
    for p in np.unique(slots[got == INT2] // PAGE):  # a page is 32 tokens of one chunk
        pos = np.flatnonzero(slots // PAGE == p)
        assert pos.size == PAGE and pos.min() // 128 == pos.max() // 128
    table = e.kv.page_table(row)
    entries = table.entries()
    n2 = table.pages.size
    assert (entries[:n2] < e.pool.geometry.pages).all()  # INT2 pages first ...
    assert (e.pool.geometry.kind(entries[n2:]) == INT4).all()  # ... then INT4 tokens
    assert sorted(entries[n2:].tolist()) == sorted(slots[got == INT4].tolist())
    assert (table.masks == 0xFFFFFFFF).all()
    # dead-slot eviction of two tokens of the first page clears their bits only
    first = np.flatnonzero(got == INT2)[:2]
    keep = np.setdiff1d(np.arange(n), first)
    e.kv.apply_layout(row, layouts.dead_slot(e.row_state[row].slots, keep))
    after = e.kv.page_table(row)
    hit = after.pages.tolist().index(int(slots[first[0]] // PAGE))
    cleared = sum(1 << int(s % PAGE) for s in slots[first])
    assert int(after.masks[hit]) == 0xFFFFFFFF ^ cleared and after.pages.size == n2


def test_decode_tokens_go_to_int4_and_kivi_keeps_a_recent_float_window(qmodel):
    rng = np.random.default_rng(1)
    prompt = rng.integers(5, 500, 200).tolist()
    e = Engine(qmodel, **SHAPE, kv_quant="triaxial")
    row = e.open_row()
    e.prefill([row], [prompt], kv_bits=[np.full(200, 2)])
    for _ in range(6):  # calls of the shelving test's shape (3 steps): its decode programs
        e.decode([row], [7], 3)
    kinds = kinds_of(e, row)
    assert (kinds[200:] == INT4).all() and kinds.size == 218
    assert (kinds[:192] == INT2).all() and (kinds[192:200] == INT4).all()  # 200 = 6 pages + 8 leftover

    for mode, page_bits in (("kivi2", 2), ("kivi4", 4)):
        k = Engine(qmodel, **SHAPE, kv_quant=mode)
        assert k.cache.pool.int2.bits == page_bits and k.cache.pool.int2.k.data.shape[-1] == 32 * page_bits // 8
        row = k.open_row()
        k.prefill([row], [prompt])
        for call in range(17):  # the prompt, then 16 calls of 3 tokens: the window fills a page past the residual and pages it out
            if call:
                k.decode([row], [7], 3)
            kinds = kinds_of(k, row)
            floats = np.flatnonzero(kinds == FLOAT)
            assert KIVI_RESIDUAL <= floats.size < KIVI_RESIDUAL + PAGE  # the most recent tokens, in full precision
            assert floats.tolist() == list(range(kinds.size - floats.size, kinds.size))
            assert (kinds[: kinds.size - floats.size] == INT2).all()  # everything older in pages of page_bits
            paged = kinds.size - floats.size
            assert k.kv.composition(row) == {2: paged if page_bits == 2 else 0, 3: 0, 4: paged if page_bits == 4 else 0, 16: floats.size}


def test_prefix_cached_token_keeps_its_first_precision(qmodel):
    """A token matched through the radix cache keeps the precision it was first
    written with: session B (all INT4) reuses session A's INT2 prefix as is."""
    msgs = [
        {"role": "system", "content": "Read the document below and answer."},
        {"role": "user", "content": " ".join(["report budget travel legal"] * 30)},
        {"role": "assistant", "content": "ok"},
    ]
    with Server(qmodel, **SERVER) as server:
        a = server.session(kv_bits=2.0, kv_allocation=allocation())
        b = server.session(kv_bits=4.0, kv_allocation=allocation())
        a.replay(msgs)
        b.replay(msgs)
        ra, rb = a.quantization.records[0], b.quantization.records[0]
        assert ra.int4 < PAGE and ra.int2 >= 3 * PAGE  # A: INT2 but for the tokens that do not fill a page
        assert rb.int2 >= ra.int2 - 1  # B writes only its last prompt token (INT4), yet holds A's INT2 rows
        c = server.session(kv_bits=4.0, kv_allocation=allocation())
        c.replay([msgs[0], {"role": "user", "content": "other words entirely"}, msgs[2]])
        hit = c.metrics.requests[0].prefix_hit_tokens
        assert 0 < hit < PAGE and c.quantization.records[0].int2 == hit  # the shared system prompt only
        for other in ("kivi2", None):  # a float region this pool does not have
            with pytest.raises(ConfigError):
                server.session(kv_quant=other)
        assert server.session(kv_allocation=allocation()).quantization.mode == "triaxial"  # inherits the pool
        d = server.session(kv_quant="int4")  # same regions, no kv_bits: every token INT4, A's prefix as written
        d.replay(msgs)
        rd = d.quantization.records[0]
        assert rd.int2 == rb.int2 and rd.full == 0


@pytest.mark.parametrize("mode", ["triaxial", "kivi2", "kivi4"])
def test_shelved_rows_are_promoted_back_bit_identical(qmodel, mode):
    e = Engine(qmodel, **SHAPE, kv_quant=mode)
    rng = np.random.default_rng(2)
    row = e.open_row()
    bits = np.where(np.arange(200) % 3 == 0, 4, 2) if mode == "triaxial" else None
    e.prefill([row], [rng.integers(5, 500, 200).tolist()], kv_bits=None if bits is None else [bits])
    e.decode([row], [7], 3)
    kinds = kinds_of(e, row)
    pick = np.concatenate([np.flatnonzero(kinds == INT2)[[0, 1, 5, 40, 63]], np.flatnonzero(kinds != INT2)[[0, -1]]])
    pick.sort()
    slots = np.asarray(e.row_state[row].slots)[pick]
    before = e.kv.gather_rows(slots)
    k_before = np.asarray(e.kv.gather_keys(row))
    keep = np.setdiff1d(np.arange(kinds.size), pick)
    shelved = e.kv.apply_layout(row, layouts.dead_slot(e.row_state[row].slots, keep), keep_evicted=True)
    assert all(np.array_equal(x, y) for x, y in zip(shelved, before))
    fresh = e.kv.restore_rows(row, pick, *shelved)
    assert (fresh != slots).any() and (e.pool.geometry.kind(fresh) == e.pool.geometry.kind(slots)).all()
    after = e.kv.gather_rows(fresh)
    assert all(np.array_equal(x, y) for x, y in zip(after, before))  # packed bytes, page parameters included
    assert np.array_equal(np.asarray(e.kv.gather_keys(row)), k_before)
    two = e.pool.geometry.kind(fresh) == INT2  # rows of one original page share one fresh page
    assert np.unique(fresh[two] // PAGE).size == np.unique(slots[two] // PAGE).size


def _decode_logits(qmodel, mode, backend, mass):
    """The logits of the parity test's decode (3 steps, 2 rows, some slots dead) on a
    fresh engine: through the decode loop's page-table path, or with ``mass`` as
    single steps through the float reference over the dequantized live list."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(5, 500, 256).tolist()
    bits = rng.choice([2, 3, 4], 256, p=[0.4, 0.35, 0.25])
    e = Engine(qmodel, **SHAPE, kv_quant=mode, backend=backend)
    rows = [e.open_row(), e.open_row()]
    e.prefill(rows, [prompt, prompt[:128]], kv_bits=None if mode.startswith("kivi") else [bits, bits[:128]])
    e.kv.apply_layout(rows[0], layouts.dead_slot(e.row_state[rows[0]].slots, np.setdiff1d(np.arange(256), [3, 40, 41])))
    out = e.decode(rows, [7, 9], 3, return_logits=True, forced_tokens=[[11, 12], [14, 15]], attn_mass=mass)
    if mode == "triaxial":
        assert e.kv.composition(rows[0])[INT2] >= PAGE and e.kv.composition(rows[0])[3] >= PAGE
    return np.stack(out[1])


@pytest.fixture(scope="module")
def reference_logits(qmodel):
    """Per pool format, the float reference's logits (``_decode_logits`` with
    ``mass``), computed once: the interpret backend's reference is the same blocked
    path (``QuantKernelBackend`` runs steps through ``CpuQuantBackend.attend_blocked``),
    so both backends' page-table paths are held to one reference."""
    cache = {}

    def get(mode):
        if mode not in cache:
            cache[mode] = _decode_logits(qmodel, mode, None, True)
        return cache[mode]

    return get


@pytest.mark.parametrize(
    "mode,backend", [("triaxial", None), ("triaxial", "interpret"), ("kivi2", None), ("kivi4", None)]
)  # kivi4 in interpret mode: tests/test_quant.py
def test_quantized_decode_logits_equal_attention_over_dequantized_kv(qmodel, reference_logits, mode, backend):
    """The page-table path (``quantized_decode_attention``: kernel in interpret mode,
    reference on CPU) and the float reference over the dequantized live list give
    the same logits; both write the new token the same way. The triaxial prompt
    writes INT2 pages, INT3 pages and INT4 rows."""
    got = _decode_logits(qmodel, mode, backend, False)
    want = reference_logits(mode)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("mode", ["int4", "kivi2", "kivi4"])
def test_quantized_rows_decode_alike_alone_and_batched(qmodel, mode):
    """A row's logits do not depend on the rows prefilled and decoded beside it: each
    row's writes land in its own slots and pages, in every layer (the writer scatters
    into the whole ``[L, ...]`` arrays at (layer, rows))."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(5, 500, n).tolist() for n in (256, 128, 97)]
    forced = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]]

    def run(which):
        e = Engine(qmodel, **SHAPE, kv_quant=mode)
        rows = [e.open_row() for _ in which]
        e.prefill(rows, [prompts[i] for i in which])
        out = e.decode(rows, [7] * len(which), 6, return_logits=True, forced_tokens=[forced[i] for i in which])
        return np.stack(out[1])

    together = run([0, 1, 2])
    for i in range(3):
        alone = run([i])[0]
        assert np.abs(alone - together[i]).max() <= 1e-5 * np.abs(alone).max()


@pytest.mark.parametrize("mode", ["int4", "triaxial"])
def test_quantized_decode_window_equals_per_step_gather(qmodel, mode, monkeypatch):
    """The CPU decode loop's float window of the rows' dequantized entries
    (``CpuQuantBackend.take_window``, kept across calls) gives the tokens, logits
    and query rows of gathering packed rows from the pool every step
    (``decode_parts_attention``): rows of different lengths over several key
    blocks, INT2 pages partly held (dead slots), and four calls, so the call's own
    new tokens are read back quantized both from the window's new part (within a
    call) and from the rolled window (the next call's first part), with a
    truncation (rolled back) and an eviction (copied again) between calls. The
    triaxial rows write INT2 pages, INT3 pages and INT4 rows."""
    import jaxkv.engine.runner as runner_mod

    calls = []
    run = runner_mod.run_decode
    monkeypatch.setattr(runner_mod, "run_decode", lambda *a, **k: calls.append(k["width"]) or run(*a, **k))
    rng = np.random.default_rng(11)
    prompts = [rng.integers(5, 500, n).tolist() for n in (768, 128)]
    bits = [rng.choice([2, 3, 4], len(p), p=[0.4, 0.35, 0.25]) for p in prompts] if mode == "triaxial" else None
    runs = {}
    for window in (True, False):
        e = Engine(qmodel, **SHAPE, kv_quant=mode)
        e.runner.use_window = window
        rows = [e.open_row(), e.open_row()]
        e.prefill(rows, prompts, kv_bits=bits)
        e.kv.apply_layout(rows[0], layouts.dead_slot(e.row_state[rows[0]].slots, np.setdiff1d(np.arange(768), [3, 40, 41, 300, 301])))
        out = [e.decode(rows, [7, 9], 6, return_logits=True, query_rows=True)]
        for call in (1, 2, 3):
            if call == 2:  # row 1 drops the last call's tokens: the kept window rolls back with it
                e.truncate_row(rows[1], len(e.row_state[rows[1]].slots) - 4)
            if call == 3:  # an eviction writes the tables: the window is copied again
                e.kv.apply_layout(
                    rows[0], layouts.dead_slot(e.row_state[rows[0]].slots, np.setdiff1d(np.arange(758), [3, 40, 41, 300, 301]))
                )
            out.append(e.decode(rows, [t[-1] for t in out[-1][0]], 6, return_logits=True, query_rows=True))
        assert e.runner.uses_window(2, 1024) == window
        runs[window] = (out, e.runner.regathers)
    assert calls == [1024] * 4 + [0] * 4  # each windowed call read a window as wide as the 768-entry list's bucket; then none
    assert runs[True][1] == 2  # copied by the first call and after the eviction; rolled on by the others
    if mode == "triaxial":
        assert e.kv.composition(rows[0])[INT2] > 0 and e.kv.composition(rows[0])[3] > 0
    for (tok_w, log_w, aux_w), (tok_g, log_g, aux_g) in zip(runs[True][0], runs[False][0]):
        assert tok_w == tok_g
        for a, b in zip(log_w, log_g):
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
        for a, b in zip(aux_w["q_rows"], aux_g["q_rows"]):
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_kivi_pools_decode_without_a_window(qmodel):
    """KIVI's token part is its float residual: no quantized window (the CPU decode
    loop gathers from the packed pool)."""
    assert not Engine(qmodel, rows=1, max_positions=512, kv_quant="kivi2").runner.uses_window(1, 512)
    assert Engine(qmodel, rows=1, max_positions=512, kv_quant="int4").runner.uses_window(1, 512)


def test_prefill_attends_over_the_dequantized_prefix_and_its_chunk_in_full_precision(qmodel):
    """A second prefill on a quantized pool = a float pool holding the dequantized
    K/V of the first (the new chunk itself in full precision)."""
    rng = np.random.default_rng(8)
    tokens = rng.integers(5, 500, 200).tolist()
    bits = np.where(rng.random(128) < 0.6, 2, 4)
    q = Engine(qmodel, **SHAPE, kv_quant="triaxial")
    f = Engine(qmodel, **SHAPE)
    rq, rf = q.open_row(), f.open_row()
    q.prefill([rq], [tokens[:128]], kv_bits=[bits])
    f.prefill([rf], [tokens[:128]])
    geo = q.pool.geometry

    @jax.jit  # one program (op by op, the reads and the float pool's writes were ~100)
    def float_cache(pool, q_slots, cache, f_slots):
        layers = [dequantize_slots(pool.layer(i), geo, q_slots) for i in range(2)]
        k, v = jnp.stack([k for k, _ in layers]), jnp.stack([v for _, v in layers])
        return cache.replace(k=cache.k.at[:, f_slots].set(k), v=cache.v.at[:, f_slots].set(v))

    f.kv.commit(float_cache(q.cache.pool, jnp.asarray(q.row_state[rq].slots), f.cache, jnp.asarray(f.row_state[rf].slots)))
    got = q.prefill([rq], [tokens[128:]], all_logits=True)[0]
    want = f.prefill([rf], [tokens[128:]], all_logits=True)[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("mode", [None, "kivi2", "triaxial"])  # float; pages + float window; pages by bits + INT4
def test_an_imported_prefill_stores_what_a_one_chunk_prefill_stores(qmodel, mode):
    """Branching a full-precision prefill into a pool of any format
    (``start_prefill(kv_source=...)``, no forward): the pool holds exactly what
    that format's prefill of the whole prompt in one chunk holds, the row goes on
    alike, the source's logits come back, and what an import cannot give is refused."""
    # the prompt in one chunk (full-precision attention): a chunk of SHAPE, or for
    # KIVI a 200-token one of ONE_CHUNK (past its 128-token float window: pages too)
    shape, n = (ONE_CHUNK, 200) if mode == "kivi2" else (SHAPE, 128)
    rng = np.random.default_rng(9)
    tokens, more = rng.integers(5, 500, n).tolist(), rng.integers(5, 500, 72).tolist()
    bits = np.where(rng.random(n) < 0.6, 2, 4) if mode == "triaxial" else None
    src = Engine(qmodel, **shape)
    rs = src.open_row()
    last = src.prefill([rs], [tokens])[0]
    k, v = src.pool.gather_float(src.cache, src.row_state[rs].slots)
    one = Engine(qmodel, **shape, kv_quant=mode)
    imp = Engine(qmodel, **shape, kv_quant=mode)
    r1, r2 = one.open_row(), imp.open_row()
    one.prefill([r1], [tokens], kv_bits=None if bits is None else [bits])
    job = imp.start_prefill(r2, tokens, kv_bits=bits, kv_source=KVSource(k, v, last))
    while not job.finished:
        imp.step(prefill_jobs=[job])
    np.testing.assert_array_equal(job.result_logits(), last)
    assert imp.row_state[r2].slots == one.row_state[r1].slots
    # every array of the cache, the sentinel slot aside (a float pool's padding rows
    # land there: written by the forward, never read)
    skip_sentinel = lambda c: c.replace(k=c.k.at[:, 0].set(0), v=c.v.at[:, 0].set(0)) if mode is None else c
    for a, b in zip(jax.tree.leaves(skip_sentinel(one.cache)), jax.tree.leaves(skip_sentinel(imp.cache))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(imp.prefill([r2], [more], all_logits=True)[0], one.prefill([r1], [more], all_logits=True)[0])

    r3 = imp.open_row()
    with pytest.raises(JaxKVError, match="shape"):
        imp.start_prefill(r3, tokens[:10], kv_source=KVSource(k, v, last))
    with pytest.raises(JaxKVError, match="no forward"):
        imp.start_prefill(r3, tokens, all_logits=True, kv_source=KVSource(k, v, last))
    assert imp.row_state[r3].seq_len == 0 and imp.allocator.num_free == one.allocator.num_free  # nothing allocated


@pytest.mark.parametrize("page_bits", [2, 4])
def test_pool_round_trip_within_half_a_step(qmodel, page_bits):
    """Through the pool's writer and reader, every element of pages (keys per
    channel, values per token; INT2, or KIVI-4's 4 bits) and INT4 rows is within
    half its quantization step."""
    geo = Geometry(pages=3, int4_slots=40)
    from jaxkv.cache.quantized import DualPool, write_tokens

    pool = DualPool.create(geo, num_layers=1, num_kv_heads=2, head_dim=64, dtype=jnp.float32, page_bits=page_bits)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((96, 2, 64)) * rng.uniform(0.1, 5, (96, 1, 1)) + rng.uniform(-3, 3, (96, 1, 64))
    k, v = jnp.asarray(x, jnp.float32), jnp.asarray(x[::-1].copy(), jnp.float32)
    slots = np.concatenate([np.arange(32, 96), geo.off4 + np.arange(32)])  # 2 pages, 32 INT4 rows
    write, read = jax.jit(write_tokens, static_argnums=(1, 2)), jax.jit(dequantize_slots, static_argnums=1)  # one program each
    pool = write(pool, geo, 0, k, v, jnp.asarray(slots), jnp.arange(64).reshape(2, PAGE), jnp.asarray([1, 2])).layer(0)
    kd, vd = (np.asarray(a, np.float64) for a in read(pool, geo, jnp.asarray(slots)))
    tiny = 2.0**-20 * (np.abs(x) + 1)
    assert pool.int2.k.data.shape[-1] == 64 * page_bits // 8
    ks2 = np.asarray(pool.int2.k.scale[1:], np.float64)  # [2, K, D] per channel
    assert (np.abs(kd[:64] - x[:64]).reshape(2, 32, 2, 64) <= ks2[:, None] / 2 + tiny[:64].reshape(2, 32, 2, 64)).all()
    vs2 = np.asarray(pool.int2.v.scale[1:], np.float64).transpose(0, 2, 1, 3).reshape(64, 2, 2)  # [P, K, 32, D/32] -> per token
    assert (np.abs(vd[:64] - x[::-1][:64]).reshape(64, 2, 2, 32) <= vs2[..., None] / 2 + tiny[:64].reshape(64, 2, 2, 32)).all()
    for rows, ref, out in ((pool.int4.k, x[64:], kd[64:]), (pool.int4.v, x[::-1][64:], vd[64:])):
        s4 = np.asarray(rows.scale[:32], np.float64)  # [32, K, D/32]
        assert (np.abs(out - ref).reshape(32, 2, 2, 32) <= s4[..., None] / 2 + tiny[64:].reshape(32, 2, 2, 32)).all()


# ----------------------------------------------------------------------------- allocation
def test_solver_matches_brute_force_on_random_tables():
    rng = np.random.default_rng(5)
    for trial in range(60):
        n = int(rng.integers(1, 9))
        D4 = rng.uniform(0, 1, n)
        D2 = D4 + rng.exponential(1.0, n)
        N = np.where(rng.random(n) < 0.15, 0, rng.integers(1, 500, n)).astype(float)
        B = float(rng.uniform(2, 4))
        got = solve(D2, D4, N, B)
        best = None
        for up in itertools.product((0, 1), repeat=n):
            b = np.where(np.asarray(up, bool), 4, 2)
            if (N * b).sum() <= B * N.sum() + 1e-9:
                loss = np.where(b == 4, D4, D2)[N > 0].sum()
                best = loss if best is None else min(best, loss)
        assert (N * got).sum() <= B * N.sum() + 1e-9, trial
        assert np.where(got == 4, D4, D2)[N > 0].sum() == pytest.approx(best), trial
        assert (got[N == 0] == 4).all()


def test_greedy_beyond_22_tags_follows_rho():
    rng = np.random.default_rng(6)
    N = rng.integers(1, 100, 30).astype(float)
    D4 = rng.uniform(0, 1, 30)
    D2 = D4 + rng.exponential(1.0, 30)
    got = solve(D2, D4, N, 2.5)
    spare = 0.5 * N.sum()
    want = np.full(30, 2)
    for k in np.argsort(-(D2 - D4) / (2 * N), kind="stable"):
        if 2 * N[k] <= spare:
            want[k], spare = 4, spare - 2 * N[k]
    assert got.tolist() == want.tolist()


# ----------------------------------------------------------------------------- sessions
@pytest.mark.parametrize("layout", ["dead_slot", "compact"])
def test_quantized_session_composes_with_retention_and_repair(qmodel, layout):
    from jaxkv.tasks import mqniah

    ex = mqniah(1, 77, needles=4, length=600)[0]  # document + question, then a second question
    repair = {"repair": 16} if layout == "dead_slot" else {}
    with Server(qmodel, **SERVER) as server:
        s = server.session(
            kv_quant="triaxial", kv_allocation=allocation(), protect_query=False, policy="snapkv", budget=160, layout=layout, **repair
        )
        s.replay(ex.messages, ex.tools)
        assert any(r.live_after < r.live_before for r in s.compressions)
        assert any(r.int2 > 0 for r in s.quantization.records)
        if repair:
            assert sum(r.promoted_positions.size for r in s.repairs) > 0
        engine, radix = s.server.engine, s.server.radix
        assert all(st is None for st in engine.row_state)
        held = np.bincount(radix.held_slots(), minlength=engine.allocator.num_slots)
        assert np.array_equal(engine.allocator.refcounts(), held)  # only the radix cache holds slots
        pages = np.unique(radix.held_slots()[engine.pool.geometry.kind(radix.held_slots()) == INT2] // PAGE)
        assert engine.allocator.pages_used == pages.size


def test_session_options_are_checked(qmodel):
    with pytest.raises(ConfigError):
        Session(qmodel, kv_quant="int3")
    with pytest.raises(ConfigError):
        Session(qmodel, kv_quant="int4", kv_bits=2.5)
    with pytest.raises(ConfigError):
        Session(qmodel, kv_quant="triaxial", kv_allocation=allocation(), kv_bits=1.5)
    with pytest.raises(ConfigError):
        Session(qmodel, kv_quant="triaxial")  # an in-memory model has no calibration file
    with Server(qmodel, rows=1, max_positions=256) as server:
        with pytest.raises(ConfigError):
            server.session(kv_quant="kivi2")  # a float pool cannot hold packed rows
