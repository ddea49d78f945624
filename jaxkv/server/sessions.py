"""Tenants, the session options a request may set, and the store of live sessions.

**Tenants.** With API keys (``--api-key``: keys, or files of keys one per line),
every ``/v1`` request must carry ``Authorization: Bearer <key>``; the tenant is a
digest of the key (the key itself is never stored or logged). Without keys
there is one tenant, ``public``. A tenant namespaces everything a request can
reach: the session store key, the session id the server's policy state, host
tier and repair signals are keyed by (``<tenant>/<session key>``), and the radix
prefix cache (``Session(cache_namespace=tenant)``, ``Server.radix_for``). So
two tenants sending the same session id, or the same prompt, share nothing:
not a session, not a cached prefix, not the timing or ``cached_tokens`` of a
cache hit (which would tell one tenant what another sent).

**Session keys** (``session_key``): the client's ``session_id`` (``extra_body``)
or ``X-Session-Id`` header, else the IntentKV derivation of ALGORITHMS.md §4
(``jaxkv.chat.derive_session_id``: the first user message's tokens, else the
first 256 tokens), computed on the rendered request.

**Options** (``OptionRules``): a session runs with the server's defaults
(``--policy``, ``--budget``, ``--repair``); a request may override ``policy``
(only to one of ``--allow-policies``), ``budget`` (at most ``--max-budget``) and
``repair`` (at most ``--max-repair``). Options belong to the session: they apply
when it is created, and a later request naming different ones is refused
(``session_options_mismatch``) rather than silently ignored.

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
from jaxkv.errors import SessionBusyError
from jaxkv.server.errors import APIError, invalid

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
@dataclasses.dataclass(frozen=True)
class OptionRules:
    """What sessions run with and what a request may change.

    Attributes:
      policy, budget, layout, repair: the defaults (``policy`` None: full cache;
        ``repair`` 0: off).
      allow_policies: policies a request may pick (``"full"`` for the full cache);
        the default policy is always allowed.
      max_budget: the largest budget a request may ask (None: any).
      max_repair: the largest RepairKV K a request may ask.
      keep_reasoning: sessions render earlier reasoning too.
    """

    policy: str | None = None
    budget: int | None = None
    layout: str = "dead_slot"
    repair: int = 0
    allow_policies: frozenset = frozenset()
    max_budget: int | None = None
    max_repair: int = 0
    keep_reasoning: bool = False

    def resolve(self, overrides: dict) -> dict:
        """The session options of a request: defaults + its allowed overrides
        (``APIError`` 400 naming the option otherwise). Canonical, so two requests
        asking the same thing get equal dicts."""
        policy, budget, repair = self.policy, self.budget, self.repair
        if "policy" in overrides:
            name = overrides["policy"] or FULL
            if not isinstance(name, str):
                raise invalid(f"'policy' must be a policy name, got {name!r}", "policy")
            if name != (self.policy or FULL) and name not in self.allow_policies:
                allowed = sorted({self.policy or FULL} | set(self.allow_policies))
                raise invalid(f"policy {name!r} is not allowed by this server (allowed: {allowed})", "policy", "option_not_allowed")
            policy = None if name == FULL else name
        if "budget" in overrides:
            budget = overrides["budget"]
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise invalid(f"'budget' must be a positive integer, got {budget!r}", "budget")
            if self.max_budget is not None and budget > self.max_budget:
                raise invalid(f"budget {budget} is above this server's maximum {self.max_budget}", "budget", "option_not_allowed")
        if "repair" in overrides:
            repair = overrides["repair"] or 0
            if isinstance(repair, bool) or not isinstance(repair, int) or repair < 0:
                raise invalid(f"'repair' must be a non-negative integer, got {repair!r}", "repair")
            if repair > max(self.max_repair, self.repair):
                raise invalid(f"repair {repair} is above this server's maximum {max(self.max_repair, self.repair)}", "repair", "option_not_allowed")
        options: dict = {"keep_reasoning": self.keep_reasoning}
        if policy is not None:
            options.update(policy=policy, budget=budget, layout=self.layout)
        if repair:
            options["repair"] = repair
        return options


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
                        f"(start a new session for {name}={options.get(name)!r})", name, "session_options_mismatch",
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
