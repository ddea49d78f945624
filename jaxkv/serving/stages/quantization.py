"""The quantization stage: the precision a session's KV is written at (TriAxialKV).

Session options it owns:

* ``kv_quant``: ``None`` (full precision), ``"int4"``, ``"kivi2"``, ``"kivi4"``,
  ``"triaxial"`` or an axis ablation (``"triaxial_no_temporal"``,
  ``"triaxial_no_semantic"``); modes in ``jaxkv.cache.quantized_host``.
* ``kv_bits``: the average-bit budget B of a triaxial mode (default: the
  calibrated B of the allocation); ``ConfigError`` for other modes.
* ``kv_rotate``: the pool stores K and V rotated per (layer, KV head)
  (``jaxkv.cache.rotation``); a pool property, so a session on a shared server
  takes the server's and may not ask for the other.
* ``kv_allocation``: the calibration (an ``Allocation``, a dict in its JSON
  form, or a path). Default: the model's calibration, first found wins
  (``jaxkv.models.registry.find_artifact``): ``<model folder>/triaxial.json``;
  for a reference model ``<cache>/models/<name>/triaxial.json`` (where
  ``train/calibrate_triaxial.py`` writes it); then the calibration shipped in
  ``jaxkv/assets/<name>/triaxial.json`` for the model whose ``weights.json``
  records the identity of these weights (``jaxkv.models.loading.weights_id``),
  however they were loaded. The user's own calibration wins over the shipped one.

How a session gets a quantized pool: the pool belongs to the server's engine, so
its regions are a server property. ``Session(model, kv_quant=...)`` makes its
private ``Server(model, kv_quant=...)``; a session on a shared server inherits
the server's mode when it gives none, and may ask for any mode the pool serves
(``jaxkv.cache.quantized_host.servable_modes``: a triaxial pool serves ``int4``
and every triaxial mode, since they write the same regions and differ only in
the prefill's ``kv_bits``); another mode raises ``ConfigError`` (a float pool
cannot hold packed rows, nor an INT4 pool without pages a triaxial plan).

What it does in a turn:

* ``before_prefill``: a triaxial mode annotates the prompt prefill with
  ``kv_bits``: each prefilled token's bit width is the allocation's bits for the
  token's triaxial tag in *this* request's rendering (``Rendered.triaxial``);
  the engine applies the page-completion rule. Tokens reused from the radix
  cache are not prefilled, so they keep the precision they were first written
  with; teacher-forced replies and decode tokens get INT4 (what decode writes).
  An allocation with ``rewrite_history`` (``Allocation.rewrite_history``) first
  moves the reused tokens still in the token region (INT4: earlier replies, the
  leftovers of earlier turns' page-completion rule) into pages at their tags'
  bits in this rendering (``Engine.requantize``: whole pages in position order,
  the rest stay INT4; paged tokens never move), so replies and short tags stop
  holding INT4 once a later turn completes their pages. An allocation with
  ``sink_tokens`` writes the request's first positions INT4 whatever their tag,
  and its rewrite leaves them there (``Allocation.sink_tokens``: the attention sink).
  With ``rewrite_from_float`` the rewrite's recent part is a recomputation
  instead (``reuse_cut``, before the row opens): the turn reuses the cache only
  up to the first of the last ``REFRESH_TOKENS`` cached tokens that is INT4 but
  tagged 2 or 3 bits, and prefills the rest again, so those tokens are rounded
  once, from float, into pages (the radix tree takes the fresh slots, so the
  next turn starts from them); INT4 tokens older than that are re-encoded from
  INT4 as above. A cut never crosses a hole (a retention stage's eviction).
  ``int4``, ``kivi2`` and ``kivi4`` need no annotation (the engine's mode decides).
* ``after_prefill`` (after retention and repair): records the request's live KV
  per precision (``KVRecord``) in ``records``, for ``avg_bits`` (code bits),
  ``stored_bits`` (8 * bytes / elements) and bytes per token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.cache.quantized import INT4
from jaxkv.cache.quantized_host import bytes_per_token, check_mode, elements_per_token, servable_modes, stored_bits
from jaxkv.chat.tags import triaxial_codes
from jaxkv.errors import ConfigError
from jaxkv.kernels.quant import PAGE
from jaxkv.policies.quant_allocation import Allocation, load_allocation, variant_dict
from jaxkv.serving.stages.base import Stage, register

ORDER = 40  # after retention (20) and repair (30): records what decode will read
REFRESH_TOKENS = 4 * PAGE  # how far back the rewrite from float reaches: a turn prefills at most this many cached tokens again
CALIBRATION_FILE = "triaxial.json"
_UNSET = object()


@dataclasses.dataclass(frozen=True)
class KVRecord:
    """One request's live KV after its prompt prefill (and compression events).

    Attributes:
      int2, int4, full: live tokens per precision; int3: INT3 page tokens (0 in
        records journaled before the tier).
      bytes: their KV bytes, scales and zero points included (full precision
        counted as bf16; ``bytes_per_token``).
      elements: K and V elements per token (``elements_per_token``; 0 in records
        journaled before it was kept, whose stored bits are then unknown).
    """

    int2: int
    int4: int
    full: int
    bytes: float
    elements: int = 0
    int3: int = 0

    @property
    def tokens(self) -> int:
        return self.int2 + self.int3 + self.int4 + self.full

    @property
    def bits(self) -> float:
        """Code bits per element summed over tokens (2, 3, 4 or 16 each): what the
        allocation's budget B counts, not what the tokens occupy (``stored_bits``)."""
        return 2.0 * self.int2 + 3.0 * self.int3 + 4.0 * self.int4 + 16.0 * self.full


def summarize(records) -> dict:
    """Of records (one per request), token-weighted: ``avg_bits`` (code bits per
    element, what B budgets), ``stored_bits`` (8 * bytes / elements, every scale and
    zero point and float row counted; ``jaxkv.cache.quantized_host.stored_bits``)
    and ``kv_bytes_per_token``."""
    tokens = sum(r.tokens for r in records)
    if not tokens:
        return {"avg_bits": float("nan"), "stored_bits": float("nan"), "kv_bytes_per_token": float("nan")}
    nbytes = sum(r.bytes for r in records)
    elements = sum(r.tokens * r.elements for r in records)
    return {
        "avg_bits": sum(r.bits for r in records) / tokens,
        "stored_bits": stored_bits(nbytes, elements) if all(r.elements for r in records) else float("nan"),
        "kv_bytes_per_token": nbytes / tokens,
    }


def record_of(composition: dict, cfg) -> KVRecord:
    """``KVRecord`` of an ``Engine.kv_composition`` result for model config ``cfg``."""
    size = dict(head_dim=cfg.head_dim, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads)
    n2, n3, n4, nf = composition[2], composition.get(3, 0), composition[4], composition[16]
    total = sum(n * bytes_per_token(b, **size) for n, b in ((n2, 2), (n3, 3), (n4, 4), (nf, 16)))
    return KVRecord(n2, n4, nf, float(total), elements_per_token(**size), n3)


class QuantizationStage(Stage):
    """A session's KV precision (module docstring).

    Attributes:
      mode: the ``kv_quant`` mode; budget: B (triaxial modes) or None;
      table: bits per triaxial code (triaxial modes) or None;
      rotate: the pool stores K/V rotated (``kv_rotate``; a private server's pool
        is built so, a shared server's must be);
      records: one ``KVRecord`` per request.
    """

    name = "kv_quant"

    def __init__(
        self,
        mode: str | None,
        budget: float | None = None,
        table: np.ndarray | None = None,
        *,
        rotate: bool = False,
        rewrite_history: bool = False,
        sink_tokens: int = 0,
        rewrite_from_float: bool = False,
    ):
        self.mode, self.budget, self.table, self.rotate = mode, budget, table, rotate
        self.rewrite_history, self.sink_tokens = bool(rewrite_history), int(sink_tokens)
        self.rewrite_from_float = bool(rewrite_from_float)
        self.records: list[KVRecord] = []

    def begin(self, turn) -> None:
        engine_mode = turn.engine.pool.mode
        if self.mode not in servable_modes(engine_mode):
            raise ConfigError(f"session kv_quant={self.mode!r} on an engine built with kv_quant={engine_mode!r}")

    def reuse_cut(self, turn, slots_P):
        """``rewrite_from_float``: the first of the last ``REFRESH_TOKENS`` reused
        positions whose token is INT4 but tagged 2 or 3 bits here (None: none,
        or a hole after it)."""
        if self.table is None or not self.rewrite_from_float or not slots_P.size:
            return None
        start = max(self.sink_tokens, slots_P.size - REFRESH_TOKENS)
        tail = slots_P[start:].astype(np.int64)
        if not tail.size or (tail == SENTINEL_SLOT).any():
            return None
        bits = self._bits(turn.rendered.triaxial[start : slots_P.size], start)
        stale = np.flatnonzero((turn.engine.pool.geometry.kind(tail) == INT4) & (bits < 4))
        return start + int(stale[0]) if stale.size else None

    def before_prefill(self, turn, job):
        if self.table is not None:
            if self.rewrite_history and turn.reused:  # the history's INT4 tokens into pages at their tags' bits now
                history = self._bits(turn.rendered.triaxial[: turn.reused], 0)
                turn.engine.kv.requantize(turn.row, np.arange(turn.reused), history)
            job.kv_bits = self._bits(turn.rendered.triaxial[turn.reused :], turn.reused)
        return None

    def _bits(self, triaxial, start: int) -> np.ndarray:
        """Bits of the tokens at positions ``start, start + 1, ...`` with these tags:
        the table's, INT4 below ``sink_tokens`` (``Allocation.sink_tokens``)."""
        bits = self.table[triaxial_codes(triaxial)]
        bits[: max(0, self.sink_tokens - start)] = 4
        return bits

    def after_prefill(self, turn, captured) -> None:
        self.records.append(record_of(turn.engine.pool.composition(turn.req), turn.engine.model.config))


def resolve_allocation(model, mode: str, allocation) -> Allocation:
    """The ``Allocation`` of a triaxial mode from a session's ``kv_allocation``."""
    if isinstance(allocation, Allocation):
        return allocation
    if isinstance(allocation, dict):
        data = allocation
        return Allocation.from_dict(variant_dict(data, mode) if "variants" in data else data)
    if allocation is None:
        from jaxkv.models import registry

        allocation = registry.find_artifact(model, CALIBRATION_FILE, Path.is_file)
        if allocation is None:
            candidates = registry.artifact_paths(getattr(model, "path", None), CALIBRATION_FILE)
            if not candidates:
                raise ConfigError(
                    f"kv_quant={mode!r} needs a calibration: pass kv_allocation= (the model has no folder "
                    "and no calibration ships for its weights)"
                )
            allocation = candidates[0]  # load_allocation's error names it and the calibration script
    return load_allocation(allocation, mode)


def _factory(session, options: dict, built: list):
    mode = options.pop("kv_quant", _UNSET)
    bits = options.pop("kv_bits", None)
    allocation = options.pop("kv_allocation", None)
    rotate = options.pop("kv_rotate", _UNSET)
    server = getattr(session, "server", None)
    server_mode = getattr(server, "kv_quant", None) if server is not None else None
    server_rotate = bool(getattr(server, "kv_rotate", False)) if server is not None else False
    mode = server_mode if mode is _UNSET else check_mode(mode)
    rotate = server_rotate if rotate is _UNSET else rotate
    if not isinstance(rotate, bool):
        raise ConfigError(f"kv_rotate must be True or False, got {rotate!r}")
    if server is not None and rotate != server_rotate:
        raise ConfigError(f"session kv_rotate={rotate} on a server built with kv_rotate={server_rotate} (the pool's frame is shared)")
    if rotate and mode is None:
        raise ConfigError("kv_rotate applies to a quantized pool (kv_quant), not to full precision")
    if server is not None and mode not in servable_modes(server_mode):
        raise ConfigError(
            f"session kv_quant={mode!r} on a server built with kv_quant={server_mode!r} "
            f"(its pool is shared and serves {list(servable_modes(server_mode))})"
        )
    triaxial = mode is not None and mode.startswith("triaxial")
    if not triaxial and (bits is not None or allocation is not None):
        raise ConfigError(f"kv_bits / kv_allocation apply to the triaxial modes, not kv_quant={mode!r}")
    if mode is None:
        return None
    if not triaxial:
        return QuantizationStage(mode, rotate=rotate)
    alloc = resolve_allocation(session.model, mode, allocation)
    budget = alloc.budget if bits is None else float(bits)
    if not 2.0 <= budget <= 4.0:
        raise ConfigError(f"kv_bits must be an average in [2, 4], got {bits!r}")
    return QuantizationStage(
        mode,
        budget,
        alloc.table(budget),
        rotate=rotate,
        rewrite_history=alloc.rewrite_history,
        sink_tokens=alloc.sink_tokens,
        rewrite_from_float=alloc.rewrite_from_float,
    )


register("kv_quant", ORDER, _factory)
