"""The ragged paged attention kernels over a float pool: Pallas through Mosaic on
TPUs (and the TPU interpreter anywhere, ``"interpret"``), Triton through
jax-triton on NVIDIA GPUs (``jaxkv.kernels.attention.ragged``: one kernel for every
step, prefill pieces and decode tokens alike, split-K for long lists).

The decode loop calls the same kernel with one query per row; there is no window
(the kernel reads the pool in place). Attention mass runs the blocked
implementation's second pass through ``PoolReader`` (``AttentionBackend``).

Invariant: the kernel reads layer ``i`` of the pool as the blocked implementation
does, entry for entry, so the kernels' tests against ``ragged_attention_reference``
cover this backend (``tests/test_ragged_kernels.py``).
"""

from __future__ import annotations

import dataclasses

from jaxkv.backends.base import AttentionBackend, AttentionMetadata
from jaxkv.kernels.attention.ragged import PoolReader, pad_lists, ragged_attention


@dataclasses.dataclass(frozen=True)
class FloatKernelBackend(AttentionBackend):
    """Attributes: ``platform``: ``"tpu"``, ``"gpu"`` or ``"interpret"`` (``jaxkv.kernels._dispatch``)."""

    platform: str = "interpret"
    name = "float-kernel"

    def reader(self, kv, i, lists_RN, k_TKD=None, v_TKD=None, meta=None) -> PoolReader:
        k, v = kv
        return PoolReader(k, v, pad_lists(lists_RN), layer=i)

    def attend_listed(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata):
        lists, kv_len = meta.layer_list(i)
        k_SKD, v_SKD = self.layers.read_pool(kv, i)
        return ragged_attention(q_THD, k_SKD, v_SKD, lists, kv_len, meta.q_start_R, meta.q_len_R, backend=self.platform)
