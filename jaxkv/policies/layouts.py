"""Layouts: how a kept set edits one request's slot map (ALGORITHMS.md §5).

Plain host functions: they decide, the engine applies (``Engine.apply_layout``).

* ``dead_slot``: survivors keep their slot and RoPE phase; dropped positions are
  redirected to the sentinel and leave the live-index list. Token ids and
  positions never change, so the request still matches the radix cache. The row
  releases its reference on each dropped slot; a slot is freed only when nobody
  else (the radix cache for a shared prefix, another request) still holds it.
* ``compact``: kept rows are copied to fresh slots at contiguous new positions
  ``0..K-1`` and their keys re-rotated by ``new - old`` (RoPE delta, §8). The
  request is renumbered, so it must not be inserted in the radix cache.

Per-layer keep sets (``keep_sets="layer"``): the layout applies the union of
the layers' sets (a slot holds every layer's K/V, so a position leaves the slot
map, and its slot is released, only when no layer keeps it), and ``with_layers``
records each layer's set on the plan for the engine's per-layer live lists.

Invariants: the sentinel is never released or listed live; every kept position
is live afterwards; ``released`` lists exactly the non-sentinel slots the row no
longer maps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.cache.allocator import SENTINEL_SLOT

LAYOUTS = ("dead_slot", "compact")


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """A decided edit of one request.

    Attributes:
      slots: the new position -> slot map.
      live: the new live-index list (position order).
      released: slots the row drops its reference on.
      evicted_positions / evicted_slots: positions dropped (original numbering)
        and the slots that held them (for the host tier, before release).
      copy_src / copy_dst / delta: rows to copy and rotate (compact only).
      renumbered: positions changed (compact): no radix insert afterwards.
      kept_positions: original positions of the survivors, in order.
      layer_keep: None (every layer reads the kept set), or bool ``[L, P']`` over
        the positions after the plan (``P'``: the row's positions, or the kept
        ones when renumbered): which of them each layer reads, per-layer keep sets
        whose union is the kept set (``with_layers``).
    """

    slots: list[int]
    live: list[int]
    released: np.ndarray
    evicted_positions: np.ndarray
    evicted_slots: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    delta: np.ndarray
    renumbered: bool
    kept_positions: np.ndarray
    layer_keep: np.ndarray | None = None


def _split(slots_P, keep_positions):
    slots = np.asarray(slots_P, np.int64)
    keep = np.zeros(slots.size, bool)
    keep[np.asarray(keep_positions, np.int64)] = True
    live = slots != SENTINEL_SLOT
    if (keep & ~live).any():
        raise ValueError("kept positions must be live (not holes)")
    dropped = live & ~keep
    return slots, keep, dropped


def dead_slot(slots_P, keep_positions) -> LayoutPlan:
    slots, keep, dropped = _split(slots_P, keep_positions)
    new = np.where(dropped, SENTINEL_SLOT, slots)
    kept_pos = np.flatnonzero(keep)
    empty = np.zeros(0, np.int64)
    return LayoutPlan(
        slots=new.tolist(),
        live=new[kept_pos].tolist(),
        released=slots[dropped],
        evicted_positions=np.flatnonzero(dropped),
        evicted_slots=slots[dropped],
        copy_src=empty,
        copy_dst=empty,
        delta=empty,
        renumbered=False,
        kept_positions=kept_pos,
    )


def compact(slots_P, keep_positions, fresh_slots) -> LayoutPlan:
    """``fresh_slots``: ``len(keep_positions)`` newly allocated slots."""
    slots, keep, dropped = _split(slots_P, keep_positions)
    kept_pos = np.flatnonzero(keep)
    fresh = np.asarray(fresh_slots, np.int64)
    if fresh.size != kept_pos.size:
        raise ValueError(f"compact needs {kept_pos.size} fresh slots, got {fresh.size}")
    return LayoutPlan(
        slots=fresh.tolist(),
        live=fresh.tolist(),
        released=slots[slots != SENTINEL_SLOT],
        evicted_positions=np.flatnonzero(dropped),
        evicted_slots=slots[dropped],
        copy_src=slots[kept_pos],
        copy_dst=fresh,
        delta=np.arange(kept_pos.size) - kept_pos,
        renumbered=True,
        kept_positions=kept_pos,
    )


def with_layers(plan: LayoutPlan, keep_LP) -> LayoutPlan:
    """``plan`` (made from the union of ``keep_LP``'s rows) with each layer's kept
    set: ``keep_LP`` bool ``[L, P]`` over the positions before the plan."""
    keep = np.asarray(keep_LP, bool)
    if not np.array_equal(np.flatnonzero(keep.any(axis=0)), plan.kept_positions):
        raise ValueError("the plan's kept set must be the union of the layers' sets")
    return dataclasses.replace(plan, layer_keep=keep[:, plan.kept_positions] if plan.renumbered else keep)
