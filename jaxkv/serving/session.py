"""``Session``: one conversation's state, and its turns submitted to the scheduler.

A ``Session`` keeps only what belongs to the conversation: its id, options, stages
(retention, repair, ... built from its options), metrics, reports
(``compressions``, ``repairs``), and what its previous request cached. Everything
else lives in its ``Server``: a private one (``Session(model)``, one row) unless
one is passed (``Server(model, rows=8).session(...)``, or ``server=``).

A turn: the caller's thread renders the conversation (tags, spans, session id)
and checks its length, then submits a turn program (``jaxkv.serving.pipeline``)
to the server's scheduler and waits for it: ``chat`` blocks, ``achat`` awaits,
``start_chat`` returns a handle (future, cancel, streaming of tokens).
``replay`` feeds a recorded conversation turn by turn, teacher-forcing the
recorded assistant messages (optionally generating a reply at each assistant
turn for scoring, then discarding it), so evaluations do not depend on what a
small model happens to generate. ``fork`` copies a session that owns its server
(pool copied, weights shared), so an evaluation can branch after a shared prefix.

A private server lives as long as its session: ``close`` (or the session being
garbage-collected) stops its scheduler thread, which is what holds the pool.

Invariants: one turn at a time per session (``SessionBusyError`` otherwise);
sessions never share policy state (keys are session ids, ALGORITHMS §4); option
errors are ``ConfigError`` (unknown names: ``OptionError``) and are raised before
anything runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxkv.chat import ReplyFormat, derive_session_id, forced_call_prefix, render
from jaxkv.chat.render import chat_markers, tool_name
from jaxkv.chat.tags import Phase
from jaxkv.errors import ChatError, ConfigError, ContextLengthError, SessionBusyError
from jaxkv.metrics import Metrics
from jaxkv.models.loading import Model
from jaxkv.sampling import make_sampler
from jaxkv.serving.handles import ChatHandle, ChatTurn
from jaxkv.serving.pipeline import Turn, TurnResult, chat_turn, replay_turn
from jaxkv.serving.scheduler import TurnTask
from jaxkv.serving.server import Server
from jaxkv.serving.stages import build_stages
from jaxkv.serving.stages.repair import RepairStage
from jaxkv.serving.stages.repair import make_config as repair_config

REPAIR_OPTIONS = ("repair", "repair_policy", "repair_when", "repair_wrong_signal")


class Session:
    """One conversation. ``Session(model, **options)`` makes a private server.

    Options:
      server: share a ``Server`` (pool, radix cache, session store, scheduler).
      session_id: explicit session id (else derived, ALGORITHMS.md §4).
      keep_reasoning: render earlier reasoning too, so histories stay append-only.
      max_new_tokens: default reply budget for ``chat``.
      max_positions, num_slots, backend: sizing of a private server.
      cache_namespace: the radix-cache namespace of the session's requests
        (``Server.radix_for``): only sessions of the same namespace share cached
        prefixes (tenants of a shared server). None: the shared cache. Holes a
        session's policy makes are its own, whatever its namespace: other
        sessions reuse a cached prefix only up to them (``jaxkv.cache.radix``).
      protect_query: keep the actionable query (the latest user / tool message)
        out of eviction, as ALGORITHMS.md §1 forces (default). False lets an event
        evict inside it: for document QA where the document and the question
        arrive in one message (the RepairKV protocol's MQ-NIAH), so the first
        event compresses the document with the question's signal.
      policy, budget, layout, keep_sets, layer_budgets, events, **policy_config:
        the retention stage (``jaxkv.serving.stages.retention``): a method of
        ``jaxkv.policies.REGISTRY`` (None: full cache), the budget B, ``"dead_slot"``
        (default) or ``"compact"``, one kept set for the model (``keep_sets="model"``,
        default) or one per layer (``"layer"``, with ``layer_budgets="equal"``,
        ``"pyramid"`` or ``"shared"``: one budget the layers divide by score); a private server is built with a live list per layer, a
        shared one needs ``Server(layer_lists=True)``), when events fire
        (``events="always"``, default: whenever the history read exceeds B;
        ``"once"``: the session's first time only, then later turns just append,
        RepairKV still promoting at each turn boundary), and the policy's own
        options (``w=16``).
      repair, repair_policy, repair_when, repair_wrong_signal: the RepairKV stage
        (``jaxkv.serving.stages.repair``).
      kv_quant, kv_bits, kv_allocation, kv_rotate: the KV precision
        (``jaxkv.serving.stages.quantization``): None, ``"int4"``, ``"kivi2"``, ``"kivi4"`` or
        ``"triaxial"`` (a private server is built with that pool; on a shared
        server the session inherits its mode, and another mode is a ``ConfigError``).
      reuse, tenant, reuse_layers, halo, tau_seg, ...: cross-query segment reuse
        (``jaxkv.serving.stages.reuse``): None, ``"segment"`` or ``"cacheblend"``,
        the tenant whose segment namespace the session uses, and ``ReuseConfig``.
      Every other option goes to the registered stages
        (``jaxkv.serving.stages.STAGES``); one that no stage takes raises
        ``OptionError``.
    """

    def __init__(
        self,
        model: Model,
        *,
        server: Server | None = None,
        session_id: str | None = None,
        keep_reasoning: bool = False,
        max_new_tokens: int = 256,
        max_positions: int | None = None,
        num_slots: int | None = None,
        backend=None,
        protect_query: bool = True,
        cache_namespace: str | None = None,
        **options,
    ):
        if not isinstance(protect_query, bool):
            raise ConfigError(f"protect_query must be True or False, got {protect_query!r}")
        if server is not None and server.model is not model:
            raise ConfigError("a session's model must be its server's model")
        self.model = model
        self.tokenizer = model.tokenizer
        self.explicit_session_id = session_id
        self.keep_reasoning = keep_reasoning
        self.max_new_tokens = int(max_new_tokens)
        self.protect_query = protect_query
        self.cache_namespace = cache_namespace
        self.metrics = Metrics()
        self.session_id: str | None = None
        self.compressions: list = []  # CompressionReports of this session, in order
        self.repairs: list = []  # RepairReports, one per turn boundary repair ran at
        self._cached_ids: list[int] | None = None  # what this session's last request cached
        self.record_margins = False  # diagnostics: each reply token's top-2 logit margin (ChatTurn / TurnResult)
        self._requests = 0  # requests opened so far (the turn index of reports)
        self._busy = threading.Lock()
        self.server = server  # stages may read the shared server's settings (kv_quant)
        self.stages = build_stages(self, options)  # validates every option first
        self._owns_server = server is None
        quant = self._stage("kv_quant")
        retention = self._stage("retention")
        self.server = server or Server(
            model,
            max_positions=max_positions,
            num_slots=num_slots,
            backend=backend,
            kv_quant=quant.mode if quant else None,
            kv_rotate=bool(quant.rotate) if quant else False,
            layer_lists=retention is not None and retention.spec.keep_sets == "layer",
        )
        self.cache_owner = self.server.cache_owner()  # whose holes it reads (jaxkv.cache.radix): its own only
        self._watch_private_server()

    def _watch_private_server(self) -> None:
        """A private server stops with its session: its scheduler thread holds the
        engine (pool), so a dropped session would otherwise keep both forever."""
        self._server_finalizer = weakref.finalize(self, Server.close, self.server) if self._owns_server else None

    # -- copies (fork) ------------------------------------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_busy")
        state.pop("_server_finalizer", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._busy = threading.Lock()
        self._watch_private_server()

    # -- what the stages are ------------------------------------------------------
    def _stage(self, name: str):
        return next((s for s in self.stages if s.name == name), None)

    @property
    def retention(self):
        """The retention choice (``RetentionSpec``), or None for the full cache."""
        stage = self._stage("retention")
        return stage.spec if stage is not None else None

    @property
    def repair(self):
        """The RepairKV choice (``RepairConfig``), or None."""
        stage = self._stage("repair")
        return stage.config if stage is not None else None

    @property
    def quantization(self):
        """The quantization stage (``mode``, ``budget``, per-request ``records``),
        or None for full precision."""
        return self._stage("kv_quant")

    @property
    def reuse(self):
        """The segment-reuse stage (``config``, ``tenant``, per-prompt ``reports``),
        or None without cross-query reuse."""
        return self._stage("reuse")

    @property
    def repair_signal(self):
        """The latest request's repair ``Signal`` (post-RoPE query rows of its
        actionable query), or None before the first request or without repair."""
        stage = self._stage("repair")
        return stage.last_signal if stage is not None else None

    # -- chat ----------------------------------------------------------------------
    def start_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools=None,
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k=None,
        top_p=None,
        seed: int = 0,
        tool_choice=None,
        stop: Sequence[str] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        reply_prefix: str = "",
        ignore_eos: bool = False,
    ) -> ChatHandle:
        """Submit one chat turn; returns its handle at once. ``on_tokens(ids)`` is
        called (on the scheduler thread) with each newly generated piece.

        ``tool_choice`` (OpenAI's): ``"auto"`` (default), ``"none"`` (the request
        renders without ``tools`` and no call is parsed: call text stays in
        ``content``), ``"required"`` or ``{"type": "function", "function":
        {"name": N}}`` (the reply is forced to start a call, to any tool or to
        ``N``: the call's opening is prefilled with the prompt, in the template's
        format, and the model writes the rest). ``stop``: strings that end the
        reply; it is cut before the first one generated (``finish_reason``
        ``"stop"``) and decoding stops at the next decode-chunk boundary.
        ``reply_prefix``: text the reply is forced to start with (rendered after
        the generation prompt, like a forced tool call's opening); the returned
        ``content`` includes it. ``ignore_eos``: decode all ``max_new_tokens``,
        past the model's stop tokens (vLLM's option of that name; for benchmarks).
        ``ChatError`` for a malformed choice or stop
        list, or a reply prefix together with a forced tool choice."""
        render_tools, names, prefix = self._tool_choice(tools, tool_choice)
        if reply_prefix:
            if prefix:
                raise ChatError("reply_prefix cannot be combined with a forced tool_choice (both fix the reply's start)")
            prefix = str(reply_prefix)
        stops = _stop_strings(stop)
        rendered = self._render(messages, render_tools, add_generation_prompt=True, reply_prefix=prefix)
        n_new = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        make_sampler(temperature, top_k, top_p)
        self._check_length(rendered.ids.size, n_new)
        think_open = bool(rendered.ids.size) and int(rendered.phase[-1]) == Phase.THINK
        fmt = ReplyFormat(prefix, think_open, names, stops)
        turn = Turn(self, rendered)
        turn.ignore_eos = bool(ignore_eos)
        if stops:
            on_tokens = self._stop_watch(turn, fmt, on_tokens)
        if on_tokens is not None:
            turn.listener = on_tokens
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

        def finish(reply_ids):
            reply_ids = list(reply_ids)
            text = fmt.prefix + self.tokenizer.decode(reply_ids, skip_special_tokens=False)
            cut = fmt.find_stop(text)
            if cut is not None:  # keep the ids up to the one that completed the stop string
                k = next(
                    k
                    for k in range(1, len(reply_ids) + 1)
                    if fmt.find_stop(fmt.prefix + self.tokenizer.decode(reply_ids[:k], skip_special_tokens=False)) is not None
                )
                reply_ids, text = reply_ids[:k], text[:cut]
            reply = fmt.parse(text)
            stopped = cut is not None or turn.stop_requested or (bool(reply_ids) and reply_ids[-1] in turn.stop_token_ids)
            reason = "tool_calls" if reply.get("tool_calls") else ("stop" if stopped or n_new == 0 else "length")
            margins = np.asarray(turn.reply_margins[: len(reply_ids)], np.float32) if turn.record_margins else None
            return ChatTurn(reply, reply_ids, int(rendered.ids.size), turn.reused, reason, text, margins)

        handle = self._submit(chat_turn(turn, n_new, sampling), turn, rendered.ids.size + n_new, finish)
        handle.format, handle.prompt_tokens = fmt, int(rendered.ids.size)
        return handle

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools=None,
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k=None,
        top_p=None,
        seed: int = 0,
        tool_choice=None,
        stop: Sequence[str] | None = None,
        reply_prefix: str = "",
        ignore_eos: bool = False,
    ) -> dict:
        """Answer ``messages``: an OpenAI-style assistant message dict."""
        handle = self.start_chat(
            messages,
            tools,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            tool_choice=tool_choice,
            stop=stop,
            reply_prefix=reply_prefix,
            ignore_eos=ignore_eos,
        )
        return handle.result().reply

    async def achat(self, messages: Sequence[Mapping[str, Any]], tools=None, **kwargs) -> dict:
        """``chat`` for asyncio: awaits the turn without blocking the loop;
        cancelling the awaiting task cancels the turn."""
        handle = self.start_chat(messages, tools, **kwargs)
        try:
            turn = await asyncio.wrap_future(handle.future)
        except asyncio.CancelledError:
            handle.cancel()
            raise
        return turn.reply

    # -- replay ----------------------------------------------------------------------
    def replay(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools=None,
        *,
        generate: bool = False,
        max_new_tokens: int | None = None,
        return_logits: bool | str = False,
        start_turn: int = 0,
        reply_margins: bool = False,
    ) -> list[TurnResult]:
        """Feed a recorded conversation turn by turn (see the module docstring).

        ``start_turn``: skip the first ``start_turn`` assistant turns, which this
        session (or the session it was forked from) has already replayed; one
        ``TurnResult`` per replayed turn. ``reply_margins``: record each generated
        token's top-2 logit margin (``TurnResult.reply_margins``; the decode
        calls then bring back logits, a separate compiled program).
        ``return_logits``: ``True`` keeps every prefilled prompt row's logits and
        the recorded reply's; ``"reply"`` keeps the reply's and only the prompt's
        last row (``prompt_logits`` ``[1, V]``, which predicts the reply's first
        token): what teacher-forced scoring reads, without the vocabulary
        projection of every prompt row (~a fifth of a SmolLM2 prefill) or its
        ``[T, V]`` array."""
        if start_turn < 0:
            raise ValueError(f"start_turn must be >= 0, got {start_turn}")
        results = []
        n_new = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        names = [tool_name(t) for t in tools] if tools else None
        assistant_at = [j for j, m in enumerate(messages) if m.get("role") == "assistant"]
        for j in assistant_at[start_turn:]:
            prompt = self._render(messages[:j], tools, add_generation_prompt=True)
            full = self._render(messages[: j + 1], tools, add_generation_prompt=False)
            self._check_length(max(full.ids.size, prompt.ids.size + (n_new if generate else 0)), 0)
            turn = Turn(self, prompt)
            turn.record_margins = bool(reply_margins) or self.record_margins
            program = replay_turn(turn, full.ids, full.phase, generate=generate, n_new=n_new, return_logits=return_logits)
            need = full.ids.size + (n_new if generate else 0)
            result, reply = self._submit(program, turn, need, lambda out: out).result()
            if reply is not None:
                think_open = bool(prompt.ids.size) and int(prompt.phase[-1]) == Phase.THINK
                fmt = ReplyFormat(think_open=think_open, tool_names=tuple(names) if names is not None else None)
                result.generated = fmt.parse(self.tokenizer.decode(reply, skip_special_tokens=False))
            results.append(result)
        return results

    # -- lifecycle ---------------------------------------------------------------------
    def fork(self, **repair_options) -> "Session":
        """An independent copy of this conversation and its private server.

        The copy has the same cached tokens (pool, slot maps, radix cache with its
        holes), host tier, policy state, metrics and repair history; turns run on
        either afterwards leave the other untouched. Evaluations use it to branch
        after a shared prefix: the RepairKV protocol replays turn 1 once and every
        repair policy from there, which equals replaying each from scratch (the
        first request never repairs: nothing was shelved before it).

        ``repair_options`` (``repair``, ``repair_policy``, ``repair_when``,
        ``repair_wrong_signal``) change the copy's repair choice from its next
        turn on, validated as in ``Session(...)``. Only a session with its own
        server can fork (``ConfigError`` otherwise: a shared server holds other
        sessions' state). The model's weights are shared, the pool is copied.
        """
        import copy

        import jax
        import jax.numpy as jnp

        if not self._owns_server:
            raise ConfigError("only a session with its own server can fork (this one shares a Server)")
        unknown = set(repair_options) - set(REPAIR_OPTIONS)
        if unknown:
            raise ConfigError(f"fork changes only the repair options, not {', '.join(sorted(unknown))}")
        old = self._stage("repair")
        current = old.config if old is not None else None
        config = repair_config(
            repair_options.get("repair", current.k if current else None),
            repair_options.get("repair_policy", current.policy if current else "repairkv"),
            repair_options.get("repair_when", current.when if current else "turn"),
            self._stage("retention"),
        )
        engine = self.server.engine
        if engine.closed:
            raise ConfigError("cannot fork a closed session (its server's KV pool was freed)")
        if not self.server.scheduler.idle() or any(state is not None for state in engine.row_state):
            raise ConfigError("cannot fork a session in the middle of a turn (a cache row is open)")
        memo = {id(x): x for x in (self.model, self.tokenizer, engine.runner.params, engine.runner.graphdef)}
        memo[id(engine.cache)] = jax.tree.map(jnp.copy, engine.cache)  # the pool is donated by later updates
        twin = copy.deepcopy(self, memo)
        twin_old = twin._stage("repair")
        stages = [s for s in twin.stages if s.name != "repair"]
        if config is not None:
            wrong = repair_options.get("repair_wrong_signal", twin_old.wrong_signal if twin_old else None)
            stage = RepairStage(config, wrong)
            stage.order = twin_old.order if twin_old else 30
            if twin_old is not None:
                stage.last_signal, stage.last_tokens = twin_old.last_signal, twin_old.last_tokens
            stages.append(stage)
        twin.stages = sorted(stages, key=lambda s: s.order)
        return twin

    def close(self) -> None:
        """End the session: release its host-tier rows and repair signal, and stop
        its private server (a shared server keeps running). Idempotent."""
        if self.session_id is not None and not self.closed:
            sid, server = self.session_id, self.server

            def release():
                server.host_tier.drop_session(sid)
                server.repair_signals.pop(sid, None)

            server.scheduler.call(release).result()
        if self._server_finalizer is not None:
            self._server_finalizer()  # Server.close, once

    @property
    def closed(self) -> bool:
        """Whether this session's private server was stopped (``close``)."""
        return self._server_finalizer is not None and not self._server_finalizer.alive

    # -- helpers -------------------------------------------------------------------------
    def _tool_choice(self, tools, choice):
        """``(tools to render, tool names a call may use, forced reply prefix)``."""
        names = tuple(tool_name(t) for t in tools) if tools else None
        if choice is None or choice == "auto":
            return tools, names, ""
        if choice == "none":
            return None, (), ""
        if choice == "required":
            name = None
        elif (
            isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping) and isinstance(choice["function"].get("name"), str)
        ):
            name = choice["function"]["name"]
        else:
            raise ChatError(
                f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}"
            )
        if not names:
            raise ChatError(f"tool_choice {choice!r} needs tools")
        if name is not None and name not in names:
            raise ChatError(f"tool_choice names {name!r}, which is not in tools {list(names)}")
        try:
            prefix = forced_call_prefix(chat_markers(self.tokenizer).layout, name)
        except ValueError as err:
            raise ChatError(f"tool_choice {choice!r}: {err}") from None
        return tools, names if name is None else (name,), prefix

    @staticmethod
    def _stop_watch(turn, fmt: ReplyFormat, listener):
        """A listener that stops the turn once a stop string is generated (then
        passes the tokens on to ``listener``)."""
        tokenizer = turn.session.tokenizer
        generated: list[int] = []

        def watch(ids):
            generated.extend(ids)
            if listener is not None:
                listener(ids)
            if not turn.stop_requested and fmt.find_stop(fmt.prefix + tokenizer.decode(generated, skip_special_tokens=False)) is not None:
                turn.request_stop()

        return watch

    def _render(self, messages, tools, *, add_generation_prompt, reply_prefix: str = ""):
        rendered = render(
            self.tokenizer,
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            keep_reasoning=self.keep_reasoning,
            reply_prefix=reply_prefix,
        )
        if self.session_id is None:
            self.session_id = derive_session_id(rendered.ids, rendered.spans.session_span, explicit=self.explicit_session_id)
        return rendered

    def _check_length(self, prompt_tokens: int, new_tokens: int) -> None:
        limit = min(self.model.config.max_position_embeddings, self.server.engine.max_positions)
        if prompt_tokens + new_tokens > limit:
            raise ContextLengthError(
                f"conversation of {prompt_tokens} tokens + {new_tokens} new tokens exceeds the context of {limit} tokens"
            )

    def _reservation(self, tokens: int) -> int:
        """Slots a turn of ``tokens`` prompt + reply tokens may allocate: doubled for
        a compact layout (kept rows are copied before the old ones go), plus K for
        repair, plus a reconstruction pass's input for a policy that runs them
        (KVzip: ``reconstruction.slots_needed``; each pass's slots are freed before
        the next)."""
        need = int(tokens)
        spec = self.retention
        if spec is not None and spec.layout == "compact":
            need *= 2
        if self.repair is not None:
            need += self.repair.k
        if spec is not None and spec.policy.needs(spec.config).reconstruction:
            from jaxkv.serving.stages.reconstruction import slots_needed

            need += slots_needed(spec.config, self.tokenizer, tokens)
        return need

    def _submit(self, program, turn, tokens: int, finish) -> ChatHandle:
        """Submit a turn program; the session stays busy until it ends."""
        if not self._busy.acquire(blocking=False):
            program.close()
            raise SessionBusyError(f"session {self.session_id!r} is already running a turn")
        out: concurrent.futures.Future = concurrent.futures.Future()
        spec = self.retention
        task = TurnTask(program, turn, self._reservation(tokens), credit_reuse=spec is None or spec.layout != "compact")
        listener = getattr(turn, "listener", None)
        if listener is not None:
            task.on_progress = turn.progress
        try:
            inner = self.server.scheduler.submit(task)
        except BaseException:
            self._busy.release()
            program.close()
            raise

        def done(f: concurrent.futures.Future):
            self._busy.release()
            if f.cancelled():
                out.cancel()
                return
            err = f.exception()
            if err is not None:
                out.set_exception(err)
                return
            try:
                out.set_result(finish(f.result()))
            except BaseException as e:  # a parse bug must still resolve the caller
                out.set_exception(e)

        inner.add_done_callback(done)
        return ChatHandle(task, out, self.server.scheduler)


def _stop_strings(stop) -> tuple[str, ...]:
    """OpenAI's ``stop``: None, one string or a list of strings (empty ones ignored)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (bytes, Mapping)) or not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise ChatError(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(s for s in stop if s)


Server.session_type = Session  # ``Server.session`` builds sessions of this module (see there)
