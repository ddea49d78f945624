"""Agent sessions: multi-turn chat over the engine with radix prefix reuse.

A ``Server`` owns what sessions share: one ``Engine`` (pool + rows), one radix
prefix cache over the pool, and an LRU ``SessionStore`` of per-session policy
state. A ``Session`` is one conversation on a server (its own server unless one
is passed). One turn (``Session.chat``):

  render (chat template + tags + spans) -> context check -> radix match (reused
  slots, holes included, path locked) -> open a row with the matched prefix ->
  prefill only the suffix -> decode until a stop token -> parse the reply
  (content / reasoning / tool calls) -> insert the turn's tokens into the radix
  cache -> close the row, unlock -> metrics.

``Session.replay`` feeds a recorded conversation turn by turn, teacher-forcing
the recorded assistant messages (and optionally generating a reply at each
assistant turn for scoring, then discarding it), so evaluations do not depend on
what a small model happens to generate.

Invariants: at least one prompt token is always prefilled (its logits start the
reply), so a fully cached prompt reuses all but its last token; a request's
references on its slots are dropped when its turn ends, the radix cache keeps
its own; sessions never share policy state (keys are session ids, ALGORITHMS §4).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.radix import RadixTree
from jaxkv.cache.session_store import SessionStore
from jaxkv.chat import derive_session_id, parse_assistant, render
from jaxkv.chat.render import tool_name
from jaxkv.engine import Engine
from jaxkv.errors import ConfigError, ContextLengthError
from jaxkv.metrics import Metrics
from jaxkv.models.loading import Model
from jaxkv.sampling import make_sampler, sample


class Server:
    """Shared serving state for many sessions.

    Args:
      model: a loaded ``Model`` with a tokenizer.
      max_positions: positions per request (default: model context, at most 8192).
      num_slots: pool slots (default: ``2 * rows * max_positions + 1``, room for
        cached prefixes beside running requests).
      rows: concurrent requests.
      session_cap: how many sessions' policy state the LRU store keeps.
    """

    def __init__(self, model: Model, *, max_positions: int | None = None, num_slots: int | None = None, rows: int = 1, session_cap: int = 1024, backend=None):
        if model.tokenizer is None:
            raise ConfigError("sessions need a model with a tokenizer (the folder had none)")
        P = int(max_positions or min(model.config.max_position_embeddings, 8192))
        self.model = model
        self.engine = Engine(
            model, rows=rows, max_positions=P, num_slots=num_slots or 2 * rows * P + 1, backend=backend,
        )
        self.radix = RadixTree(self.engine.allocator)
        self.engine.reclaim = self.radix.evict
        self.store = SessionStore(session_cap)
        tok = model.tokenizer
        stops = set(model.config.eos_token_ids)
        for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|eom_id|>"):
            tid = tok.convert_tokens_to_ids(name) if name in tok.get_vocab() else None
            if tid is not None:
                stops.add(int(tid))
        if tok.eos_token_id is not None:
            stops.add(int(tok.eos_token_id))
        self.stop_token_ids = frozenset(stops)

    def session(self, **options) -> "Session":
        return Session(self.model, server=self, **options)


@dataclasses.dataclass
class TurnResult:
    """One replayed assistant turn.

    Attributes:
      prompt_ids: the rendered request (history + generation prompt).
      prefix_hit: prompt tokens reused from the radix cache.
      prompt_logits: ``[len(prompt) - prefix_hit, V]`` logits of the prefilled
        suffix (only when ``return_logits``).
      target_ids / target_logits: the recorded assistant message's tokens and
        their teacher-forced logits (``return_logits``).
      generated: the parsed reply generated at this turn (``generate=True``).
    """

    prompt_ids: np.ndarray
    prefix_hit: int
    prompt_logits: np.ndarray | None = None
    target_ids: np.ndarray | None = None
    target_logits: np.ndarray | None = None
    generated: dict | None = None


class Session:
    """One conversation. ``Session(model, **options)`` makes a private server.

    Options:
      server: share a ``Server`` (pool, radix cache, session store) with others.
      session_id: explicit session id (else derived, ALGORITHMS.md §4).
      keep_reasoning: render earlier reasoning too, so histories stay append-only.
      max_new_tokens: default reply budget for ``chat``.
      max_positions, num_slots: sizing of a private server.
    """

    def __init__(self, model: Model, *, server: Server | None = None, session_id: str | None = None, keep_reasoning: bool = False, max_new_tokens: int = 256, max_positions: int | None = None, num_slots: int | None = None, backend=None):
        self.server = server or Server(model, max_positions=max_positions, num_slots=num_slots, backend=backend)
        if self.server.model is not model:
            raise ConfigError("a session's model must be its server's model")
        self.model = model
        self.tokenizer = model.tokenizer
        self.explicit_session_id = session_id
        self.keep_reasoning = keep_reasoning
        self.max_new_tokens = max_new_tokens
        self.metrics = Metrics()
        self.session_id: str | None = None

    # ------------------------------------------------------------------ public
    def chat(self, messages: Sequence[Mapping[str, Any]], tools=None, *, max_new_tokens: int | None = None, temperature: float = 0.0, top_k=None, top_p=None, seed: int = 0) -> dict:
        """Answer ``messages``: an OpenAI-style assistant message dict."""
        rendered = self._render(messages, tools, add_generation_prompt=True)
        n_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        make_sampler(temperature, top_k, top_p)
        self._check_length(rendered.ids.size, n_new)
        turn = self._open(rendered.ids)
        try:
            logits = turn.prefill(rendered.ids[turn.reused:])
            reply_ids = turn.generate(logits, n_new, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
            turn.insert()
        finally:
            turn.close()
        text = self.tokenizer.decode(reply_ids, skip_special_tokens=False)
        names = [tool_name(t) for t in tools] if tools else None
        return parse_assistant(text, names)

    def replay(self, messages: Sequence[Mapping[str, Any]], tools=None, *, generate: bool = False, max_new_tokens: int | None = None, return_logits: bool = False) -> list[TurnResult]:
        """Feed a recorded conversation turn by turn (see the module docstring)."""
        results = []
        n_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        for j, msg in enumerate(messages):
            if msg.get("role") != "assistant":
                continue
            prompt = self._render(messages[:j], tools, add_generation_prompt=True)
            full = self._render(messages[: j + 1], tools, add_generation_prompt=False).ids
            self._check_length(max(full.size, prompt.ids.size + (n_new if generate else 0)), 0)
            turn = self._open(prompt.ids)
            try:
                logits = turn.prefill(prompt.ids[turn.reused:], all_logits=return_logits)
                result = TurnResult(prompt.ids, turn.reused, logits if return_logits else None)
                if generate:
                    reply = turn.generate(logits[-1] if return_logits else logits, n_new)
                    text = self.tokenizer.decode(reply, skip_special_tokens=False)
                    result.generated = parse_assistant(text, [tool_name(t) for t in tools] if tools else None)
                    turn.rewind(prompt.ids.size)
                if full[: prompt.ids.size].tolist() == prompt.ids.tolist() and full.size > prompt.ids.size:
                    target = full[prompt.ids.size:]
                    target_logits = turn.prefill(target, all_logits=return_logits)
                    result.target_ids = target
                    if return_logits:
                        result.target_logits = target_logits
                turn.insert()
            finally:
                turn.close()
            results.append(result)
        return results

    # ------------------------------------------------------------------ helpers
    def _render(self, messages, tools, *, add_generation_prompt):
        rendered = render(self.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt, keep_reasoning=self.keep_reasoning)
        if self.session_id is None:
            self.session_id = derive_session_id(rendered.ids, rendered.spans.session_span, explicit=self.explicit_session_id)
        return rendered

    def _check_length(self, prompt_tokens: int, new_tokens: int) -> None:
        limit = min(self.model.config.max_position_embeddings, self.server.engine.max_positions)
        if prompt_tokens + new_tokens > limit:
            raise ContextLengthError(
                f"conversation of {prompt_tokens} tokens + {new_tokens} new tokens exceeds the "
                f"context of {limit} tokens"
            )

    def _open(self, ids: np.ndarray) -> "_Turn":
        return _Turn(self, ids)


class _Turn:
    """One request's life on the engine: matched prefix, row, accounting."""

    def __init__(self, session: Session, ids: np.ndarray):
        self.session = session
        self.server = session.server
        self.engine = self.server.engine
        match = self.server.radix.match(ids)
        self.handle = match.handle
        self.reused = min(match.length, ids.size - 1)  # always prefill >= 1 token
        try:
            self.row = self.engine.open_row(match.slots[: self.reused])
        except Exception:
            self.server.radix.unlock(self.handle)
            raise
        self.tokens: list[int] = ids[: self.reused].tolist()
        session.metrics.start_request(prompt_tokens=int(ids.size), prefix_hit_tokens=self.reused, session_id=session.session_id)

    def prefill(self, ids, *, all_logits=False):
        ids = np.asarray(ids).tolist()
        out = self.engine.prefill([self.row], [ids], all_logits=all_logits)[0]
        self.tokens += ids
        self._observe()
        return out

    def generate(self, last_logits, n_new, *, temperature=0.0, top_k=None, top_p=None, seed=0):
        if n_new <= 0:
            return []
        spec, temp, top_p_val = make_sampler(temperature, top_k, top_p)
        key = jax.random.key(seed)
        first = int(sample(jnp.asarray(last_logits)[None], jax.random.fold_in(key, 1 << 30), spec, temp, top_p_val)[0])
        reply = [first]
        stops = self.server.stop_token_ids
        if first not in stops and n_new > 1:
            state = self.engine.row_state[self.row]
            raw0, eff0 = state.seq_len, len(state.live)
            tokens, _ = self.engine.decode(
                [self.row], [first], n_new - 1, temperature=temperature, top_k=top_k, top_p=top_p,
                key=key, stop_token_ids=stops,
            )
            reply += tokens[0]
            n_fed = len(tokens[0])
            self.tokens += reply[:n_fed]
            for s in range(1, n_fed + 1):  # each step attends to everything so far + itself
                self.session.metrics.on_decode_step(raw_attended=raw0 + s, effective_attended=eff0 + s)
        self._observe()
        return reply

    def rewind(self, length: int) -> None:
        self.engine.truncate_row(self.row, length)
        self.tokens = self.tokens[:length]

    def insert(self) -> None:
        state = self.engine.row_state[self.row]
        self.server.radix.insert(self.tokens, state.slots[: len(self.tokens)])

    def _observe(self):
        state = self.engine.row_state[self.row]
        self.session.metrics.on_live(len(state.live))

    def close(self) -> None:
        try:
            self.engine.close_row(self.row)
        finally:
            self.server.radix.unlock(self.handle)
            self.session.metrics.end_request()
