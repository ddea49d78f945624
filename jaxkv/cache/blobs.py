"""The host tier's packed-row codec: quantized K/V rows as uint8 blobs.

A shelved row (RepairKV's host tier) is one uint8 blob per
(layer, head) for K and one for V, of one width (``blob_width``): byte 0 is the
row's kind (2, 3, 4 or 16), then its codes and float16 parameters (INT4: codes, scale, zero; INT2 and INT3 keys: codes and
the page's per-channel scale and zero; float: the raw values). Page rows (INT2
and INT3 alike) are kept at the pool's page-row width (``page_bits``: 3 for a pool
with INT3 pages, whose INT2 rows then carry a zero high plane); an INT3 row's
one-byte parameters (``jaxkv.kernels.quant3``) travel two to a float16 container in
the float16 parameter fields (``jaxkv.cache.quantized.pack_params3``), bit for bit. Promotion writes
the same bytes back: INT4 / float rows to fresh slots, page rows into fresh pages
of their kind grouped by identical page parameters, so every promoted row
dequantizes to the same float32 values (bit-identical).

Why by hand: the rows are a mix of three formats (INT2 page tokens with their
page's parameters, INT4 rows, float rows) that must round-trip bit for bit into
fresh slots; a blob of one width per (layer, head) keeps the host tier's arrays
one shape whatever the mix.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv.cache.quantized import FLOAT, INT2, INT3, INT4, PAGED, dequantize_int2_tokens
from jaxkv.cache.quantized_rows import unpack_params3
from jaxkv.kernels.quant import PackedRows, dequantize_rows
from jaxkv.kernels.quant3 import params as params3


def blob_width(D: int, float_itemsize: int, page_bits: int = 2) -> int:
    """Bytes of one (layer, head) blob, K and V alike (the host tier keeps K and V
    arrays of one shape): a kind byte and the largest payload (page keys: codes
    and the page's per-channel float16 scale and zero; or a float row)."""
    return 1 + max(D // 2 + D // 8, D * page_bits // 8 + 4 * D, D * float_itemsize)


def _of(kinds: np.ndarray, kind: int) -> np.ndarray:
    """Rows stored as ``kind``'s fields: INT2 stands for every page kind (INT2, INT3)."""
    return np.isin(kinds, PAGED) if kind == INT2 else kinds == kind


def _u8(x) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.view(np.uint8).reshape(*x.shape[:-1], -1)


def encode_blobs(fields: dict, kinds: np.ndarray, head_dim: int, float_dtype, page_bits: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Packed fields of ``gather_packed`` (``[L, M, K, ...]``) -> K and V blobs
    ``[L, M, K, W]`` uint8 (module docstring)."""
    D = head_dim
    L, M, K = fields["k4_data"].shape[:3]
    itemsize = np.dtype(float_dtype).itemsize
    w = blob_width(D, itemsize, page_bits)
    kb, vb = np.zeros((L, M, K, w), np.uint8), np.zeros((L, M, K, w), np.uint8)
    kb[..., 0] = vb[..., 0] = np.asarray(kinds, np.uint8)[None, :, None]
    pieces = {
        INT4: (("k4_data", "k4_scale", "k4_zero"), ("v4_data", "v4_scale", "v4_zero")),
        INT2: (("k2_data", "k2_scale", "k2_zero"), ("v2_data", "v2_scale", "v2_zero")),
        FLOAT: (("f_k",), ("f_v",)),
    }
    for kind, (kn, vn) in pieces.items():
        m = np.flatnonzero(_of(np.asarray(kinds), kind))
        if not m.size:
            continue
        for blob, names in ((kb, kn), (vb, vn)):
            parts = np.concatenate([_u8(np.asarray(fields[n])[:, m]) for n in names], axis=-1)
            blob[:, m, :, 1 : 1 + parts.shape[-1]] = parts
    return kb, vb


def decode_blobs(k_blob: np.ndarray, v_blob: np.ndarray | None, head_dim: int, float_dtype, page_bits: int = 2) -> tuple[np.ndarray, dict]:
    """Inverse of ``encode_blobs``: ``(kinds [M], fields)``; ``fields[name]`` holds
    the rows of that name's kind only (in row order of that kind); V fields only
    when ``v_blob`` is given."""
    D = head_dim
    fd = np.dtype(float_dtype)
    kinds = k_blob[0, :, 0, 0].astype(np.int64)
    sizes = {
        INT4: (
            (("k4_data", D // 2, np.uint8), ("k4_scale", D // 32, np.float16), ("k4_zero", D // 32, np.float16)),
            (("v4_data", D // 2, np.uint8), ("v4_scale", D // 32, np.float16), ("v4_zero", D // 32, np.float16)),
        ),
        INT2: (
            (("k2_data", D * page_bits // 8, np.uint8), ("k2_scale", D, np.float16), ("k2_zero", D, np.float16)),
            (("v2_data", D * page_bits // 8, np.uint8), ("v2_scale", D // 32, np.float16), ("v2_zero", D // 32, np.float16)),
        ),
        FLOAT: ((("f_k", D, fd),), (("f_v", D, fd),)),
    }
    fields = {}
    for kind, specs in sizes.items():
        m = np.flatnonzero(_of(kinds, kind))
        for blob, spec in zip((k_blob, v_blob), specs):
            if blob is None:
                continue
            at = 1
            for name, n, dtype in spec:
                nbytes = n * np.dtype(dtype).itemsize
                raw = np.ascontiguousarray(blob[:, m, :, at : at + nbytes])
                fields[name] = raw.view(dtype).reshape(*raw.shape[:-1], n)
                at += nbytes
    return kinds, fields


def blob_keys(k_blob: np.ndarray, head_dim: int, float_dtype, page_bits: int = 2) -> np.ndarray:
    """float32 keys ``[L, M, K, D]`` of shelved rows (RepairKV scores them)."""
    kinds, f = decode_blobs(k_blob, None, head_dim, float_dtype, page_bits)
    L, M, K = k_blob.shape[:3]
    out = np.zeros((L, M, K, head_dim), np.float32)
    for kind in (INT4, INT2, FLOAT):
        m = np.flatnonzero(_of(kinds, kind))
        if not m.size:
            continue
        if kind == INT4:
            out[:, m] = np.asarray(
                dequantize_rows(PackedRows(jnp.asarray(f["k4_data"]), jnp.asarray(f["k4_scale"]), jnp.asarray(f["k4_zero"]), 4))
            )
        elif kind == INT2:
            scale, zero = jnp.asarray(f["k2_scale"]), jnp.asarray(f["k2_zero"])
            three = kinds[m] == INT3
            if three.any():  # INT3 rows: their one-byte parameters in the float16 fields (``pack_params3``)
                s3, z3 = params3(*unpack_params3(scale, head_dim))
                own = jnp.asarray(three)[None, :, None, None]
                scale, zero = jnp.where(own, s3, scale.astype(jnp.float32)), jnp.where(own, z3, zero.astype(jnp.float32))
            out[:, m] = np.asarray(dequantize_int2_tokens(jnp.asarray(f["k2_data"]), scale, zero, page_bits))
        else:
            out[:, m] = f["f_k"].astype(np.float32)
    return out
