"""Helpers shared by the kernel tests and ``eval/bench_kernels.py``.

* ``rel_err``: max-abs error relative to the reference's max-abs value.
* ``attention_f64``: float64 numpy decode attention over explicit K/V rows, an
  oracle independent of ``jaxkv.attention``.
* ``live_lists``: random live-index lists (random slot order, never slot 0,
  padding entries pointing at real slots so reading them would change results).
"""

from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def attention_f64(q_HD, k_NKD, v_NKD) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) v for one request, GQA, in float64: ``[Hq, D]``."""
    q = np.asarray(q_HD, np.float64)
    k, v = np.asarray(k_NKD, np.float64), np.asarray(v_NKD, np.float64)
    Hq, D = q.shape
    K = k.shape[1]
    qg = q.reshape(K, Hq // K, D)
    s = np.einsum("kgd,nkd->kgn", qg, k) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("kgn,nkd->kgd", p, v).reshape(Hq, D)


def live_lists(rng: np.random.Generator, lengths, width: int, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(live_idx [B, width] int32, live_len [B] int32)`` of random distinct slots >= 1."""
    idx = np.stack([rng.permutation(num_slots - 1)[:width] + 1 for _ in lengths]).astype(np.int32)
    return idx, np.asarray(lengths, np.int32)
