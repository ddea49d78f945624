"""What a submitted chat turn gives back: ``ChatHandle`` while it runs (wait,
cancel, stop early, stream), ``ChatTurn`` when it is done.

``Session.start_chat`` returns the handle; ``chat`` and ``achat`` wait on it. The
handle holds the scheduler's task and future, nothing of the session's state, so a
caller may keep it past the session's next turn.

Invariants: ``cancel`` frees the turn's row and slots and caches nothing; ``stop``
keeps the turn (it finishes at the next decode-chunk boundary, is parsed and cached).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from jaxkv.chat import ReplyFormat
from jaxkv.serving.scheduler import TurnTask


@dataclasses.dataclass
class ChatTurn:
    """The outcome of one chat turn.

    Attributes:
      reply: the parsed OpenAI-style assistant message.
      reply_ids: generated token ids (ending with a stop token when one came).
      prompt_tokens / cached_tokens: the rendered request and its radix-cache hit.
      finish_reason: ``"tool_calls"``, ``"stop"`` or ``"length"``.
      text: the reply text that was parsed (a forced prefix included, cut before
        a stop string); ``reply_ids`` then ends with the token that completed it.
      reply_margins: each reply token's top-2 logit margin when the session
        records them (``Session.record_margins``), else None.
    """

    reply: dict
    reply_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    text: str = ""
    reply_margins: object = None


class ChatHandle:
    """A submitted chat turn: ``result()`` waits for its ``ChatTurn``; ``cancel()``
    drops it (its row and slots are freed, nothing is cached); ``stop()`` ends the
    reply early but keeps the turn (it finishes, is parsed and cached);
    ``future`` for asyncio/executors.

    Attributes:
      format: the ``ReplyFormat`` the reply text is read with (streaming readers).
      prompt_tokens: size of the rendered request.
    """

    def __init__(
        self, task: TurnTask, future: concurrent.futures.Future, scheduler, format: ReplyFormat | None = None, prompt_tokens: int = 0
    ):
        self.task, self.future, self._scheduler = task, future, scheduler
        self.format = format or ReplyFormat()
        self.prompt_tokens = int(prompt_tokens)

    def result(self, timeout: float | None = None) -> ChatTurn:
        return self.future.result(timeout)

    def cancel(self) -> None:
        self._scheduler.cancel(self.task)

    def stop(self) -> None:
        """End the reply at the next decode-chunk boundary (``Turn.request_stop``)."""
        self.task.turn.request_stop()
