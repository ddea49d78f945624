"""Serving: the turn pipeline and its stages, the scheduler, ``Server`` and ``Session``.

* ``pipeline``: one turn as a generator (render -> radix match -> prefill ->
  stages -> decode -> insert), yielding batched engine work;
* ``stages``: retention, RepairKV (and the registry new mechanisms join);
* ``scheduler``: continuous batching of many sessions' turns on one engine;
* ``server`` / ``session``: the shared state and one conversation;
* ``handles``: what a submitted chat turn gives back.
"""

from jaxkv.serving.handles import ChatHandle, ChatTurn
from jaxkv.serving.pipeline import TurnResult
from jaxkv.serving.server import Server
from jaxkv.serving.session import Session

__all__ = ["ChatHandle", "ChatTurn", "Server", "Session", "TurnResult"]
