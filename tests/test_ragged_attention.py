"""The ragged paged attention's CPU implementation (``ragged_attention_blocked``)
against its jnp reference and a float64 numpy oracle: ragged steps that mix
prefill chunks and decode rows, rows with evicted holes and garbage past their
length, GQA ratios 1 to 8, head dims 64 and 128; its attention mass; and the
engine's per-layer live lists (each layer reads its own list)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import ragged_attention_reference
from jaxkv.kernels.attention.ragged import KEY_BLOCK, PoolReader, pad_lists, ragged_attention_blocked
from jaxkv.kernels.testing import attention_f64, rel_err


def ragged_problem(seed, q_lens, old_lens, *, Hq, K, D, pad=5, dtype=np.float32):
    """A pool, queries and live lists: row ``r`` has ``old_lens[r]`` older entries
    and ``q_lens[r]`` new ones, at shuffled slots (holes everywhere), with real
    slots no row lists past its length (reading them would change results); rows'
    queries in a shuffled order."""
    rng = np.random.default_rng(seed)
    R = len(q_lens)
    S = sum(q_lens) + sum(old_lens) + 64
    k = rng.standard_normal((S, K, D)).astype(dtype)
    v = rng.standard_normal((S, K, D)).astype(dtype)
    N = max(o + q for o, q in zip(old_lens, q_lens)) + 3
    perm = rng.permutation(S - 1) + 1
    unused = perm[S - 64 :]  # no row lists these
    live = np.zeros((R, N), np.int32)
    kv_len = np.zeros(R, np.int32)
    at = 0
    for r in range(R):
        n = old_lens[r] + q_lens[r]
        live[r, :n] = perm[at : at + n]
        live[r, n:] = rng.choice(unused, N - n)  # garbage: real slots, never to be read
        kv_len[r], at = n, at + n
    q_start = np.zeros(R, np.int32)
    start = 0
    for r in rng.permutation(R):
        q_start[r], start = start, start + q_lens[r]
    q = rng.standard_normal((start + pad, Hq, D)).astype(dtype)
    return q, k, v, live, kv_len, q_start, np.asarray(q_lens, np.int32)


def oracle_f64(q, k, v, live, kv_len, q_start, q_len):
    """Each owned token: its row's first ``kv_len - q_len + j + 1`` entries, float64."""
    out = np.zeros(q.shape, np.float64)
    for r in range(len(q_len)):
        for j in range(q_len[r]):
            sees = live[r, : kv_len[r] - q_len[r] + j + 1]
            out[q_start[r] + j] = attention_f64(q[q_start[r] + j], k[sees], v[sees])
    return out


reference = jax.jit(ragged_attention_reference)  # eager, its [T, N] gathers took 4 s a call (as in test_ragged_kernels)


@functools.cache
def _blocked_jit(**kw):
    """One jitted function per keyword set, so calls of one shape compile once."""
    return jax.jit(lambda *a: ragged_attention_blocked(a[0], PoolReader(a[1], a[2], pad_lists(a[3])), *a[4:], **kw))


def blocked(q, k, v, live, kv_len, q_start, q_len, **kw):
    return _blocked_jit(**kw)(*map(jnp.asarray, (q, k, v, live, kv_len, q_start, q_len)))


CASES = [
    # (q lengths, older entries): prefill rows of several tile shapes beside decode rows,
    # a row absent from the step (q_len 0), rows past one key block (a 300-token row from
    # scratch: a big tile then two small ones; 260 tokens after 600: a big tile reading a
    # whole key block, then a small one; a decode row over three key blocks)
    ((1, 300, 1, 40, 0, 260), (100, 0, 1100, 513, 5, 600)),
    ((1, 1, 1, 1), (511, 512, 513, 0)),
    ((2, 33, 257), (1, 1023, 0)),
]


@pytest.mark.parametrize("q_lens,old_lens", CASES)
@pytest.mark.parametrize("Hq,K,D", [(9, 3, 64), (8, 1, 128), (4, 4, 64)])  # GQA 3, 8 (head dim 128) and 1
def test_blocked_matches_the_reference_and_the_float64_oracle(q_lens, old_lens, Hq, K, D):
    problem = ragged_problem(sum(q_lens) + D, q_lens, old_lens, Hq=Hq, K=K, D=D)
    got = np.asarray(blocked(*problem))
    ref = np.asarray(reference(*map(jnp.asarray, problem)))
    exact = oracle_f64(*problem)
    assert rel_err(got, exact) <= 1e-5
    assert rel_err(ref, exact) <= 1e-5
    q, _, _, _, _, q_start, q_len = problem
    owned = np.zeros(len(q), bool)
    for s, n in zip(q_start, q_len):
        owned[s : s + n] = True
    assert (got[~owned] == 0).all()  # padding tokens: zero


def test_every_query_sees_exactly_its_own_prefix():
    """Changing an entry a query must not see (a later chunk token, a garbage entry
    past the row's length) leaves its output bit for bit; changing one it sees
    does not."""
    problem = ragged_problem(11, (70, 1), (600, 40), Hq=4, K=2, D=64)
    q, k, v, live, kv_len, q_start, q_len = problem
    base = np.asarray(blocked(*problem))
    r = 0
    j = 30  # query 30 of row 0 sees entries [0, 600 + 31)
    later = live[r, 600 + 40]  # a chunk token after it
    garbage = live[r, kv_len[r]]  # past the row's length
    seen = live[r, 599]
    for slot, visible in ((later, False), (garbage, False), (seen, True)):
        v2 = v.copy()
        v2[slot] += 10.0
        out = np.asarray(blocked(q, k, v2, live, kv_len, q_start, q_len))
        same = (out[q_start[r] + j] == base[q_start[r] + j]).all()
        assert same != visible, (slot, visible)


def test_attention_mass_is_the_probability_each_entry_received():
    problem = ragged_problem(5, (1, 90, 3), (700, 30, 0), Hq=6, K=2, D=64)
    q, k, v, live, kv_len, q_start, q_len = problem
    R, N = live.shape
    width = N + (-N) % KEY_BLOCK
    _, mass = blocked(*problem, return_mass=True, width=width)
    mass = np.asarray(mass)
    expected = np.zeros((R, width))
    for r in range(R):
        for j in range(q_len[r]):
            n = kv_len[r] - q_len[r] + j + 1
            kk = k[live[r, :n]].astype(np.float64)  # [n, K, D]
            qq = q[q_start[r] + j].astype(np.float64).reshape(2, 3, 64)
            s = np.einsum("kgd,nkd->kgn", qq, kk) / 8.0
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            expected[r, :n] += p.sum(axis=(0, 1))
    np.testing.assert_allclose(mass, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mass.sum(-1), q_len * 6, rtol=1e-5)  # every query head's probabilities sum to 1


def test_each_layer_reads_its_own_live_list(hf_checkpoint):
    """A cache with one live list per layer (``PagedKVCache.create(lists=L)``):
    layer ``i`` attends over list ``i``. A row whose lists hold different subsets
    of its positions gives the logits of a dense oracle that masks each layer's own
    subset, and differs from the one-list answer."""
    import jaxkv
    from flax import nnx

    from jaxkv.attention import _attend, group_heads
    from jaxkv.cache.state import PagedKVCache
    from jaxkv.sampling import RowSamplers
    from jaxkv.backends import select_backend
    from jaxkv.forward import Outputs, StepBatch, run_step

    model = jaxkv.load_model(hf_checkpoint("qwen3")[0])
    cfg = model.config
    L, P, n_old, n_new = cfg.num_layers, 64, 30, 4
    tokens = np.random.default_rng(0).integers(0, 1000, n_old + n_new).tolist()
    engine = jaxkv.Engine(model, rows=1, max_positions=P)
    row = engine.open_row()
    engine.prefill([row], [tokens[:n_old]])
    slots = np.asarray(engine.row_state[row].slots)
    keep = [np.setdiff1d(np.arange(n_old), drop) for drop in ([2, 3, 17], [0, 9, 10, 11, 25])][:L]
    cache = PagedKVCache.create(
        num_layers=L,
        num_slots=engine.cache.num_slots,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rows=1,
        positions=P,
        dtype=jnp.float32,
        lists=L,
    )
    live = np.zeros((L, 1, P), np.int32)
    for i in range(L):
        live[i, 0, : keep[i].size] = slots[keep[i]]
    copy = jnp.copy  # the step donates its cache: the engine keeps its own arrays
    cache = cache.replace(
        k=copy(engine.cache.k),
        v=copy(engine.cache.v),
        slot_map=copy(engine.cache.slot_map),
        seq_len=copy(engine.cache.seq_len),
        live_idx=jnp.asarray(live),
        live_len=jnp.asarray([[kp.size] for kp in keep], jnp.int32),
    )
    T = 16
    batch = StepBatch(
        np.pad(tokens[n_old:], (0, T - n_new)).astype(np.int32),
        np.pad(np.arange(n_old, n_old + n_new), (0, T - n_new)).astype(np.int32),
        np.pad(engine.allocator.allocate(n_new), (0, T - n_new)).astype(np.int32),
        np.zeros(1, np.int32),
        np.zeros(1, np.int32),
        np.full(1, n_new, np.int32),
        np.zeros((1, 2), np.uint32),
        np.zeros(1, np.int32),
        RowSamplers.of([(0.0, None, None)]),
        np.zeros(1, np.int32),
    )
    _, cache, aux = run_step(
        engine.runner.graphdef,
        engine.runner.params,
        cache,
        batch,
        backend=select_backend(engine.pool.layers),
        outputs=Outputs(logits="all"),
    )
    got = np.asarray(aux["logits"])[:n_new]
    assert (np.asarray(cache.live_len)[:, 0] == [kp.size + n_new for kp in keep]).all()  # each list grew by the step

    module = nnx.merge(engine.runner.graphdef, engine.runner.params)

    def capture(i, q, k, v, carry):  # the dense causal forward of the prefix, keeping every layer's K/V
        out, _ = _attend(group_heads(q, k.shape[2]), k, v, jnp.tril(jnp.ones((n_old, n_old), bool))[None])
        return out.astype(q.dtype), carry, (k, v)

    ids = jnp.asarray([tokens[:n_old]])
    _, _, (k_all, v_all) = module.run_layers(module.embed_tokens(ids), jnp.arange(n_old)[None], capture)

    def kept_attend(i, q, k, v, carry):
        masks = jnp.asarray(np.stack([np.isin(np.arange(n_old), kp) for kp in keep]))  # [L, n_old]
        k_full = jnp.concatenate([k_all[i], k], axis=1)
        v_full = jnp.concatenate([v_all[i], v], axis=1)
        mask = jnp.concatenate([jnp.broadcast_to(masks[i], (n_new, n_old)), jnp.tril(jnp.ones((n_new, n_new), bool))], axis=1)
        out, _ = _attend(group_heads(q, k.shape[2]), k_full, v_full, mask[None])
        return out.astype(q.dtype), carry, None

    x, _, _ = module.run_layers(module.embed_tokens(jnp.asarray([tokens[n_old:]])), jnp.arange(n_old, n_old + n_new)[None], kept_attend)
    want = np.asarray(module._logits(x))[0]
    assert rel_err(got, want) <= 1e-5
    one_list = engine.prefill([row], [tokens[n_old:]], all_logits=True)[0]  # every layer reads the full list
    assert rel_err(one_list, want) > 1e-2
