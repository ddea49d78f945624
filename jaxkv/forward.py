"""The engine's one forward, and the two programs made of it.

``forward`` runs the model over a flat batch of tokens: per layer it writes the
layer's new K/V into the pool and attends through the engine's attention backend
(``jaxkv.backends``: one entry, one backend per pool kind and platform). Two
jit'd programs call it, as jax-llm-examples' ``prefill`` and ``decode_step`` are
two shapes of one forward:

* ``run_step``: one scheduled step, up to a token budget of tokens from any rows
  (prefill pieces of several rows and the next token of every decoding row). The
  flat batch is padded to a token bucket (``jaxkv.buckets.step_tokens``); every
  per-row quantity is data in a ``StepBatch``, so one program serves every mix of
  rows, piece lengths and live lengths that fits its bucket.
* ``run_decode``: the multi-step decode loop, a ``lax.while_loop`` over the same
  forward and the same sampler, one token per row, advancing the same attention
  metadata on the device. It exists because a decode token costs milliseconds on
  a CPU and a host round trip per token would add a fixed share to each.

Both sample one token per row on the device (``sampling.sample_batch``, every row
its own sampler and key) and return it; anything else comes back only when the
step asks for it (``Outputs``, static): logits of each row's last token or of
every token, the post-RoPE queries of the flat tokens listed in the batch
(gathered on the device), attention mass. A prefill's last piece samples the
reply's first token in the step that computes its logits.

Write first, then attend: a piece reads its own keys exactly as later steps will
(rounded to the pool dtype), and XLA updates the donated pool in place. A rotated
quantized pool's frame is entered before the write and left after the attention
(``AttentionBackend.rotate_in`` / ``rotate_out``), outside any mesh's per-head
split, so returned queries stay in the model's frame.

Shape letters: T flat tokens, R step rows, X captured query rows, L layers, Hq
query heads, D head dim, V vocab, J live lists per row, N list entries.

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

from jaxkv.backends.base import AttentionMetadata
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.cache.state import append_tokens, put_rows, take_rows
from jaxkv.errors import JaxKVError
from jaxkv.models import sharding
from jaxkv.kernels.attention.ragged import KEY_BLOCK
from jaxkv.sampling import RowSamplers, sample_batch


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What a program brings back beside each row's sampled token (hashable: a
    static argument, so each combination is its own program).

    Attributes:
      logits: ``None``, ``"last"`` (each step row's last token: ``[R, V]``; in the
        decode loop every step's ``[R, n, V]``) or ``"all"`` (every flat token of a
        step, ``[T, V]``: scoring a prompt).
      query_rows: the post-RoPE queries of the flat tokens the batch lists
        (``StepBatch.query_idx_X``; in the decode loop every fed token).
      attn_mass: attention mass per list entry (H2O).
    """

    logits: str | None = None
    query_rows: bool = False
    attn_mass: bool = False

    def __post_init__(self):
        if self.logits not in (None, "last", "all"):
            raise JaxKVError(f"Outputs.logits must be None, 'last' or 'all', got {self.logits!r}")


TOKENS_ONLY = Outputs()


@struct.dataclass
class StepBatch:
    """One step's flat batch of ``T`` tokens from up to ``R`` rows.

    Attributes:
      tokens_T, positions_T: token ids and their positions (padding: 0).
      slots_T: the pool slots their K/V are written to (padding: the sentinel).
      rows_R: the cache row of each step row (padding: an index >= the cache's rows).
      q_start_R, q_len_R: step row ``r`` owns flat tokens ``[q_start, q_start + q_len)``;
        a token is drawn from its last token's logits.
      key_data_R / step_R: the row's key and the index folded into it for the
        draw (``fold_in(key, step)``). samplers: each row's sampler.
      query_idx_X: flat tokens whose queries come back (``Outputs.query_rows``;
        padded with 0, read and ignored).
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
    query_idx_X: jax.Array


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


def forward(
    model,
    backend,
    kv,
    tokens_T,
    positions_T,
    meta: AttentionMetadata,
    *,
    mesh=None,
    loop_state=None,
    layers=None,
    query_idx_X=None,
    mass=False,
):
    """The model over a flat batch: per layer, write then attend (module docstring).

    ``meta``: the step's attention metadata (its tables already hold the step's
    tokens). ``loop_state``: the backend's decode-loop state (a window), carried
    through the layers and returned. ``layers``: per-layer modules
    (``Transformer.unstacked_layers``) to run the layers unrolled over (the CPU
    decode loop's); else the layer scan. ``query_idx_X``: flat tokens whose queries
    to return. ``mass``: also return attention mass.

    Returns ``(hidden [T, M], kv, q_rows [L, X, Hq, D] float32 or None, loop_state,
    mass [J, R, N] or None)``: the mass of each live list's entries, summed over the
    layers that read the list and over query heads.
    """
    R = meta.q_len_R.shape[0]
    live = meta.tables.live_idx
    J = live.shape[0]
    mass0 = jnp.zeros((J, R, live.shape[-1] + (-live.shape[-1]) % KEY_BLOCK), jnp.float32) if mass else None

    def attend(i, q, k, v, carry):
        kv, loop_state, mass_RN = carry
        q_THD, k_TKD, v_TKD = q[0], k[0], v[0]
        out = q_THD[query_idx_X].astype(jnp.float32) if query_idx_X is not None else None  # the model's frame
        q_THD, k_TKD, v_TKD = backend.rotate_in(i, q_THD, k_TKD, v_TKD)  # a rotated pool's frame (identity otherwise)
        kv = backend.write(kv, i, k_TKD, v_TKD, meta)
        if mass:
            if mesh is not None:
                raise JaxKVError("attention mass is not computed on a mesh")
            o, m = backend.attend_with_mass(kv, i, q_THD, k_TKD, v_TKD, meta)
            mass_RN = mass_RN.at[jnp.minimum(i, J - 1)].add(m) if J > 1 else mass_RN + m[None]
        elif mesh is None:
            o, loop_state = backend.attend(kv, i, q_THD, k_TKD, v_TKD, meta, loop_state)
        else:
            o = sharding.shard_heads(lambda kv_, q_, k_, v_, meta_: backend.attend(kv_, i, q_, k_, v_, meta_)[0], mesh, kv)(
                kv, q_THD, k_TKD, v_TKD, meta
            )
        return backend.rotate_out(i, o, k_TKD.shape[-2])[None], (kv, loop_state, mass_RN), out

    x0, carry = model.embed_tokens(tokens_T[None]), (kv, loop_state, mass0)
    if layers is not None:
        x, (kv, loop_state, mass_RN), q_rows = model.run_layers_unrolled(x0, positions_T[None], attend, carry, layers)
    else:
        x, (kv, loop_state, mass_RN), q_rows = model.run_layers(x0, positions_T[None], attend, carry)
    return x[0], kv, q_rows, loop_state, mass_RN


@functools.partial(jax.jit, static_argnames=("graphdef", "backend", "mesh", "outputs"), donate_argnames=("cache",))
def run_step(graphdef, params, cache, batch: StepBatch, write_plan=None, *, backend, mesh=None, outputs: Outputs = TOKENS_ONLY):
    """One scheduled step (module docstring). ``write_plan`` is the pool's write
    plan of the step (a quantized pool's INT2 pages; None for the float pool).

    Returns ``(tokens [R], cache, aux)``: each step row's next token, drawn from its
    last token's logits with its own sampler and key, and what ``outputs`` asked
    for: ``aux["logits"]`` ``[R, V]`` (``"last"``) or ``[T, V]`` (``"all"``) float32;
    ``aux["q_rows"]`` ``[L, X, Hq, D]`` at ``batch.query_idx_X``; ``aux["mass"]``
    ``[J, R, N]`` (per entry of each live list of each row after the step, summed
    over the list's layers, query heads and the row's queries, divided by L x Hq:
    summed over lists and mapped to positions, the mean over layers and heads).
    """
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    tables = take_rows(cache, batch.rows_R)
    T = batch.tokens_T.shape[0]
    tables = append_tokens(tables, row_slots(batch.slots_T, batch.q_start_R, batch.q_len_R, T), batch.q_len_R)
    meta = AttentionMetadata(tables, batch.slots_T, batch.q_start_R, batch.q_len_R, write_plan)
    x, kv, q_rows, _, mass = forward(
        model,
        backend,
        cache.kv,
        batch.tokens_T,
        batch.positions_T,
        meta,
        mesh=mesh,
        query_idx_X=batch.query_idx_X if outputs.query_rows else None,
        mass=outputs.attn_mass,
    )
    last_R = jnp.clip(batch.q_start_R + batch.q_len_R - 1, 0, T - 1)
    logits = model.logits(x[last_R])
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(batch.key_data_R), batch.step_R)
    tokens = sample_batch(logits, keys, batch.samplers)
    aux = {}
    if outputs.logits == "last":
        aux["logits"] = logits
    elif outputs.logits == "all":
        aux["logits"] = model.logits(x)
    if outputs.query_rows:
        aux["q_rows"] = q_rows
    if outputs.attn_mass:
        aux["mass"] = mass / (cfg.num_layers * cfg.num_heads)
    cache = put_rows(cache.with_kv(kv), batch.rows_R, tables)
    if mesh is not None:
        (tokens, aux), cache = sharding.replicate((tokens, aux), mesh), constrain_cache(cache, mesh)
    return tokens, cache, aux


@functools.partial(jax.jit, static_argnames=("graphdef",))
def layer_copies(graphdef, params) -> tuple:
    """Every layer's weights as arrays of their own (``Transformer.unstacked_layers``
    split to states): ``run_decode``'s ``layer_params``. Taken once and kept by the
    runner, it costs a second copy of the layer weights in memory and saves one
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
    static_argnames=("graphdef", "backend", "n_steps", "width", "outputs", "teacher_forced", "mesh", "regroup"),
    donate_argnames=("cache", "window"),
)
def run_decode(
    graphdef,
    params,
    cache,
    batch: DecodeBatch,
    read_plan=None,
    window=None,
    layer_params=None,
    window_len_LR=None,
    regather=None,
    *,
    backend,
    n_steps,
    width: int = 0,
    outputs: Outputs = TOKENS_ONLY,
    teacher_forced=False,
    mesh=None,
    regroup=False,
):
    """Decode up to ``n_steps`` tokens for each row of ``batch`` (module docstring).

    Step ``s`` feeds each active row its last token (writing its K/V at
    ``slots_RN[:, s]``) and samples the next with key ``fold_in(key_r, step0_r +
    s)`` and the row's own sampler, so a row's tokens do not depend on which other
    rows share the batch. A row stops after emitting a token of its ``stop_RX``
    (padded with -1) or after ``limit_R`` steps. With ``teacher_forced`` the fed
    token of step ``s > 0`` is ``forced_RN[:, s - 1]``. With ``regroup`` the call
    also ends once half of its rows or more have stopped (after one step), so the
    rest continue with fewer rows.

    ``read_plan``: the pool's reading plan of the call (a quantized pool's
    ``DecodeParts``). ``width`` (static, 0: none): the call reads the backend's
    decode window of this many entries per row (the CPU backends): the rows'
    entries are copied once at the start (``backend.take_window``), read from
    that copy by every step, and the layers run unrolled (over ``layer_params``,
    the runner's kept ``layer_copies``, or copies sliced here). ``window`` is the
    last call's window (or a buffer of its shape), which is rolled on to the lists' lengths now (``window_len_LR``,
    ``DecodeWindow.roll``) or, with ``regather``, replaced by a fresh copy; it is
    donated and comes back holding the call's new entries.

    Returns ``(tokens [R, n], fed [R], cache, aux, window)``: ``aux["logits"]``
    ``[R, n, V]`` with ``outputs.logits``, ``aux["q_rows"]`` ``[n, L, R, Hq, D]`` (the
    query of every fed token) with ``outputs.query_rows``; ``window`` the given
    window after the call (None without one).
    """
    if outputs.attn_mass or outputs.logits == "all":
        raise JaxKVError("the decode loop brings back each step's logits and queries, not attention mass")
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b = batch
    R = b.first_token_R.shape[0]
    logits_buf = jnp.zeros((R, n_steps, cfg.vocab_size), jnp.float32) if outputs.logits else None
    q_buf = jnp.zeros((n_steps, cfg.num_layers, R, cfg.num_heads, cfg.head_dim), jnp.float32) if outputs.query_rows else None
    keys_R = jax.random.wrap_key_data(b.key_data_R)
    started = (b.limit_R > 0).sum()
    if width:
        take = lambda _: backend.take_window(cache, b.rows_R, width=width, n_steps=n_steps)  # noqa: E731
        window = jax.lax.cond(regather, take, lambda w: w.roll(window_len_LR), window)
    layers = None
    if window is not None and layer_params is not None:
        layer_graphdef = nnx.split(model.layer(0))[0]
        layers = [nnx.merge(layer_graphdef, state) for state in layer_params]
    elif window is not None:
        layers = model.unstacked_layers()
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
        meta = AttentionMetadata(tables, slot, arange_R, q_len, None, read_plan, decode=True)
        x, kv, q_rows, window, _ = forward(
            model,
            backend,
            kv,
            last,
            pos,
            meta,
            mesh=mesh,
            loop_state=window,
            layers=layers,
            query_idx_X=arange_R if outputs.query_rows else None,
        )
        logits = model.logits(x)
        if outputs.query_rows:
            q_buf = q_buf.at[step].set(q_rows)
        step_keys = jax.vmap(jax.random.fold_in)(keys_R, b.step0_R + step)
        nxt = jnp.where(active, sample_batch(logits, step_keys, b.samplers), -1)
        tokens = tokens.at[:, step].set(nxt)
        if outputs.logits:
            logits_buf = logits_buf.at[:, step].set(logits)
        stopped = (nxt[:, None] == b.stop_RX).any(-1)
        new_active = active & ~stopped & (step + 1 < b.limit_R)
        feed = b.forced_RN[:, step] if teacher_forced else nxt
        feed = jnp.where(new_active, feed, 0)
        return step + 1, kv, tables, tokens, new_active, feed, logits_buf, q_buf, window

    tables0 = take_rows(cache, b.rows_R)
    carry = (
        jnp.int32(0),
        cache.kv,
        tables0,
        jnp.full((R, n_steps), -1, jnp.int32),
        b.limit_R > 0,
        b.first_token_R,
        logits_buf,
        q_buf,
        window,
    )
    _, kv, tables, tokens, _, _, logits_buf, q_buf, window = jax.lax.while_loop(cond, body, carry)
    fed = tables.seq_len - tables0.seq_len
    cache = put_rows(cache.with_kv(kv), b.rows_R, tables)
    aux = {}
    if outputs.logits:
        aux["logits"] = logits_buf
    if outputs.query_rows:
        aux["q_rows"] = q_buf
    out = (tokens, fed, aux)
    if mesh is not None:
        out, cache = sharding.replicate(out, mesh), constrain_cache(cache, mesh)
    tokens, fed, aux = out
    return tokens, fed, cache, aux, window
