"""The oracle backend: the dense masked softmax over the whole pool
(``jaxkv.attention.ragged_attention_reference``), the pool's layer read whole
(dequantized for the dual pool). Slow by design; it is what every other backend is
tested against, and it serves ``Engine(backend="reference")``.

Its readers (attention mass) are its pool kind's blocked ones.
"""

from __future__ import annotations

import dataclasses

from jaxkv.attention import ragged_attention_reference
from jaxkv.backends.base import AttentionBackend, AttentionMetadata


@dataclasses.dataclass(frozen=True)
class ReferenceBackend(AttentionBackend):
    """Attributes: ``blocked``: the CPU backend of the same pool kind (its reader)."""

    blocked: AttentionBackend | None = None
    name = "reference"

    def reader(self, kv, i, lists_RN, k_TKD=None, v_TKD=None, meta=None):
        return self.blocked.reader(kv, i, lists_RN, k_TKD, v_TKD, meta)

    def attend_listed(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata):
        lists, kv_len = meta.layer_list(i)
        k_SKD, v_SKD = self.layers.read_pool(kv, i)
        return ragged_attention_reference(q_THD, k_SKD, v_SKD, lists, kv_len, meta.q_start_R, meta.q_len_R)
