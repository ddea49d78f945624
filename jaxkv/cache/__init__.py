"""KV cache state: device pytrees (pool, per-request tables) and host bookkeeping."""

from jaxkv.cache.allocator import SENTINEL_SLOT, SlotAllocator

__all__ = ["SENTINEL_SLOT", "SlotAllocator"]
