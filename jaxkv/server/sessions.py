"""Tenants, the session options a request may set, and the store of live sessions.

**Tenants.** With API keys (``--api-key``: keys, or files of keys one per line),
every ``/v1`` request must carry ``Authorization: Bearer <key>``; the tenant is a
digest of the key (the key itself is never stored or logged). Without keys
there is one tenant, ``public``. A tenant namespaces everything a request can
reach: the session store key, the session id the server's policy state, host
tier and repair signals are keyed by (``<tenant>/<session key>``), the radix
prefix cache (``cache_namespace``, ``Server.radix_for``) and the segment store
of cross-query reuse (``Session(reuse=..., tenant=<tenant>)``: a request only
ever splices segments its own tenant stored). So two tenants sending the same
session id, prompt or document share nothing: not a session (the second gets a
session of its own under that id, with its own options), not a cached prefix
or segment, not the timing or ``cached_tokens`` / ``reused_tokens`` of a hit
(which would tell one tenant what another sent). A request never names its
tenant: ``tenant`` is not a field.

**Session keys** (``session_key``): the client's ``session_id`` (``extra_body``)
or ``X-Session-Id`` header, else the IntentKV derivation of ALGORITHMS.md §4
(``jaxkv.chat.derive_session_id``: the first user message's tokens, else the
first 256 tokens), computed on the rendered request.

**Options** (``OptionRules``): a session runs with the server's defaults
(``jaxkv serve --policy --budget --layout --repair --kv-quant --kv-bits
--reuse``); a request may set any of ``OPTIONS`` in ``extra_body`` within what
the server allows (``--allow``): the choices ``policy``, ``layout``,
``kv_quant``, ``reuse`` to the default or an allowed value, the numbers
``budget``, ``repair``, ``kv_bits`` up to an allowed maximum. Anything else is
a 400 naming the field (``option_not_allowed`` past the allow-list,
``invalid_value`` for a malformed value or one that cannot compose, e.g. a
``budget`` with the full cache). Options belong to the session: they apply when
it is created, a later request naming none continues it as made, and one naming
different ones is refused (``session_options_mismatch``) rather than silently
ignored. Sessions of different KV precision (``kv_quant`` / ``kv_bits``) never
share cached prefixes (``cache_namespace``: cached rows keep the precision they
were written at).

**What a turn did** (``turn_report``): the options the live session runs with,
read from its stages, and each mechanism's work in the turn; the response
carries it as its ``jaxkv`` object.

**The store** (``SessionStore``, event-loop thread only): an LRU of
``SessionEntry`` (a ``jaxkv.Session`` on the shared ``Server``, its options,
and an ``asyncio.Lock`` that runs its turns one at a time, in arrival order).
At most ``capacity`` entries are kept; an entry in use (a request holds or waits
for it) is never evicted, so the store may exceed its cap by the requests in
flight. An evicted session is closed (its host-tier rows and repair signal are
released). At most ``max_waiting`` requests wait on one session; more get
``SessionBusyError`` (409).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import hmac
import logging
from pathlib import Path
from typing import Callable

from jaxkv.chat import derive_session_id
from jaxkv.errors import ConfigError, SessionBusyError
from jaxkv.server.errors import APIError, invalid
from jaxkv.server.protocol import SESSION_OPTIONS

log = logging.getLogger(__name__)

PUBLIC = "public"
FULL = "full"  # the policy name of the full cache (no retention)


# ============================================================================ tenants
def load_api_keys(values) -> list[str]:
    """Keys from ``--api-key`` values: each a key, or the path of a file of keys
    (one per line; blank lines and ``#`` comments skipped)."""
    keys = []
    for value in values or ():
        path = Path(value)
        if path.is_file():
            lines = [line.strip() for line in path.read_text().splitlines()]
            keys += [line for line in lines if line and not line.startswith("#")]
        elif value:
            keys.append(value)
    return keys


def tenant_of(key: str) -> str:
    """A tenant's name: a digest of its key (never the key itself)."""
    return "t" + hashlib.blake2b(key.encode(), digest_size=8, person=b"jaxkv-tenant").hexdigest()


class Tenants:
    """Bearer-key authentication (module docstring); no keys: one public tenant."""

    def __init__(self, keys=()):
        self._digests = {hashlib.sha256(k.encode()).digest(): tenant_of(k) for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization`` header; ``APIError`` 401 otherwise."""
        if not self._digests:
            return PUBLIC
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(key.strip().encode()).digest()
        for known, tenant in self._digests.items():  # constant time per key
            if hmac.compare_digest(known, digest):
                return tenant
        raise _unauthorized("invalid API key")


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def session_key(rendered, explicit: str | None) -> str:
    """The session key of a request: explicit, else ALGORITHMS.md §4 on its tokens."""
    return derive_session_id(rendered.ids, rendered.spans.session_span, explicit=explicit)


# ============================================================================ options
OPTIONS = SESSION_OPTIONS  # what extra_body may set
CHOICES = ("policy", "layout", "kv_quant", "reuse")  # allowed: a set of values (``--allow NAME=A,B``)
CAPS = ("budget", "repair", "kv_bits")  # allowed: values up to a maximum (``--allow NAME=MAX``)
OFF = {"policy": FULL, "kv_quant": "none", "reuse": "none"}  # the value that turns the mechanism off
_ALLOW_FIELD = {"policy": "allow_policies", "layout": "allow_layouts", "kv_quant": "allow_kv_quant", "reuse": "allow_reuse"}


def known_values(name: str) -> tuple[str, ...]:
    """Every value of the choice option ``name`` (``CHOICES``), its off value included."""
    if name == "policy":
        from jaxkv import policies

        return (*sorted(policies.REGISTRY), FULL)
    if name == "layout":
        from jaxkv.policies.layouts import LAYOUTS

        return tuple(LAYOUTS)
    if name == "kv_quant":
        from jaxkv.cache.quantized_host import MODES

        return (*MODES, "none")
    if name == "reuse":
        return ("segment", "cacheblend", "none")
    raise KeyError(name)


def _number(value, name: str, *, integer: bool, low: float, high: float | None = None):
    """A request's numeric option, checked (``APIError`` 400 naming it)."""
    kind = "an integer" if integer else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, int if integer else (int, float))
        or value < low
        or (high is not None and value > high)
    ):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise invalid(f"'{name}' must be {kind} {bound}, got {value!r}", name)
    return int(value) if integer else float(value)


@dataclasses.dataclass(frozen=True)
class OptionRules:
    """What sessions run with, and what a request may change (``jaxkv serve`` flags).

    Defaults (a request that names nothing): ``policy`` (None: full cache),
    ``budget``, ``layout``, ``repair`` (0: off), ``kv_quant`` (the KV pool's mode:
    the server builds its pool with it, so it is every session's default),
    ``kv_bits`` (triaxial modes; None: the calibration's budget), ``reuse`` (None:
    off, or ``"segment"`` / ``"cacheblend"``), ``keep_reasoning``, ``kv_allocation``
    (the TriAxialKV calibration of triaxial sessions; None: the model folder's).

    What a request may ask instead (the default is always allowed):
      allow_policies / allow_layouts / allow_kv_quant / allow_reuse: values of
        ``policy`` (``"full"``: the full cache), ``layout``, ``kv_quant``
        (``"none"``: full precision) and ``reuse`` (``"none"``: off);
      max_budget: the largest budget (None: any); max_repair: the largest K
        (the default ``repair`` at least); max_kv_bits: the largest ``kv_bits``
        (None: only the default).

    Invalid rules raise ``ConfigError`` when made: unknown names, an
    ``allow_kv_quant`` the pool cannot serve
    (``jaxkv.cache.quantized_host.servable_modes``), ``kv_bits`` outside [2, 4] or
    without a triaxial mode to apply to, a default policy without a budget.
    """

    policy: str | None = None
    budget: int | None = None
    layout: str = "dead_slot"
    repair: int = 0
    allow_policies: frozenset = frozenset()
    max_budget: int | None = None
    max_repair: int = 0
    keep_reasoning: bool = False
    kv_quant: str | None = None
    kv_bits: float | None = None
    reuse: str | None = None
    allow_layouts: frozenset = frozenset()
    allow_kv_quant: frozenset = frozenset()
    max_kv_bits: float | None = None
    allow_reuse: frozenset = frozenset()
    kv_allocation: str | None = None

    def __post_init__(self):
        from jaxkv.cache.quantized_host import check_mode, servable_modes

        for name, field in _ALLOW_FIELD.items():
            values = frozenset(getattr(self, field))
            object.__setattr__(self, field, values)
            unknown = sorted(values - set(known_values(name)))
            if unknown:
                raise ConfigError(f"allowed {name} values {unknown} are unknown; known: {list(known_values(name))}")
        for name in ("policy", "layout", "reuse"):
            value = getattr(self, name)
            if value == OFF.get(name):
                object.__setattr__(self, name, value := None)
            if value is not None and value not in known_values(name):
                raise ConfigError(f"unknown default {name} {value!r}; known: {list(known_values(name))}")
        if self.layout is None:
            raise ConfigError("the default layout must be one of dead_slot, compact")
        object.__setattr__(self, "kv_quant", check_mode(self.kv_quant))
        if self.policy is not None and self.budget is None:
            raise ConfigError("--policy needs --budget")
        for name, value, low in (
            ("budget", self.budget, 1),
            ("max_budget", self.max_budget, 1),
            ("repair", self.repair, 0),
            ("max_repair", self.max_repair, 0),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        servable = servable_modes(self.kv_quant)
        for mode in sorted(self.allow_kv_quant):
            if check_mode(mode) not in servable:
                pool = self.kv_quant or "none"
                raise ConfigError(
                    f"kv_quant={mode!r} cannot be allowed: the server's KV pool (--kv-quant {pool}) serves only "
                    f"{[m or 'none' for m in servable]}"
                )
        triaxial = [m for m in {self.kv_quant, *self.allow_kv_quant} if m and m.startswith("triaxial")]
        for name in ("kv_bits", "max_kv_bits"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 2.0 <= value <= 4.0:
                raise ConfigError(f"{name} must be an average bit width in [2, 4], got {value!r}")
            object.__setattr__(self, name, float(value))
        if not triaxial and (self.kv_bits is not None or self.max_kv_bits is not None or self.kv_allocation is not None):
            raise ConfigError("kv_bits and kv_allocation apply to the triaxial kv_quant modes, and none is the default or allowed")

    # -- what is allowed -----------------------------------------------------------------
    def allowed(self, name: str) -> list:
        """The values a request may give the choice option ``name``: the default and
        the allowed ones."""
        default = getattr(self, name)
        return sorted({OFF.get(name) if default is None else default} | set(getattr(self, _ALLOW_FIELD[name])))

    def _choice(self, overrides: dict, name: str):
        default = getattr(self, name)
        if name not in overrides:
            return default
        value = overrides[name]
        if value is None and name in OFF:
            value = OFF[name]
        known = known_values(name)
        if not isinstance(value, str) or value not in known:
            raise invalid(f"'{name}' must be one of {list(known)}, got {value!r}", name)
        allowed = self.allowed(name)
        if value not in allowed:
            raise invalid(f"{name} {value!r} is not allowed by this server (allowed: {allowed})", name, "option_not_allowed")
        return None if value == OFF.get(name) else value

    def resolve(self, overrides: dict) -> dict:
        """The session options of a request: the defaults and its allowed overrides
        (``APIError`` 400 naming the option otherwise). Canonical, so two requests
        asking the same thing get equal dicts.

        Composition: ``budget`` and ``layout`` belong to a retention policy (naming
        them with the full cache is a 400); the default ``repair`` applies to
        sessions with a policy on the dead-slot layout only, and naming K > 0
        otherwise is a 400 (RepairKV fills holes, which the full cache and a
        compacted row do not have); the default ``kv_bits`` and ``kv_allocation``
        apply to triaxial modes only, and naming ``kv_bits`` otherwise is a 400."""
        policy = self._choice(overrides, "policy")
        layout = self._choice(overrides, "layout")
        mode = self._choice(overrides, "kv_quant")
        reuse = self._choice(overrides, "reuse")
        budget = self.budget
        if "budget" in overrides:
            budget = _number(overrides["budget"], "budget", integer=True, low=1)
            if budget != self.budget and self.max_budget is not None and budget > self.max_budget:
                raise invalid(f"budget {budget} is above this server's maximum {self.max_budget}", "budget", "option_not_allowed")
        if policy is None:
            for name in ("budget", "layout"):
                if name in overrides:
                    raise invalid(f"'{name}' applies to a retention policy; this request runs the full cache (policy 'full')", name)
        elif budget is None:
            raise invalid(f"policy {policy!r} needs a budget (this server has no default budget)", "budget", "missing_required_parameter")
        holes = policy is not None and layout == "dead_slot"  # what RepairKV repairs
        if "repair" in overrides:
            repair = _number(overrides["repair"] or 0, "repair", integer=True, low=0)
            cap = max(self.max_repair, self.repair)
            if repair > cap:
                raise invalid(f"repair {repair} is above this server's maximum {cap}", "repair", "option_not_allowed")
            if repair and not holes:
                raise invalid(
                    "repair needs a retention policy with the dead_slot layout (it promotes evicted rows back into holes)", "repair"
                )
        else:
            repair = self.repair if holes else 0
        triaxial = mode is not None and mode.startswith("triaxial")
        bits = self.kv_bits if triaxial else None
        if overrides.get("kv_bits") is not None:
            if not triaxial:
                raise invalid(f"'kv_bits' applies to the triaxial kv_quant modes; this request runs kv_quant {mode or 'none'!r}", "kv_bits")
            bits = _number(overrides["kv_bits"], "kv_bits", integer=False, low=2.0, high=4.0)
            if bits != self.kv_bits and (self.max_kv_bits is None or bits > self.max_kv_bits):
                allowed = "none but its default" if self.max_kv_bits is None else f"at most {self.max_kv_bits:g}"
                raise invalid(f"kv_bits {bits:g} is not allowed by this server ({allowed})", "kv_bits", "option_not_allowed")
        options: dict = {"keep_reasoning": self.keep_reasoning}
        if policy is not None:
            options.update(policy=policy, budget=budget, layout=layout)
        if repair:
            options["repair"] = repair
        if mode is not None:
            options["kv_quant"] = mode
        if bits is not None:
            options["kv_bits"] = bits
        if triaxial and self.kv_allocation is not None:
            options["kv_allocation"] = self.kv_allocation
        if reuse is not None:
            options["reuse"] = reuse
        return options


def cache_namespace(tenant: str | None, options: dict, rules: OptionRules) -> str | None:
    """The radix-cache namespace of a session made with ``options``: its tenant's
    (None without API keys: one shared cache), and its KV precision when that is
    not the default's. Cached rows keep the precision they were first written at,
    so a session asking for ``kv_quant="int4"`` must not read another session's
    INT2 rows (nor a ``kv_bits=2`` session's prefix serve a ``kv_bits=3.5`` one)."""
    default = rules.resolve({})
    precision = (options.get("kv_quant"), options.get("kv_bits"))
    parts = [tenant] if tenant is not None else []
    if precision != (default.get("kv_quant"), default.get("kv_bits")):
        parts.append(f"kv={precision[0] or 'none'}/{precision[1] if precision[1] is not None else 'default'}")
    return "|".join(parts) or None


# ============================================================================ what a turn did
def session_options(session) -> dict:
    """The options a live ``Session`` runs with, read from its stages (so a
    response shows what ran, not what was asked): every name of ``OPTIONS``,
    None (or 0 for ``repair``) where the mechanism is off."""
    spec, repair, quant, reuse = session.retention, session.repair, session.quantization, session.reuse
    return {
        "policy": spec.policy.name if spec is not None else None,
        "budget": int(spec.budget) if spec is not None else None,
        "layout": spec.layout if spec is not None else None,
        "repair": int(repair.k) if repair is not None else 0,
        "kv_quant": quant.mode if quant is not None else None,
        "kv_bits": float(quant.budget) if quant is not None and quant.budget is not None else None,
        "reuse": reuse.config.mode if reuse is not None else None,
    }


def ledger(session) -> tuple[int, int, int, int]:
    """How many reports a session's stages hold (compressions, repairs, reuse
    reports, KV records): taken before a turn, ``turn_report`` reads the rest."""
    reuse, quant = session.reuse, session.quantization
    return (
        len(session.compressions),
        len(session.repairs),
        len(reuse.reports) if reuse is not None else 0,
        len(quant.records) if quant is not None else 0,
    )


def turn_report(session, before: tuple) -> dict:
    """What each mechanism did in the turn since ``ledger(session)`` was ``before``
    (the response's ``jaxkv`` object): ``options`` (``session_options``),
    ``evicted_tokens`` (retention), ``compacted_tokens`` (rows a compact layout
    copied), ``scoring_tokens`` (tokens a policy forwarded to score, beside the
    prompt's: KVzip's reconstruction passes), ``repaired_rows`` (RepairKV
    promotions), ``reused_tokens`` (prompt
    tokens spliced from stored segments), ``kv_avg_bits`` (average bits per element
    of the live KV after the prefill; None at full precision). Call it on the
    scheduler thread as the turn ends, before the session's next turn can start."""
    c0, r0, u0, q0 = before
    compressions = session.compressions[c0:]
    reuse, quant = session.reuse, session.quantization
    records = quant.records[q0:] if quant is not None else []
    bits = None
    if records:
        from jaxkv.serving.stages.quantization import summarize

        bits = float(summarize(records[-1:])["avg_bits"])
    return {
        "options": session_options(session),
        "evicted_tokens": int(sum(c.plan.evicted_positions.size for c in compressions)),
        "compacted_tokens": int(sum(c.plan.copy_src.size for c in compressions)),
        "scoring_tokens": int(sum(c.scoring_tokens for c in compressions)),
        "repaired_rows": int(sum(r.promoted_positions.size for r in session.repairs[r0:])),
        "reused_tokens": int(sum(r.spliced_tokens for r in reuse.reports[u0:])) if reuse is not None else 0,
        "kv_avg_bits": bits,
    }


# ============================================================================ the store
@dataclasses.dataclass(eq=False)
class SessionEntry:
    """One live session of the store.

    Attributes:
      key: ``(tenant, session key)``; session: the ``jaxkv.Session``;
      options: what it was made with (``OptionRules.resolve``);
      lock: runs its turns one at a time; users: requests holding or waiting.
    """

    key: tuple
    session: object
    options: dict
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    users: int = 0


class SessionStore:
    """LRU of live sessions on one ``Server`` (module docstring). Event-loop thread only.

    Args:
      make: ``make(key, options) -> Session``.
      close: ``close(session)``, called for an evicted session (may block: it is
        run in a worker thread).
      capacity: sessions kept; max_waiting: requests that may wait on one session.
    """

    def __init__(self, make: Callable, close: Callable, capacity: int = 1024, max_waiting: int = 8):
        if capacity < 1 or max_waiting < 1:
            raise ValueError("capacity and max_waiting must be >= 1")
        self._make, self._close = make, close
        self.capacity, self.max_waiting = int(capacity), int(max_waiting)
        self._entries: collections.OrderedDict[tuple, SessionEntry] = collections.OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def checkout(self, key: tuple, options: dict, explicit: set) -> SessionEntry:
        """The entry of ``key`` (made with ``options`` if new), marked in use.
        ``explicit``: the option names the request set itself; those must match
        the session's (``APIError`` 400 otherwise). ``SessionBusyError`` when
        ``max_waiting`` requests already wait on it."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = SessionEntry(key, self._make(key, options), options)
            self._shrink()
        else:
            for name in sorted(explicit):
                if entry.options.get(name) != options.get(name):
                    raise invalid(
                        f"this session runs with {name}={entry.options.get(name)!r}; a request cannot change it "
                        f"(start a new session for {name}={options.get(name)!r})",
                        name,
                        "session_options_mismatch",
                    )
            if entry.users > self.max_waiting:
                raise SessionBusyError(f"{entry.users} requests already run or wait on this session")
        self._entries.move_to_end(key)
        entry.users += 1
        return entry

    def checkin(self, entry: SessionEntry) -> None:
        """A request is done with ``entry``."""
        entry.users -= 1
        self._shrink()

    def _shrink(self) -> None:
        for key in list(self._entries):
            if len(self._entries) <= self.capacity:
                return
            entry = self._entries[key]
            if entry.users == 0:
                del self._entries[key]
                self.evictions += 1
                asyncio.get_running_loop().run_in_executor(None, self._close_quietly, entry.session)

    def _close_quietly(self, session) -> None:
        try:
            self._close(session)
        except Exception:  # the server may be closing; nothing to give back then
            log.debug("closing an evicted session failed", exc_info=True)

    def close_all(self) -> None:
        """Close every session (server shutdown; blocking)."""
        for entry in list(self._entries.values()):
            self._close_quietly(entry.session)
        self._entries.clear()
