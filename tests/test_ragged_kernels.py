"""The ragged paged attention kernels on the CPU: the Triton kernels (``jaxkv.kernels.triton
.ragged``) under the Triton interpreter and the Pallas kernels (``jaxkv.kernels.attention.ragged_tpu``)
in TPU interpret mode, each against ``ragged_attention_reference`` and a float64 numpy
oracle (``jaxkv.kernels.testing.ragged_f64``), plus the tile list they share
(``jaxkv.kernels._ragged_tiles``).

Every step mixes prefill chunks (from scratch and after cached entries, several tiles
long, a few tokens long), decode rows (one entry and many), an absent row, padding
tokens, rows in a shuffled flat order, and lists of scattered slots whose tails past
``kv_len`` point at pool rows holding NaN (a kernel that reads an entry it must not see
turns NaN). Both interpreters allocate outputs poisoned with NaN, so an output no
program writes shows (``test_unwritten_tiles_show_as_nan`` checks that premise).
``tests/conftest.py`` sets ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import ragged_attention_reference
from jaxkv.errors import BackendUnavailableError
from jaxkv.kernels import _ragged_tiles as tiles_mod
from jaxkv.kernels.attention.ragged import ragged_attention
from jaxkv.kernels.testing import ragged_f64, ragged_problem, rel_err, tolerance

# (q_len, kv_len) per row: a chunk after cached entries, a decode row, an absent row, a
# short new row, a first decode token, a long chunk after a long history (several
# tiles, whole and diagonal key blocks), a row of two queries
ROWS = ((40, 100), (1, 77), (0, 5), (3, 3), (1, 1), (70, 200), (2, 2))
# The same kinds of rows, shorter, where tiles hold fewer queries (GQA groups of 1 on
# the GPU, of 4 and 8 on both): the long chunk still spans two tiles or more on both
# backends and its first tile still reads a whole key block (130 entries before it)
SHORT_ROWS = ((20, 80), (1, 77), (0, 5), (3, 3), (1, 1), (40, 170), (2, 2))
CASES = [
    (64, 1, jnp.float32, SHORT_ROWS),
    (128, 2, jnp.bfloat16, ROWS),
    (64, 4, jnp.bfloat16, SHORT_ROWS),
    (128, 8, jnp.float32, SHORT_ROWS),
]


def _gpu(*args):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from jaxkv.kernels.triton import ragged as gpu_ragged
    from jaxkv.kernels.triton.interpret import interpret_call

    return jax.jit(functools.partial(gpu_ragged.ragged_attention, launcher=interpret_call))(*args)


def _tpu(*args):
    return ragged_attention(*args, backend="interpret")


KERNELS = {"triton": _gpu, "pallas": _tpu}
reference = jax.jit(ragged_attention_reference)


def _unseen_poisoned(args):
    """``args`` with every pool row no query may see set to NaN (slot 0, the sentinel,
    excepted) and the lists' tails past ``kv_len`` pointing at such rows: a kernel
    that reads an entry it must not see turns its output NaN."""
    q, k, v, live, kv_len, q_start, q_len = args
    live = np.array(live)
    seen = np.zeros(k.shape[0], bool)
    seen[0] = True
    for r, n in enumerate(np.asarray(kv_len)):
        seen[live[r, :n]] = True
    unseen = np.flatnonzero(~seen)
    for r, n in enumerate(np.asarray(kv_len)):
        live[r, n:] = unseen[np.arange(live.shape[1] - n) % len(unseen)]
    nan = jnp.asarray(~seen)[:, None, None]
    return q, jnp.where(nan, jnp.nan, k), jnp.where(nan, jnp.nan, v), jnp.asarray(live), kv_len, q_start, q_len


def _check(kernel, args, tol):
    """Run ``kernel`` on ``args`` with unseen pool rows poisoned; check it against the
    reference and the float64 oracle on the clean pool, and zeros at padding."""
    out = KERNELS[kernel](*_unseen_poisoned(args))
    q = args[0]
    assert out.dtype == q.dtype and out.shape == q.shape
    got = np.asarray(out, np.float32)
    assert np.isfinite(got).all()  # every owned token written (outputs start as NaN), no unseen row read
    assert rel_err(got, reference(*args)) <= tol
    assert rel_err(got, ragged_f64(*args)) <= tol
    owned = np.zeros(q.shape[0], bool)
    for start, n in zip(np.asarray(args[5]), np.asarray(args[6])):
        owned[start : start + n] = True
    assert (got[~owned] == 0).all()  # padding tokens
    return got


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("D,G,dtype,rows", CASES)
def test_mixed_step_matches_reference_and_f64(kernel, D, G, dtype, rows):
    long_q = max(q for q, _ in rows)
    tiles = {"pallas": tiles_mod.tpu_tile(G), "triton": tiles_mod.gpu_tile(G, D, jnp.dtype(dtype).itemsize)}[kernel]
    assert G == 1 and kernel == "pallas" or long_q > tiles.queries  # the premise: the long chunk spans tiles
    _check(kernel, ragged_problem(D + G, 2, G, D, dtype, rows, pad=5), tolerance(dtype))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_decode_only_and_prefill_only_steps(kernel):
    """A step of decode rows only (the tiles all unused) and one of a single chunk
    (the decode kernel's splits all empty)."""
    decode = ragged_problem(8, 1, 3, 64, jnp.bfloat16, ((1, 50), (1, 1), (1, 130), (0, 4)), pad=1)
    _check(kernel, decode, tolerance(jnp.bfloat16))
    prefill = ragged_problem(9, 1, 3, 64, jnp.bfloat16, ((45, 60),), pad=0, width=60)  # a list exactly kv_len long
    _check(kernel, prefill, tolerance(jnp.bfloat16))


def test_unwritten_tiles_show_as_nan():
    """The premise of the checks above, for the tile launch: a grid that drops the
    last KV head leaves its query heads' outputs NaN at every tiled token, and only there."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from jaxkv.kernels.triton import ragged as gpu_ragged
    from jaxkv.kernels.triton.interpret import run

    q, k, v, live, kv_len, q_start, q_len = ragged_problem(3, 2, 2, 64, jnp.float32, ((30, 50), (1, 9)), pad=2)
    launch = gpu_ragged.tile_launch(q, k, live)
    tiles = tiles_mod.query_tiles(q.shape[0], kv_len, q_start, q_len, gpu_ragged.tile_queries(q, k))
    NT, K = launch.grid
    (out,) = run(dataclasses.replace(launch, grid=(NT, K - 1)), tiles.packed(), live, q, k, v)
    tiled = np.asarray(tiles_mod.token_owner(q.shape[0], q_start, q_len)) >= 0
    assert np.isnan(out[tiled][:, 2:]).all() and np.isfinite(out[tiled][:, :2]).all()


def test_decode_rows_take_the_compiled_decode_launch():
    """The ragged step's decode rows launch ``decode_float_tokens`` exactly as a batch
    of that many requests does: the AOT report's decode row covers them."""
    pytest.importorskip("triton")
    from jaxkv.kernels.triton import aot, decode, kernels
    from jaxkv.kernels.triton import ragged as gpu_ragged

    sds = jax.ShapeDtypeStruct
    m = aot.MODELS[0]
    Hq, pool = m.kv_heads * m.group, sds((aot.BATCH * aot.CONTEXT + 1, m.kv_heads, m.head_dim), m.dtype)
    ids = sds((aot.BATCH, aot.CONTEXT), jnp.int32)
    want = decode.decode_launch(kernels.decode_float_tokens, sds((aot.BATCH, Hq, m.head_dim), m.dtype), (pool, pool), ids,
                                block=decode.token_block(m.dtype))  # fmt: skip
    assert gpu_ragged.decode_launch(sds((aot.STEP_TOKENS, Hq, m.head_dim), m.dtype), pool, ids) == want


def test_pallas_gathers_hold_when_dmas_land_at_once(monkeypatch):
    """The double-buffered K/V gathers of the Pallas tile kernel with the interpreter's
    DMAs executed when started (a TPU may land them any time before the wait) rather
    than at their wait, under its race detector: the step still matches the
    oracles. (Prefetching into the buffer being read fails this, in either mode.)"""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as simulator
    from jax.experimental.pallas import tpu as pltpu

    from jaxkv.kernels.attention import ragged_tpu

    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    monkeypatch.setattr(ragged_tpu, "pallas_options", lambda interpret, parallel_axes=2: {"interpret": params})
    args = ragged_problem(4, 1, 4, 128, jnp.float32, ((20, 300), (9, 9), (1, 40)), pad=2)
    out = np.asarray(jax.jit(functools.partial(ragged_tpu.ragged_attention, interpret=True))(*args))
    assert simulator.races is not None and not simulator.races.races_found
    assert np.isfinite(out).all()
    assert rel_err(out, reference(*args)) <= 1e-5 and rel_err(out, ragged_f64(*args)) <= 1e-5


def test_gpu_backend_without_cuda_is_a_typed_error():
    args = ragged_problem(1, 1, 2, 64, jnp.float32, ((3, 4),))
    with pytest.raises(BackendUnavailableError, match=r"jax-triton"):
        ragged_attention(*args, backend="gpu")


# --------------------------------------------------------------------------- the tile list


def _random_step(rng, T, R):
    """Random disjoint rows inside ``[0, T)`` (some absent, some decode), in a random order."""
    q_len = np.zeros(R, np.int32)
    q_start = rng.integers(0, T, R).astype(np.int32)
    budget = T - rng.integers(0, 4)
    for r in rng.permutation(R):
        q_len[r] = min(budget, rng.choice([0, 1, 2, 3, rng.integers(1, T + 1)]))
        budget -= q_len[r]
    at = 0
    for r in rng.permutation(R):
        if q_len[r]:
            q_start[r] = at
            at += q_len[r]
    kv_len = q_len + rng.integers(0, 500, R).astype(np.int32)
    return kv_len, q_start, q_len


tiles_of = jax.jit(tiles_mod.query_tiles, static_argnums=(0, 4), static_argnames="heaviest_first")
owner_of = jax.jit(tiles_mod.token_owner, static_argnums=0)


@pytest.mark.parametrize("Q", [1, 7, 128])
def test_tiles_partition_every_tiled_row(Q):
    """Tiles cover each row of two or more queries exactly once, in order, ``Q`` queries
    at most, with the right ``before``; unused tiles are all zero; the static bound
    holds (rows of two queries each are the worst case); ``token_owner`` agrees."""
    rng = np.random.default_rng(Q)
    T = 300
    steps = [(T, _random_step(rng, T, 40)) for _ in range(4)]
    steps.append((16, (np.full(8, 2, np.int32), np.arange(0, 16, 2, dtype=np.int32), np.full(8, 2, np.int32))))
    for T, (kv_len, q_start, q_len) in steps:
        meta = tuple(jnp.asarray(a) for a in (kv_len, q_start, q_len))
        want = {t: r for r in range(len(q_len)) if q_len[r] >= 2 for t in range(q_start[r], q_start[r] + q_len[r])}
        for heaviest in (False, True):
            tiles = [np.asarray(a) for a in tiles_of(T, *meta, Q, heaviest_first=heaviest)]
            row, start, count, before = tiles
            assert len(row) == tiles_mod.num_tiles(T, len(q_len), Q)
            unused = count == 0
            assert not row[unused].any() and not start[unused].any() and not before[unused].any()
            covered = {}
            for r, s, c, b in zip(*tiles):
                if c:
                    assert q_len[r] >= 2 and c <= Q
                    assert b == kv_len[r] - q_len[r] + (s - q_start[r])  # query s sees b + 1 entries
                    for t in range(s, s + c):
                        assert t not in covered
                        covered[t] = r
            assert covered == want
            if heaviest:
                assert (np.diff(before + count) <= 0).all()
        owner = np.asarray(owner_of(T, meta[1], meta[2]))
        assert {t: r for t, r in enumerate(owner) if r >= 0} == want


def test_tile_shapes():
    """GPU tiles: whole GQA groups in 128 (bf16) or 32 (fp32) rows; TPU tiles: rows a
    multiple of 16 and at most 128."""
    assert tiles_mod.gpu_tile(4, 128, 2) == tiles_mod.TileShape(128, 32, 64, 8)
    assert tiles_mod.gpu_tile(3, 64, 2).queries == 42 and tiles_mod.gpu_tile(8, 64, 4).queries == 4
    for G in range(1, 17):
        t = tiles_mod.tpu_tile(G)
        assert t.rows == t.queries * G and t.rows % 16 == 0 and t.rows <= max(128, 16 * G) and t.queries % 8 in (0, 1, 2, 4)
