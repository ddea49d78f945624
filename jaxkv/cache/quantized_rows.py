"""Moving rows of the dual quantized pool (``jaxkv.cache.quantized``) as a
whole: re-encoding rows at new slots (``rewrite_rows``: KIVI's aging, compaction,
``requantize``), and the packed host copies of rows and their bit-exact return
(``gather_packed`` / ``write_packed``: the host tier, RepairKV's promotion).

Invariant: a row gathered by ``gather_packed`` and written back by
``write_packed`` dequantizes to the same float32 values, whatever its kind (an
INT3 page's one-byte parameters travel in the float16 parameter fields,
``pack_params3``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv.cache.quantized import DualPool, QuantizedKVCache, Geometry, dequantize_at, dequantize_slots, page3_fit, page_rows, write_tokens
from jaxkv.kernels.quant import GROUP, PAGE, Int2Pool, Int4Pool, PackedKeyPages, PackedRows
from jaxkv.kernels.quant3 import value_group
from jaxkv.rope import apply_rope


# ============================================================================ moving rows
@functools.partial(jax.jit, static_argnames=("rope", "rotation"), donate_argnames=("cache",))
def rewrite_rows(cache: QuantizedKVCache, src_M, dst_M, delta_M, page_src_QG, page_ids_Q, *, rope=None, rotation=None):
    """Re-encode rows: dequantize the rows at ``src_M`` (every layer), rotate their
    keys by ``delta_M`` positions when ``rope`` is given (a compact layout), and
    write them at ``dst_M`` with the page plan (``write_tokens``). Used to settle
    KIVI's aged residual into INT2 pages and to compact a quantized request. A
    rotated pool's keys leave the stored frame for the RoPE delta (``rotation``,
    ``QuantLayers.rotation``: RoPE's pairs are the model's channels) and return to it;
    its INT3 pages are fitted as its writes fit them (``page3_fit``).

    One layer's body in a loop over layers (``fori_loop``), not the layers unrolled:
    the unrolled program of a 30-layer model took 3.5 minutes to compile per row
    bucket on the shared 2-core CPU (a triaxial session that rewrites its history,
    ``Allocation.rewrite_history``, meets several buckets)."""
    geo = cache.geometry

    def layer(i, pool):
        k, v = dequantize_at(pool, geo, i, src_M)  # read in place (``write_tokens``' note)
        if rope is not None:
            k = k if rotation is None else rotation.unrotate(i, k)
            k = apply_rope(k, delta_M, rope)
            k = k if rotation is None else rotation.rotate(i, k)
        return write_tokens(pool, geo, i, k, v, dst_M, page_src_QG, page_ids_Q, page3_fit(rotation))

    return cache.with_kv(jax.lax.fori_loop(0, cache.pool.flt_k.shape[0], layer, cache.pool))


def pack_params3(scale_code, zero_point, width: int):
    """INT3 page parameters (uint8 scale codes, int8 zero points ``[..., n]``) in
    the host tier's float16 fields: two bytes to a float16 container (low byte the
    code, high byte the zero point), ``width`` entries (zeros after the ``n``)."""
    u = scale_code.astype(jnp.uint16) | (jax.lax.bitcast_convert_type(zero_point, jnp.uint8).astype(jnp.uint16) << 8)
    u = jnp.concatenate([u, jnp.zeros((*u.shape[:-1], width - u.shape[-1]), jnp.uint16)], axis=-1)
    return jax.lax.bitcast_convert_type(u, jnp.float16)


def unpack_params3(container, n: int):
    """Inverse of ``pack_params3``: ``(scale codes uint8, zero points int8) [..., n]``."""
    u = jax.lax.bitcast_convert_type(container, jnp.uint16)[..., :n]
    return (u & 0xFF).astype(jnp.uint8), jax.lax.bitcast_convert_type((u >> 8).astype(jnp.uint8), jnp.int8)


def _select16(own, a, b):
    """``where(own, a, b)`` of float16 arrays on their bits (containers are no numbers)."""
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
    return jax.lax.bitcast_convert_type(jnp.where(own, bits(a), bits(b)), jnp.float16)


def _gather_layer(pool: DualPool, geo: Geometry, slots_M):
    """Packed fields of one layer at ``slots_M`` (every format; the host keeps the
    one each slot's kind names). Page rows are ``page_rows``': 3-bit rows (low
    plane, high plane) when the pool has INT3 pages, whose one-byte parameters
    travel in the float16 parameter fields (``pack_params3``; the zero fields
    zero)."""
    i4 = jnp.clip(slots_M - geo.off4, 0, geo.int4_slots - 1)
    page, t = jnp.clip(slots_M // PAGE, 0, geo.pages - 1), slots_M % PAGE
    f = jnp.clip(slots_M - geo.off_float, 0, max(geo.float_slots - 1, 0))
    k2, v2 = pool.int2.k, pool.int2.v
    out = {
        "k4_data": pool.int4.k.data[i4],
        "k4_scale": pool.int4.k.scale[i4],
        "k4_zero": pool.int4.k.zero[i4],
        "v4_data": pool.int4.v.data[i4],
        "v4_scale": pool.int4.v.scale[i4],
        "v4_zero": pool.int4.v.zero[i4],
        "k2_data": page_rows(pool, geo, 0, lambda a, p=page: a[p, :, t], page)[0],
        "k2_scale": k2.scale[page],
        "k2_zero": k2.zero[page],
        "v2_data": page_rows(pool, geo, 1, lambda a, p=page: a[p, :, t], page)[0],
        "v2_scale": v2.scale[page, :, t],
        "v2_zero": v2.zero[page, :, t],
    }
    if geo.pages3:
        j = jnp.clip(page - geo.first3, 0, geo.pages3 - 1)
        own = (page >= geo.first3)[:, None, None]
        D = k2.scale.shape[-1]
        ks, kz, vs, vz = pool.p3
        out["k2_scale"] = _select16(own, pack_params3(ks[j], kz[j], D), out["k2_scale"])
        out["v2_scale"] = _select16(own, pack_params3(vs[j, :, t], vz[j, :, t], D // GROUP), out["v2_scale"])
        out["k2_zero"] = jnp.where(own, jnp.float16(0), out["k2_zero"])
        out["v2_zero"] = jnp.where(own, jnp.float16(0), out["v2_zero"])
    if geo.float_slots:
        out["f_k"], out["f_v"] = pool.flt_k[f], pool.flt_v[f]
    return out


def _model_frame(rotation, x_LMKD):
    """Stored-frame rows of every layer ``[L, M, K, D]`` back to the model's frame."""
    if rotation is None:
        return x_LMKD
    return rotation.unrotate(jnp.arange(x_LMKD.shape[0])[:, None], x_LMKD)


@functools.partial(jax.jit, static_argnames=("rotation",))
def gather_keys(cache: QuantizedKVCache, slots_N, rotation=None):
    """Dequantized keys of every layer at ``slots_N``: ``[L, N, K, D]`` float32, in
    the model's frame (a rotated pool's ``rotation`` undone)."""
    k = jax.vmap(lambda layer: dequantize_slots(layer, cache.geometry, slots_N)[0])(cache.pool)
    return _model_frame(rotation, k)


@functools.partial(jax.jit, static_argnames=("rotation",))
def gather_dequantized(cache: QuantizedKVCache, slots_M, rotation=None):
    """Dequantized keys and values of every layer at ``slots_M``: two ``[L, M, K, D]``
    float32, in the model's frame."""
    k, v = jax.vmap(lambda layer: dequantize_slots(layer, cache.geometry, slots_M))(cache.pool)
    return _model_frame(rotation, k), _model_frame(rotation, v)


@jax.jit
def gather_packed(cache: QuantizedKVCache, slots_M):
    """Packed fields of every layer at ``slots_M``: a dict of ``[L, M, K, ...]``."""
    return jax.vmap(lambda layer: _gather_layer(layer, cache.geometry, slots_M))(cache.pool)


@functools.partial(jax.jit, donate_argnames=("cache",))
def write_packed(cache: QuantizedKVCache, rows: dict):
    """Write packed rows back bit for bit (RepairKV promotion). ``rows`` holds
    ``[L, M, ...]`` fields: ``i4`` / ``k4_*`` / ``v4_*`` (INT4 rows), ``f`` /
    ``f_k`` / ``f_v`` (float rows), ``page`` / ``k2_scale`` / ``k2_zero`` (pages'
    per-channel key parameters) and ``p2`` / ``t2`` / ``k2_data`` / ``v2_*`` (INT2
    tokens: page and token index; with INT3 pages, 3-bit rows whose high plane goes
    to ``hi``, an INT2 page's dropped). Out-of-range indices (padding) are dropped."""
    geo = cache.geometry

    def one(layer: DualPool, r):
        at = lambda a, idx, b: a.at[idx].set(b, mode="drop")
        int4 = Int4Pool(
            PackedRows(
                at(layer.int4.k.data, r["i4"], r["k4_data"]),
                at(layer.int4.k.scale, r["i4"], r["k4_scale"]),
                at(layer.int4.k.zero, r["i4"], r["k4_zero"]),
                4,
            ),
            PackedRows(
                at(layer.int4.v.data, r["i4"], r["v4_data"]),
                at(layer.int4.v.scale, r["i4"], r["v4_scale"]),
                at(layer.int4.v.zero, r["i4"], r["v4_zero"]),
                4,
            ),
        )
        k2, v2 = layer.int2.k, layer.int2.v
        pt = (r["p2"], slice(None), r["t2"])
        k2_data, v2_data = r["k2_data"], r["v2_data"]
        if geo.pages3:  # 3-bit rows: the low plane to the page arrays, the high plane and parameters of INT3 pages to ``hi``, ``p3``
            low = k2.data.shape[-1]
            j = jnp.where(r["p2"] >= geo.first3, r["p2"] - geo.first3, geo.pages3)
            hj = (j, slice(None), r["t2"])
            jp = jnp.where(r["page"] >= geo.first3, r["page"] - geo.first3, geo.pages3)
            D = k2.scale.shape[-1]
            ks, kz = unpack_params3(r["k2_scale"], D)
            vs, vz = unpack_params3(r["v2_scale"], D // value_group(D))
            p3 = layer.p3
            layer = layer.replace(
                hi=(layer.hi[0].at[hj].set(k2_data[..., low:], mode="drop"), layer.hi[1].at[hj].set(v2_data[..., low:], mode="drop")),
                p3=(at(p3[0], jp, ks), at(p3[1], jp, kz), p3[2].at[hj].set(vs, mode="drop"), p3[3].at[hj].set(vz, mode="drop")),
            )
            k2_data, v2_data = k2_data[..., :low], v2_data[..., :low]
        int2 = Int2Pool(
            PackedKeyPages(
                k2.data.at[pt].set(k2_data, mode="drop"),
                at(k2.scale, r["page"], r["k2_scale"]),
                at(k2.zero, r["page"], r["k2_zero"]),
                k2.bits,
            ),
            PackedRows(
                v2.data.at[pt].set(v2_data, mode="drop"),
                v2.scale.at[pt].set(r["v2_scale"], mode="drop"),
                v2.zero.at[pt].set(r["v2_zero"], mode="drop"),
                v2.bits,
            ),
        )
        layer = layer.replace(int2=int2, int4=int4)
        if geo.float_slots:
            layer = layer.replace(flt_k=at(layer.flt_k, r["f"], r["f_k"]), flt_v=at(layer.flt_v, r["f"], r["f_v"]))
        return layer

    index_keys = ("i4", "f", "page", "p2", "t2")
    shared = {k: rows[k] for k in index_keys}
    per_layer = {k: v for k, v in rows.items() if k not in index_keys}
    pool = jax.vmap(lambda layer, r: one(layer, {**r, **shared}))(cache.pool, per_layer)
    return cache.with_kv(pool)
