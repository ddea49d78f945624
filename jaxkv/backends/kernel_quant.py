"""The fused quantized decode kernels over the dual INT2/INT4 pool: INT2 pages and
INT4 tokens (or KIVI's float residual) read by kind and dequantized inside the
kernel, each part's split-K partials merged by log-sum-exp
(``jaxkv.kernels.attention.quantized``: Pallas on TPUs and in interpret mode,
Triton on NVIDIA GPUs through ``jaxkv.kernels.triton.decode``).

Those kernels are decode kernels (one query per row, by page table), so this
backend serves the decode loop through them, reading the call's plan
(``DecodeParts``: the rows' pages with their bitmasks, then the token part with
the call's new slots appended). A step with several tokens per row (a prefill
piece beside decode tokens) runs the blocked implementation through
``QuantReader`` (``jaxkv.backends.cpu_quant``), as does attention mass, and so do
rows that keep a set per layer (their call has no plan: a page table is one per
row).

A pool with INT3 pages hands the kernel its rows' listed pages as one 3-bit page
part (``page_view``: the low planes and the high planes of the listed pages, an
INT2 page's high plane zero; the parameters in float32, an INT3 page's one-byte
ones expanded by ``page_params``), read by the same page reader at 3 bits
(``jaxkv.kernels.quant``'s 2 + 1 split): one part, one merge, whatever the mix of
INT2 and INT3 pages.

Invariant: the kernels dequantize with the pool's arithmetic, so within float32
rounding this backend equals ``CpuQuantBackend`` (the engine-level parity test,
``tests/test_backends.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.backends.base import AttentionMetadata
from jaxkv.backends.cpu_quant import CpuQuantBackend
from jaxkv.cache.quantized import FLOAT, DecodeParts, page_params, page_rows
from jaxkv.kernels.attention.quantized import quantized_decode_attention
from jaxkv.kernels.quant import Int2Pool, PackedKeyPages, PackedRows


def page_view(pool, geo, i, pages_RQ):
    """The listed pages of layer ``i`` as an ``Int2Pool`` of 3-bit rows (``R * Q``
    pages, entry ``r * Q + q`` for page ``q`` of row ``r``) and their ids in it
    ``[R, Q]``: what the kernel reads for a pool with INT3 pages."""
    R, Q = pages_RQ.shape
    ids = pages_RQ.reshape(-1)
    take = lambda a, p=ids: a[i, p]  # noqa: E731
    (kd, bits), (vd, _) = page_rows(pool, geo, 0, take, ids), page_rows(pool, geo, 1, take, ids)
    (ks, kz), (vs, vz) = page_params(pool, geo, 0, take, ids), page_params(pool, geo, 1, take, ids)  # float32, INT3 pages' expanded
    view = Int2Pool(PackedKeyPages(kd, ks, kz, bits), PackedRows(vd, vs, vz, bits))
    return view, jnp.arange(R * Q, dtype=jnp.int32).reshape(R, Q)


@dataclasses.dataclass(frozen=True)
class QuantKernelBackend(CpuQuantBackend):
    """Attributes: ``platform``: ``"tpu"``, ``"gpu"`` or ``"interpret"``."""

    platform: str = "interpret"
    name = "quant-kernel"

    @property
    def uses_window(self) -> bool:
        return False

    def attend_listed(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata):
        if meta.decode and meta.read_plan is not None:
            _, kv_len = meta.layer_list(i)
            return self.fused_decode(kv, i, q_THD, meta.read_plan, kv_len, meta.active_R).astype(q_THD.dtype)
        return self.attend_blocked(kv, i, q_THD, k_TKD, v_TKD, meta)

    def fused_decode(self, pool, i, q_RHD, plan: DecodeParts, kv_len_R, active_R):
        """One query per row over its plan, through the fused kernel: ``[R, Hq, D]``
        float32, zero where inactive."""
        geo = self.geometry
        layer = lambda tree: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
        n_tokens = jnp.where(active_R, plan.n_tokens_R + (kv_len_R - plan.live0_R), 0).astype(jnp.int32)
        n_pages = jnp.where(active_R, plan.n_pages_R, 0).astype(jnp.int32)
        int2 = layer(pool.int2) if geo.pages > 1 else None
        page_ids = plan.pages_RQ.astype(jnp.int32)
        if geo.pages3:  # INT2 and INT3 pages: one 3-bit part of the listed pages
            int2, page_ids = page_view(pool, geo, i, jnp.clip(page_ids, 0, geo.pages - 1))
        slots = plan.tokens_RN.astype(jnp.int32)
        if self.layers.token_kind == FLOAT:  # KIVI: the token part is the float residual
            floats = dict(
                float_pool=(pool.flt_k[i], pool.flt_v[i]),
                float_idx_BN=jnp.clip(slots - geo.off_float, 0, max(geo.float_slots - 1, 0)),
                float_len_B=n_tokens,
            )
            int4_idx, int4_len = jnp.zeros_like(slots[:, :1]), jnp.zeros_like(n_tokens)
        else:
            floats = {}
            int4_idx, int4_len = jnp.clip(slots - geo.off4, 0, geo.int4_slots - 1), n_tokens
        out = quantized_decode_attention(
            q_RHD,
            int2,
            page_ids,
            n_pages,
            layer(pool.int4),
            int4_idx,
            int4_len,
            int2_mask_BP=plan.mask_RQ if int2 is not None else None,
            backend=self.platform,
            **floats,
        )
        return jnp.where(active_R[:, None, None], out.astype(jnp.float32), 0.0)
