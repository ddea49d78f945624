"""KV cache state: device pytrees (pool, per-request tables) and host bookkeeping
(allocator, radix prefix tree, session store)."""

from jaxkv.cache.allocator import SENTINEL_SLOT, SlotAllocator
from jaxkv.cache.radix import LockHandle, PrefixMatch, RadixTree, common_prefix_length
from jaxkv.cache.session_store import SessionStore
from jaxkv.cache.state import PagedKVCache, append_tokens

__all__ = [
    "SENTINEL_SLOT",
    "LockHandle",
    "PagedKVCache",
    "PrefixMatch",
    "RadixTree",
    "SessionStore",
    "SlotAllocator",
    "append_tokens",
    "common_prefix_length",
]
