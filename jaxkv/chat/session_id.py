"""Session ids: which requests share per-session policy state (ALGORITHMS.md §4).

Resolved in priority order (IntentKV App. A / H):
  1. an explicit ``session_id`` given by the client -> ``"explicit:<id>"``;
  2. the token tuple of the session span (the first user task message after the
     chat template) -> ``"span:<hash>"``;
  3. the first ``n_prefix = 256`` input tokens -> ``"prefix:<hash>"``;
  4. no token ids at all -> ``"local:<random>"``, a request-local key that never
     matches another request (no accidental sharing of memory).

Hashes are BLAKE2b (128-bit) of the ids as little-endian int64, so they do not
depend on the array dtype or the process (unlike Python's ``hash``). The prefix
in front of each key keeps the four sources from colliding with each other. Two
sessions whose first user messages are identical token for token share a key by
design (that is what the span rule means); give an explicit id to separate them.
"""

from __future__ import annotations

import hashlib
import uuid

import numpy as np

DEFAULT_PREFIX_TOKENS = 256


def derive_session_id(
    ids=None, session_span: tuple[int, int] | None = None, explicit: str | None = None, n_prefix: int = DEFAULT_PREFIX_TOKENS
) -> str:
    """The session key of a request (see the module docstring for the order).

    Args:
      ids: the request's token ids (e.g. ``Rendered.ids``), or None.
      session_span: half-open ``(start, end)`` into ``ids`` (``Rendered.spans.session_span``);
        empty or None means absent.
      explicit: a client-supplied session id; empty or None means absent.
      n_prefix: how many leading tokens the prefix fallback hashes.
    """
    if explicit:
        return f"explicit:{explicit}"
    ids = np.asarray(ids if ids is not None else (), dtype=np.int64).reshape(-1)
    if session_span is not None:
        start, end = int(session_span[0]), int(min(session_span[1], ids.size))
        if 0 <= start < end:
            return f"span:{_hash_ids(ids[start:end])}"
    if ids.size:
        return f"prefix:{_hash_ids(ids[:n_prefix])}"
    return f"local:{uuid.uuid4().hex}"


def _hash_ids(ids: np.ndarray) -> str:
    return hashlib.blake2b(ids.astype("<i8").tobytes(), digest_size=16).hexdigest()
