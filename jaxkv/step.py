"""One engine step: a flat batch of tokens through the model and one ragged paged
attention. The only two jit'd forwards of the engine live here.

* ``run_step``: up to a token budget of tokens from any rows (prefill chunks of
  several rows and the next token of every decoding row) in one forward. The
  flat batch is padded to a token bucket (``jaxkv.buckets.step_tokens``); every
  per-row quantity is data in a ``StepBatch``, so one program serves every mix of
  rows, chunk lengths and live lengths that fits its bucket.
* ``run_decode``: the decode fast path, a ``lax.while_loop`` of the same forward
  with one token per row, sampling on the device (``sampling.sample_batch``, every
  row its own sampler) and feeding each sample back. It exists because a decode
  token costs milliseconds on a CPU and a host round trip per token would add
  a fixed share to each; it compiles once per row bucket (and, on the CPU, per
  window width).

Each layer writes the step's K/V into the pool at the slots the host chose, then
attends (``attend_layer``): write first, so a chunk reads its own keys exactly
as later steps will (rounded to the pool dtype), and XLA updates the donated pool
in place. The pool is one object behind one interface (``jaxkv.cache.pools``):
``layers`` (static) writes a layer and makes its key-block reader, so a quantized
pool's step is this step.

Shape letters: T flat tokens, R step rows, Y returned logits, X captured query
rows, L layers, Hq query heads, D head dim, V vocab, W window entries.

Invariants: a padding token writes to the sentinel slot and no row owns it; a
padding row (index >= the cache's rows) has no tokens, reads row ``R - 1``'s tables
and its table writes are dropped; outputs the host reads are replicated on a mesh.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.attention import ragged_attention_reference
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.cache.state import append_tokens, put_rows, take_rows
from jaxkv.cache.window import DecodeWindow
from jaxkv.errors import JaxKVError
from jaxkv.models import sharding
from jaxkv.pallas.ragged_attention import KEY_BLOCK, decode_rows_attention, ragged_attention_blocked
from jaxkv.sampling import RowSamplers, sample_batch


@dataclasses.dataclass(frozen=True)
class Features:
    """What a job asks a step to bring back beside logits (hashable).

    Attributes:
      query_rows: post-RoPE queries of the job's tokens (retention policies'
        observation windows and spans).
      attn_mass: attention mass each position receives (H2O), mean over layers
        and query heads, summed over the job's queries.
    """

    query_rows: bool = False
    attn_mass: bool = False


NO_FEATURES = Features()


@struct.dataclass
class StepBatch:
    """One step's flat batch of ``T`` tokens from up to ``R`` rows.

    Attributes:
      tokens_T, positions_T: token ids and their positions (padding: 0).
      slots_T: the pool slots their K/V are written to (padding: the sentinel).
      rows_R: the cache row of each step row (padding: an index >= the cache's rows).
      q_start_R, q_len_R: step row ``r`` owns flat tokens ``[q_start, q_start + q_len)``;
        its last token's logits come back, and a token is drawn from them.
      key_data_R / step_R: the row's key and the index folded into it for the
        draw (``fold_in(key, step)``). samplers: each row's sampler.
    """

    tokens_T: jax.Array
    positions_T: jax.Array
    slots_T: jax.Array
    rows_R: jax.Array
    q_start_R: jax.Array
    q_len_R: jax.Array
    key_data_R: jax.Array
    step_R: jax.Array
    samplers: RowSamplers


@struct.dataclass
class DecodeBatch:
    """One ``run_decode`` call for ``R`` rows (padding rows: limit 0).

    Attributes:
      rows_R: cache rows. first_token_R: the token fed at step 0. limit_R: steps
        the row may take. slots_RN: the pool slot of each step's token. stop_RX:
        stop tokens per row (padded with -1). key_data_R / step0_R: the row's key and
        the reply index of step 0 (step s samples with ``fold_in(key, step0 + s)``).
      samplers: each row's sampler (``RowSamplers``). forced_RN: teacher-forced tokens.
    """

    rows_R: jax.Array
    first_token_R: jax.Array
    limit_R: jax.Array
    slots_RN: jax.Array
    stop_RX: jax.Array
    key_data_R: jax.Array
    step0_R: jax.Array
    samplers: RowSamplers
    forced_RN: jax.Array


def row_slots(slots_T, q_start_R, q_len_R, width: int):
    """``[R, width]``: each row's new slots in order (from the flat ``slots_T``),
    the sentinel past its ``q_len``."""
    t = jnp.arange(width, dtype=jnp.int32)[None, :]
    idx = jnp.clip(q_start_R[:, None] + t, 0, slots_T.shape[0] - 1)
    return jnp.where(t < q_len_R[:, None], slots_T[idx], SENTINEL_SLOT)


def attend_layer(layers, kv, i, q_THD, lists, kv_len_R, q_start_R, q_len_R, k_TKD=None, v_TKD=None, parts=None, *, backend, batched_decode=False, mass=False):
    """Layer ``i``'s ragged attention over the pool ``kv`` (its K/V already written).

    ``backend`` is ``jaxkv.pallas.ragged_attention.ragged_backend``'s answer: a
    kernel runs where the pool has one (``layers.kernel_pool``), the CPU's blocked
    implementation reads through ``layers.reader``. ``batched_decode``: every row
    is a one-token decode row (``run_decode``), read all at once. ``mass``: also
    return ``[R, N]`` the probability each list entry received, summed over the
    step's queries and query heads (the blocked implementation's second pass,
    whatever the backend). ``k_TKD`` / ``v_TKD``: the step's own keys and values
    as computed (a quantized pool attends to them so, ``StepTokens``). ``parts``: a
    quantized pool's decode plan (``jaxkv.cache.quantized.DecodeParts``): its
    decode rows read their entries by kind instead of through the live list.
    """
    if parts is not None:
        return layers.decode_rows(kv, i, q_THD, parts, kv_len_R, q_len_R > 0).astype(q_THD.dtype)
    if backend == "reference" and not mass:
        k, v = layers.read_pool(kv, i)
        return ragged_attention_reference(q_THD, k, v, lists, kv_len_R, q_start_R, q_len_R)
    pool = layers.kernel_pool(kv, i) if backend in ("gpu", "tpu", "interpret") and not mass else None
    if pool is not None:
        from jaxkv.pallas.ragged_attention import ragged_attention

        return ragged_attention(q_THD, *pool, lists, kv_len_R, q_start_R, q_len_R, backend=backend)
    from jaxkv.cache.quantized import StepTokens

    fresh = None if k_TKD is None else StepTokens(k_TKD, v_TKD, kv_len_R, q_len_R, q_start_R)
    reader = layers.reader(kv, i, lists, fresh)
    if batched_decode:  # one token per row, rows in order: the decode section alone
        return decode_rows_attention(reader, q_THD, kv_len_R, q_len_R > 0).astype(q_THD.dtype)
    return ragged_attention_blocked(q_THD, reader, kv_len_R, q_start_R, q_len_R, return_mass=mass, width=reader.live_RN.shape[1])


def _forward(model, layers, kv, tables, tokens_T, positions_T, slots_T, q_start_R, q_len_R, page_plan, *, backend, mesh, batched_decode=False, window=None, unstacked=None, capture_q=False, mass=False):
    """The model over a flat batch: per layer, write then attend. Returns
    ``(hidden [T, M], kv, q_rows [L, T, Hq, D] or None, window, mass [J, R, N] or
    None)``: the mass of each live list's entries, summed over the layers that read
    the list and over query heads. The pool, the window and the mass are the layer
    scan's carry (``Transformer.run_layers``); with ``unstacked``
    (``Transformer.unstacked_layers``, the CPU decode loop's) the layers run
    unrolled over those copies instead."""
    R = q_len_R.shape[0]
    J = tables.live_idx.shape[0]
    mass0 = jnp.zeros((J, R, tables.live_idx.shape[-1] + (-tables.live_idx.shape[-1]) % KEY_BLOCK), jnp.float32) if mass else None

    def attend(i, q, k, v, carry):
        kv, window, mass_RN = carry
        q_THD, k_TKD, v_TKD = q[0], k[0], v[0]
        kv = layers.write(kv, i, k_TKD, v_TKD, slots_T, page_plan)
        lists, kv_len = tables.layer_list(i)
        out = q_THD.astype(jnp.float32) if capture_q else None
        if window is not None:  # CPU decode loop: the rows' copy (any pool's window), new entry at kv_len - 1
            window = window.append(i, k_TKD, v_TKD, kv_len, q_len_R > 0)
            o = window.attend(i, q_THD, kv_len, q_len_R > 0)
            return o.astype(q_THD.dtype)[None], (kv, window, mass_RN), out
        run = functools.partial(attend_layer, layers, backend=backend, batched_decode=batched_decode, mass=mass)
        parts = page_plan if batched_decode and page_plan is not None else None  # a quantized pool's decode plan
        if mesh is None:
            o = run(kv, i, q_THD, lists, kv_len, q_start_R, q_len_R, k_TKD, v_TKD, parts)
        elif mass:
            raise JaxKVError("attention mass is not computed on a mesh")
        else:
            o = sharding.shard_heads(lambda kv_, q_, k_, v_, *rest: run(kv_, i, q_, *rest, k_, v_, parts), mesh, kv)(
                kv, q_THD, k_TKD, v_TKD, lists, kv_len, q_start_R, q_len_R
            )
        if mass:  # each layer's mass goes to the list it read (entries of different lists are different positions)
            o, m = o
            mass_RN = mass_RN.at[jnp.minimum(i, J - 1)].add(m) if J > 1 else mass_RN + m[None]
        return o[None], (kv, window, mass_RN), out

    x0, carry = model.embed_tokens(tokens_T[None]), (kv, window, mass0)
    if unstacked is not None:  # the CPU decode loop (``run_decode``): layers unrolled over copies taken once per call
        x, (kv, window, mass_RN), q_rows = model.run_layers_unrolled(x0, positions_T[None], attend, carry, unstacked)
    else:
        x, (kv, window, mass_RN), q_rows = model.run_layers(x0, positions_T[None], attend, carry)
    return x[0], kv, q_rows, window, mass_RN


@functools.partial(jax.jit, static_argnames=("graphdef", "layers", "backend", "mesh", "capture_q", "all_logits", "attn_mass"), donate_argnames=("cache",))
def run_step(graphdef, params, cache, batch: StepBatch, page_plan=None, *, layers, backend, mesh=None, capture_q=False, all_logits=False, attn_mass=False):
    """One step (module docstring). ``page_plan`` is the pool's per-step write plan
    (a quantized pool's INT2 pages; None for the float pool).

    Returns ``(tokens [R], logits [R, V] float32, cache, aux)``: each step row's
    next token (drawn from its last token's logits with its own sampler and key)
    and those logits; ``aux["q_rows"]`` ``[L, T, Hq, D]`` with ``capture_q``,
    ``aux["all_logits"]`` ``[T, V]`` with ``all_logits``, ``aux["mass"]`` ``[J, R, N]``
    with ``attn_mass`` (per entry of each live list of each row after the step,
    summed over the list's layers, query heads and the row's queries, divided by
    L x Hq: summed over lists and mapped to positions, the mean over layers and heads).
    """
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    tables = take_rows(cache, batch.rows_R)
    T = batch.tokens_T.shape[0]
    tables = append_tokens(tables, row_slots(batch.slots_T, batch.q_start_R, batch.q_len_R, T), batch.q_len_R)
    x, kv, q_rows, _, mass = _forward(
        model, layers, cache.kv, tables, batch.tokens_T, batch.positions_T, batch.slots_T, batch.q_start_R, batch.q_len_R,
        page_plan, backend=backend, mesh=mesh, capture_q=capture_q, mass=attn_mass,
    )
    last_R = jnp.clip(batch.q_start_R + batch.q_len_R - 1, 0, T - 1)
    logits = model.logits(x[last_R])
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(batch.key_data_R), batch.step_R)
    tokens = sample_batch(logits, keys, batch.samplers)
    aux = {}
    if capture_q:
        aux["q_rows"] = q_rows.astype(jnp.float32)
    if all_logits:
        aux["all_logits"] = model.logits(x)
    if attn_mass:
        aux["mass"] = mass / (cfg.num_layers * cfg.num_heads)
    cache = put_rows(cache.with_kv(kv), batch.rows_R, tables)
    if mesh is not None:
        (tokens, logits, aux), cache = sharding.replicate((tokens, logits, aux), mesh), constrain_cache(cache, mesh)
    return tokens, logits, cache, aux


@functools.partial(jax.jit, static_argnames=("graphdef",))
def layer_copies(graphdef, params) -> tuple:
    """Every layer's weights as arrays of their own (``Transformer.unstacked_layers``
    split to states): ``run_decode``'s ``layer_params``. Taken once and kept by the
    engine, it costs a second copy of the layer weights in memory and saves one
    copy of them per decode call (a call of a few one-token steps on the CPU spends
    about as long copying as computing)."""
    model = nnx.merge(graphdef, params)
    return tuple(nnx.split(layer)[1] for layer in model.unstacked_layers())


def cache_sharding(cache, mesh):
    """Where each array of ``cache`` lives on ``mesh`` (a pytree of ``NamedSharding``):
    every pool array split by KV head (its axis 2 in every pool's layout,
    ``sharding.POOL_SPEC``), the tables replicated."""
    pool = NamedSharding(mesh, sharding.POOL_SPEC)
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), cache)
    return replicated.with_kv(jax.tree.map(lambda _: pool, cache.kv))


def constrain_cache(cache, mesh):
    """Inside jit: keep ``cache`` in ``cache_sharding`` (a donated pool comes back
    where it was, so its buffers are reused)."""
    return jax.lax.with_sharding_constraint(cache, cache_sharding(cache, mesh))


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "layers", "n_steps", "backend", "return_logits", "teacher_forced", "mesh", "regroup"),
    donate_argnames=("cache", "window"),
)
def run_decode(graphdef, params, cache, batch: DecodeBatch, page_plan=None, window=None, layer_params=None, window_len_LR=None, *, layers, n_steps, backend, return_logits=False, teacher_forced=False, mesh=None, regroup=False):
    """Decode up to ``n_steps`` tokens for each row of ``batch`` (module docstring).

    Step ``s`` feeds each active row its last token (writing its K/V at
    ``slots_RN[:, s]``) and samples the next with key ``fold_in(key_r, step0_r +
    s)`` and the row's own sampler, so a row's tokens do not depend on which other
    rows share the batch. A row stops after emitting a token of its ``stop_RX``
    (padded with -1) or after ``limit_R`` steps. With ``teacher_forced`` the fed
    token of step ``s > 0`` is ``forced_RN[:, s - 1]``. With ``regroup`` the call
    also ends once half of its rows or more have stopped (after one step), so the
    rest continue with fewer rows. ``window`` (the pool's ``gather_window``, CPU
    only: ``DecodeWindow``, or a quantized pool's ``jaxkv.cache.quantized.QuantWindow``):
    the rows' entries are read from that copy, no gather per step; it is donated,
    and comes back holding the call's new entries. ``window_len_LR`` (with a
    float pool's ``jaxkv.cache.window.DecodeWindow``): the entries of each layer's
    list per row now, which ``DecodeWindow.roll`` brings the window to first (the
    last call's window, kept by the engine, or a fresh one). ``layer_params``
    (``layer_copies``, with a window only): the layers' weights as one array set
    per layer, kept by the caller between calls; without it the call slices its
    own copies of the stacked weights.

    Returns ``(tokens [R, n], fed [R], cache, logits [R, n, V] or None, q_rows
    [n, L, R, Hq, D], window)``: ``q_rows`` the post-RoPE query of every fed token;
    ``window`` the given window after the call (None without one), what
    ``jaxkv.cache.window.roll_window`` turns into the next call's.
    """
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b = batch
    R = b.first_token_R.shape[0]
    logits_buf = jnp.zeros((R, n_steps if return_logits else 0, cfg.vocab_size), jnp.float32)
    q_buf = jnp.zeros((n_steps, cfg.num_layers, R, cfg.num_heads, cfg.head_dim), jnp.float32)
    keys_R = jax.random.wrap_key_data(b.key_data_R)
    started = (b.limit_R > 0).sum()
    # With a window (the CPU loop) the layers run unrolled over per-layer copies of
    # the weights: a scan would copy each layer's slice in every step
    # (``Transformer.unstacked_layers``). The caller's copies (``layer_params``)
    # spare even the one copy per call.
    if window is not None and window_len_LR is not None:
        window = window.roll(window_len_LR)
    unstacked = None
    if window is not None and layer_params is not None:
        layer_graphdef = nnx.split(model.layer(0))[0]
        unstacked = [nnx.merge(layer_graphdef, state) for state in layer_params]
    elif window is not None:
        unstacked = model.unstacked_layers()
    arange_R = jnp.arange(R, dtype=jnp.int32)

    def cond(carry):
        step, active = carry[0], carry[4]
        go_on = (step < n_steps) & active.any()
        if regroup:
            go_on = go_on & ((step == 0) | (2 * active.sum() > started))
        return go_on

    def body(carry):
        step, kv, tables, tokens, active, last, logits_buf, q_buf, window = carry
        slot = jnp.where(active, b.slots_RN[:, step], SENTINEL_SLOT)
        pos = tables.seq_len
        q_len = active.astype(jnp.int32)
        tables = append_tokens(tables, slot[:, None], q_len)
        x, kv, q_rows, window, _ = _forward(
            model, layers, kv, tables, last, pos, slot, arange_R, q_len, page_plan,
            backend=backend, mesh=mesh, batched_decode=True, window=window, unstacked=unstacked, capture_q=True,
        )
        logits = model.logits(x)
        q_buf = q_buf.at[step].set(q_rows.astype(jnp.float32))
        step_keys = jax.vmap(jax.random.fold_in)(keys_R, b.step0_R + step)
        nxt = jnp.where(active, sample_batch(logits, step_keys, b.samplers), -1)
        tokens = tokens.at[:, step].set(nxt)
        if return_logits:
            logits_buf = logits_buf.at[:, step].set(logits)
        stopped = (nxt[:, None] == b.stop_RX).any(-1)
        new_active = active & ~stopped & (step + 1 < b.limit_R)
        feed = b.forced_RN[:, step] if teacher_forced else nxt
        feed = jnp.where(new_active, feed, 0)
        return step + 1, kv, tables, tokens, new_active, feed, logits_buf, q_buf, window

    tables0 = take_rows(cache, b.rows_R)
    carry = (jnp.int32(0), cache.kv, tables0, jnp.full((R, n_steps), -1, jnp.int32), b.limit_R > 0, b.first_token_R, logits_buf, q_buf, window)
    _, kv, tables, tokens, _, _, logits_buf, q_buf, window = jax.lax.while_loop(cond, body, carry)
    fed = tables.seq_len - tables0.seq_len
    cache = put_rows(cache.with_kv(kv), b.rows_R, tables)
    out = (tokens, fed, logits_buf if return_logits else None, q_buf)
    if mesh is not None:
        out, cache = sharding.replicate(out, mesh), constrain_cache(cache, mesh)
    tokens, fed, logits_buf, q_buf = out
    return tokens, fed, cache, logits_buf, q_buf, window
