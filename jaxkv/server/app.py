"""The FastAPI app: OpenAI routes over one ``jaxkv.Server``.

``create_app(server, config)`` builds it; the app only turns requests into
session turns and turns back into responses. A chat request:

1. authenticate (tenant), read and check the body (``protocol``), check the model;
2. in a worker thread: render the request (``jaxkv.chat.render``: the
   messages' structure is checked there), derive its session key, size its
   reply;
3. check out its session from the store (tenant-namespaced, options resolved
   against the allow-list by ``OptionRules.resolve``; a new session is built with
   the tenant's radix namespace and segment-reuse tenant, and any ``JaxKVError``
   building it is a 400), wait for the session's previous turn (its lock), submit
   the turn (``Session.start_chat``; the queue, context and pool checks raise
   here, before any response starts);
4. await ``asyncio.wrap_future(handle.future)``, or stream: ``on_tokens`` runs on
   the scheduler thread and hands the ids to the event loop
   (``loop.call_soon_threadsafe``), where ``ReplyStream`` turns them into SSE
   chunks; a stream silent for ``ServeConfig.keepalive_s`` (15 s: a long CPU
   prefill sends nothing for minutes) gets an SSE comment, ``: keep-alive``,
   which keeps idle-closing proxies from dropping it and which SSE clients
   skip. Streamed or not, ``on_tokens`` also times the tokens
   (``metrics.TokenTimes``), and the turn's end records its queue wait;
5. as the turn ends (on the scheduler thread, before the session's lock is
   released), ``sessions.turn_report`` reads what its mechanisms did; the
   response carries it as ``jaxkv`` (a stream: in its usage chunk).

Invariants: the event loop never runs the model or touches the engine; a
request's session lock is released when its turn ends, whatever happens to the
HTTP exchange (a done-callback of the turn's future); a client that goes away
(disconnect while waiting or streaming) cancels its turn (``handle.cancel()``:
row and slots freed); every error is an ``APIError`` body, and a 500 only comes
from a bug.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxkv.chat import forced_call_prefix, render
from jaxkv.chat.render import chat_markers
from jaxkv.server import metrics as prom
from jaxkv.server.errors import APIError, from_exception, invalid
from jaxkv.errors import JaxKVError
from jaxkv.server.protocol import (
    KEEPALIVE,
    KEEPALIVE_S,
    SESSION_OPTIONS,
    ChatRequest,
    chunk,
    completion,
    message_of,
    new_id,
    parse_chat_request,
    usage,
)
from jaxkv.server.sessions import PUBLIC, OptionRules, SessionStore, Tenants, cache_namespace, ledger, session_key, turn_report
from jaxkv.server.streaming import ReplyStream

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send temperature=0 for greedy replies


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the HTTP layer serves, beyond the ``Server``'s own sizing.

    Attributes:
      model_name: the id of the one model (``/v1/models``; requests must name it).
      api_keys: accepted Bearer keys (empty: no authentication, one tenant).
      rules: session defaults and the overrides a request may make (``OptionRules``).
      max_tokens: reply budget of a request that names none (capped by the context).
      session_cap: live sessions the store keeps (LRU).
      max_waiting: requests that may wait on one busy session before a 409.
      keepalive_s: seconds a stream may go without a byte before the server
        sends an SSE comment (``: keep-alive``), so that proxies and clients with
        idle timeouts keep the connection while a long prefill (minutes on a CPU)
        runs; clients skip comment lines. ``None`` or 0: never.
    """

    model_name: str
    api_keys: tuple = ()
    rules: OptionRules = OptionRules()
    max_tokens: int = 256
    session_cap: int = 1024
    max_waiting: int = 8
    keepalive_s: float | None = KEEPALIVE_S


class ServingState:
    """The app's state: the ``Server``, tenants, the session store, counters and
    the metrics registry (``metrics.ServerMetrics``)."""

    def __init__(self, server, config: ServeConfig):
        self.server = server
        self.config = config
        self.tokenizer = server.model.tokenizer
        self.tenants = Tenants(config.api_keys)
        self.store = SessionStore(self._make_session, lambda s: s.close(), config.session_cap, config.max_waiting)
        self.rate = prom.TokenRate()
        self.metrics = prom.ServerMetrics()
        self.responses: collections.Counter = collections.Counter()
        self.mechanisms = collections.Counter(reused_tokens=0)  # summed turn reports (/metrics); keys fixed up front
        self.turn_seconds = 1.0  # moving average of turn latency (Retry-After)
        self.limit = min(server.model.config.max_position_embeddings, server.max_positions)

    def _make_session(self, key, options):
        """A session of ``key = (tenant, session key)``: its ids, radix namespace
        (``cache_namespace``: the tenant's, split by KV precision) and segment-reuse
        tenant are the tenant's. A ``JaxKVError`` while building it
        (options the stages refuse together) is a 400, never a 500."""
        tenant, sid = key
        namespace = cache_namespace(tenant if self.tenants.enabled else None, options, self.config.rules)
        scoped = {"tenant": tenant} if options.get("reuse") else {}  # segments stored and matched per tenant
        try:
            return self.server.session(session_id=f"{tenant}/{sid}", cache_namespace=namespace, **options, **scoped)
        except JaxKVError as err:
            param = next((name for name in SESSION_OPTIONS if name in str(err)), None)
            raise invalid(f"these session options cannot run together on this server: {err}", param) from None

    def retry_after(self) -> int:
        waiting = self.server.scheduler.queue_depth + 1
        return int(min(60, max(1, math.ceil(self.turn_seconds * waiting / self.server.engine.rows))))

    def error(self, err: BaseException) -> APIError:
        api = from_exception(err, retry_after=self.retry_after())
        if api.status >= 500:
            log.error("request failed: %s", api, exc_info=err if api.status == 500 else None)
        return api


# ============================================================================ helpers
def _json_error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _with_keepalive(queue: asyncio.Queue, every: float | None):
    """The items of ``queue`` up to ``None``, and ``KEEPALIVE`` in between whenever
    ``every`` seconds pass without one. One ``queue.get()`` is awaited across the
    waits, never cancelled, so no item can be lost to a timeout."""
    while True:
        getter = asyncio.ensure_future(queue.get())
        try:
            while not getter.done():
                await asyncio.wait((getter,), timeout=every or None)
                if not getter.done():
                    yield KEEPALIVE
        finally:
            getter.cancel()  # the stream was closed while waiting
        item = getter.result()
        if item is None:
            return
        yield item


class _CountResponses:
    """ASGI middleware counting responses by status (safe with streaming)."""

    def __init__(self, app, counts: collections.Counter):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.counts[message["status"]] += 1
            await send(message)

        await self.app(scope, receive, counted)


async def _cancel_on_disconnect(request: Request, handle) -> None:
    """Cancel ``handle`` when the client goes away (the body is already read, so
    the next ASGI message is the disconnect; after the response it is too, when
    cancelling a finished turn does nothing)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


@dataclasses.dataclass
class _Prepared:
    key: str  # the session key (explicit or derived)
    n_new: int  # reply budget


def _prepare(state: ServingState, req: ChatRequest, explicit: str | None) -> _Prepared:
    """Render the request once (its structure checked), its session key and
    reply budget. Runs in a worker thread."""
    tools = None if req.tool_choice == "none" else req.tools
    prefix = ""
    if req.tool_choice not in (None, "none"):
        name = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
        with contextlib.suppress(ValueError):  # unknown template: the session refuses the choice
            prefix = forced_call_prefix(chat_markers(state.tokenizer).layout, name)
    rendered = render(
        state.tokenizer,
        req.messages,
        tools,
        add_generation_prompt=True,
        keep_reasoning=state.config.rules.keep_reasoning,
        reply_prefix=prefix,
    )
    n_new = req.max_tokens
    if n_new is None:
        n_new = min(state.config.max_tokens, state.limit - int(rendered.ids.size))
        if n_new < 1:
            n_new = state.config.max_tokens  # the session reports the overflow (context_length_exceeded)
    return _Prepared(session_key(rendered, explicit), int(n_new))


# ============================================================================ the app
def create_app(server, config: ServeConfig, *, own_server: bool = False) -> FastAPI:
    """The OpenAI-compatible app over ``server`` (module docstring).
    ``own_server``: close the ``Server`` when the app shuts down."""
    state = ServingState(server, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def sample():
            while True:
                state.rate.sample(server.scheduler.stats["tokens_generated"])
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        try:
            yield
        finally:
            sampler.cancel()
            if own_server:
                await asyncio.to_thread(server.close)

    app = FastAPI(title="jaxkv", description="OpenAI-compatible chat completions on jaxkv's managed KV cache.", lifespan=lifespan)
    app.state.jaxkv = state
    app.add_middleware(_CountResponses, counts=state.responses)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        return _json_error(err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException):
        kind = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}
        type_, code = kind.get(err.status_code, ("invalid_request_error", None))
        return _json_error(APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", type_, None, code))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, err: Exception):
        return _json_error(state.error(err))

    def tenant(request: Request) -> str:
        return state.tenants.authenticate(request.headers.get("authorization"))

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": 0, "owned_by": "jaxkv"}

    @app.get("/health")
    async def health():
        """Ok while the scheduler thread answers (it runs between engine steps)."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(server.scheduler.call(lambda: None)), timeout=10.0)
        except Exception as err:  # timed out or stopped
            return JSONResponse({"status": "unavailable", "reason": f"{type(err).__name__}: {err}"}, status_code=503)
        return {"status": "ok", "model": config.model_name}

    @app.get("/v1/models")
    async def models(request: Request):
        tenant(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request):
        tenant(request)
        if model != config.model_name:
            raise APIError(404, f"the model {model!r} does not exist", "not_found_error", "model", "model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics(request: Request):
        tenant(request)
        snap = await asyncio.wrap_future(server.scheduler.call(server.snapshot))
        state.rate.sample(snap.get("tokens_generated", 0))
        scraped = prom.ServerState(snap, len(state.store), state.rate.rate(), dict(state.responses), dict(state.mechanisms))
        return Response(state.metrics.exposition(scraped), media_type=prom.CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrived = time.perf_counter()  # time to first token counts from here
        who = tenant(request)
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as err:
            raise invalid(f"the request body is not valid JSON: {err}", None, "invalid_json") from None
        req = parse_chat_request(body)
        if req.model != config.model_name:
            raise APIError(
                404,
                f"the model {req.model!r} does not exist (this server serves {config.model_name!r})",
                "not_found_error",
                "model",
                "model_not_found",
            )
        explicit = req.session_id or request.headers.get("x-session-id") or None
        if explicit is not None and len(explicit) > 256:
            raise invalid("the session id must be at most 256 characters", "session_id")
        options = config.rules.resolve(req.options)
        try:
            prepared = await asyncio.to_thread(_prepare, state, req, explicit)
        except Exception as err:
            raise state.error(err) from None
        if prepared.key.startswith("local:"):  # nothing to key a session on: a one-request session
            raise invalid("the request has no tokens to derive a session from", "messages")
        try:
            entry = state.store.checkout((who, prepared.key), options, set(req.options))
        except APIError:
            raise
        except Exception as err:
            raise state.error(err) from None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue | None = asyncio.Queue() if req.stream else None
        released = False

        def release(*_):
            nonlocal released
            if not released:
                released = True
                entry.lock.release()
                state.store.checkin(entry)

        try:
            await entry.lock.acquire()
        except BaseException:
            state.store.checkin(entry)
            raise
        temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
        seed = req.seed if req.seed is not None else (secrets.randbelow(1 << 31) if temperature > 0 else 0)
        token_times = state.metrics.token_times(arrived)

        def on_tokens(ids):  # scheduler thread: time the tokens, hand them to the stream
            token_times.on_tokens(ids)
            if queue is not None:
                loop.call_soon_threadsafe(queue.put_nowait, ids)

        started = time.perf_counter()

        report: dict = {}  # what the mechanisms did (turn_report), filled as the turn ends

        def start():  # worker thread: render + submit (the scheduler's checks raise here)
            before = ledger(entry.session)
            handle = entry.session.start_chat(
                req.messages,
                req.tools,
                max_new_tokens=prepared.n_new,
                temperature=temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                seed=seed,
                tool_choice=req.tool_choice,
                stop=req.stop,
                on_tokens=on_tokens,
                ignore_eos=req.ignore_eos,
            )

            def ended(f):  # the scheduler thread, while the session lock is still held
                try:
                    if not f.cancelled() and f.exception() is None:
                        report.update(turn_report(entry.session, before))
                        state.mechanisms["reused_tokens"] += report["reused_tokens"]
                except Exception:  # a report must never keep the session locked
                    log.exception("reading the turn's report failed")
                finally:
                    loop.call_soon_threadsafe(finished, handle)

            handle.future.add_done_callback(ended)
            return handle

        def finished(handle):
            state.metrics.observe_queue_wait(handle.task)
            state.turn_seconds = 0.8 * state.turn_seconds + 0.2 * (time.perf_counter() - started)
            if queue is not None:
                queue.put_nowait(None)  # after every token the turn emitted
            release()

        try:
            handle = await asyncio.to_thread(start)
        except BaseException as err:
            release()
            if isinstance(err, Exception):
                raise state.error(err) from None
            raise
        headers = {"X-Session-Id": explicit} if explicit else {}
        rid = new_id("chatcmpl-")
        if req.stream:
            return StreamingResponse(
                _stream(state, req, handle, queue, rid, report),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
                background=BackgroundTask(handle.cancel),  # a stream that never started: drop its turn
            )
        watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
        try:
            turn = await asyncio.wrap_future(handle.future)
        except asyncio.CancelledError:
            handle.cancel()
            raise
        except Exception as err:
            raise state.error(err) from None
        finally:
            watcher.cancel()
        use = usage(turn.prompt_tokens, len(turn.reply_ids), turn.cached_tokens)
        body = completion(rid, config.model_name, message_of(turn.reply), turn.finish_reason, use)
        body["jaxkv"] = report
        return JSONResponse(body, headers=headers)

    return app


async def _stream(state: ServingState, req: ChatRequest, handle, queue: asyncio.Queue, rid: str, report: dict):
    """The SSE body of a streamed turn (module docstring of ``streaming``)."""
    model, created = state.config.model_name, int(time.time())
    extra = {"include_usage": req.include_usage}
    stream = ReplyStream(state.tokenizer, handle.format, lambda: new_id("call_"))
    try:
        yield _sse(chunk(rid, model, created, {"role": "assistant", "content": ""}, **extra))
        async with contextlib.aclosing(_with_keepalive(queue, state.config.keepalive_s)) as arriving:
            async for ids in arriving:
                if ids is KEEPALIVE:  # nothing for keepalive_s seconds (a long prefill, a compile)
                    yield ids
                    continue
                for delta in stream.feed(ids):
                    yield _sse(chunk(rid, model, created, delta, **extra))
        try:
            turn = handle.future.result()
        except Exception as err:  # the response has started: the error goes in the stream
            yield _sse(state.error(err).body())
            yield "data: [DONE]\n\n"
            return
        for delta in stream.finish(turn.reply):
            yield _sse(chunk(rid, model, created, delta, **extra))
        yield _sse(chunk(rid, model, created, {}, turn.finish_reason, **extra))
        if req.include_usage:  # the usage chunk also carries what the mechanisms did
            last = chunk(
                rid, model, created, None, use=usage(turn.prompt_tokens, len(turn.reply_ids), turn.cached_tokens), include_usage=True
            )
            yield _sse({**last, "jaxkv": report})
        yield "data: [DONE]\n\n"
    finally:
        if not handle.future.done():  # the client went away mid-stream
            handle.cancel()


__all__ = ["PUBLIC", "ServeConfig", "ServingState", "create_app"]
