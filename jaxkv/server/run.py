"""Running the app: ``jaxkv serve`` (uvicorn in the foreground) and
``BackgroundServer`` (uvicorn in a thread on a free localhost port, for tests,
benchmarks and notebooks).

``make_app(model, ...)`` builds a ``Server`` and the app that owns it (closed
when the app shuts down). ``serve(args)`` is the command: it loads the model,
builds the app from the command's flags (warm-up on unless ``--no-warmup``:
every engine program compiled, through the persistent compilation cache, before
the port opens) and runs uvicorn until interrupted.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from jaxkv.server.sessions import FULL, OptionRules, load_api_keys
from jaxkv.serving.scheduler import DECODE_CHUNK


def make_app(model, *, model_name: str = "embedded", rows: int = 4, max_queue: int = 64, max_positions: int | None = None, num_slots: int | None = None, api_keys=(), rules: OptionRules = OptionRules(), max_tokens: int = 256, session_cap: int = 1024, decode_chunk: int = DECODE_CHUNK, warmup: bool = False, kv_quant: str | None = None):
    """A ``Server`` on ``model`` and the OpenAI app over it (the app owns the server);
    ``warmup`` compiles the server's whole shape set first (``Server.warmup``);
    ``kv_quant`` quantizes its KV pool (``jaxkv.cache.quantized``: every session)."""
    from jaxkv.server.app import ServeConfig, create_app
    from jaxkv.serving import Server

    server = Server(model, rows=rows, max_queue=max_queue, max_positions=max_positions, num_slots=num_slots, decode_chunk=decode_chunk, warmup=warmup, kv_quant=kv_quant)
    config = ServeConfig(model_name, tuple(api_keys), rules, max_tokens, session_cap)
    return create_app(server, config, own_server=True)


class BackgroundServer:
    """Serve ``app`` with uvicorn in a daemon thread on ``host`` and a free port.

    ``with BackgroundServer(app) as running: running.url`` (``http://127.0.0.1:PORT``);
    leaving the block shuts uvicorn down (the app's shutdown runs: an app made by
    ``make_app`` closes its ``Server``) and joins the thread.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.app = app
        self.host = host
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, name="jaxkv-http", daemon=True)

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout * 20)):
            if self._server.started or not self._thread.is_alive():
                break
            deadline.wait(0.05)
        if not self._server.started:
            raise RuntimeError(f"uvicorn did not start on {self.url}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ============================================================================ the command
def add_arguments(p) -> None:
    """``jaxkv serve``'s flags."""
    p.add_argument("--model", default="embedded", help="checkpoint folder, HF repo id, or 'embedded' (default)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: 'embedded' or the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[], metavar="KEY|FILE",
                   help="accepted Bearer key, or a file of keys (one per line); repeatable. None given: no authentication")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=4, help="turns that run at once (engine rows)")
    p.add_argument("--max-queue", type=int, default=64, help="turns that may wait for a row before 429")
    p.add_argument("--decode-chunk", type=int, default=DECODE_CHUNK,
                   help="decode steps per batched engine call: rows join and leave, and streams flush, between calls")
    p.add_argument("--max-positions", type=int, default=None, help="positions per request (default: the model context, at most 8192)")
    p.add_argument("--num-slots", type=int, default=None, help="KV pool slots (default: 2 x rows x positions + 1)")
    p.add_argument("--max-tokens", type=int, default=256, help="reply budget of a request that names none")
    p.add_argument("--policy", default=None, help="retention policy of every session (jaxkv.policies.REGISTRY; default: full cache)")
    p.add_argument("--budget", type=int, default=None, help="retention budget B (with --policy)")
    p.add_argument("--layout", default="dead_slot", choices=["dead_slot", "compact"])
    p.add_argument("--repair", type=int, default=0, help="RepairKV K rows per turn boundary (0: off; needs --policy)")
    p.add_argument("--allow-policies", default="", metavar="A,B",
                   help="policies a request may choose with extra_body policy ('full' = full cache; 'all' = every one)")
    p.add_argument("--max-budget", type=int, default=None, help="largest budget a request may ask (default: any)")
    p.add_argument("--max-repair", type=int, default=0, help="largest RepairKV K a request may ask (default: --repair)")
    p.add_argument("--kv-quant", default=None, metavar="FORMAT",
                   help="quantize the KV pool of every session: int4, kivi2, triaxial or its ablations (jaxkv.cache.quantized_host.MODES; default: float)")
    p.add_argument("--keep-reasoning", action="store_true", help="render earlier turns' reasoning too (append-only histories)")
    p.add_argument("--session-cap", type=int, default=1024, help="live sessions kept (LRU)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip compiling every engine program at start-up (the first requests then compile theirs)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def rules_from_args(args) -> OptionRules:
    """``OptionRules`` from the command's flags (unknown policy names: ``ConfigError``)."""
    from jaxkv import policies
    from jaxkv.errors import ConfigError

    names = {n.strip() for n in args.allow_policies.split(",") if n.strip()}
    if "all" in names:
        names = (names - {"all"}) | set(policies.REGISTRY) | {FULL}
    unknown = sorted(names - set(policies.REGISTRY) - {FULL})
    if unknown:
        raise ConfigError(f"--allow-policies names unknown policies {unknown}; known: {sorted(policies.REGISTRY)} and 'full'")
    if args.policy is not None and args.budget is None:
        raise ConfigError("--policy needs --budget")
    return OptionRules(args.policy, args.budget, args.layout, args.repair, frozenset(names), args.max_budget, args.max_repair, args.keep_reasoning)


def serve(args) -> int:
    """``jaxkv serve``: load the model, check the options once, serve until interrupted."""
    import uvicorn

    import jaxkv

    rules = rules_from_args(args)
    keys = load_api_keys(args.api_key)
    if args.api_key and not keys:
        from jaxkv.errors import ConfigError

        raise ConfigError("--api-key gave no keys (empty key or empty file)")
    model = jaxkv.load_model(args.model, dtype=args.dtype)
    name = args.served_model_name or ("embedded" if args.model == "embedded" else Path(args.model).name or args.model)
    app = make_app(model, model_name=name, rows=args.rows, max_queue=args.max_queue, max_positions=args.max_positions,
                   num_slots=args.num_slots, api_keys=keys, rules=rules, max_tokens=args.max_tokens, session_cap=args.session_cap,
                   decode_chunk=args.decode_chunk, warmup=args.warmup, kv_quant=args.kv_quant)
    probe = app.state.jaxkv.server.session(**rules.resolve({}))  # a bad --policy/--budget/--repair fails now, not per request
    del probe
    auth = f"{len(keys)} API key(s)" if keys else "no authentication"
    warm = app.state.jaxkv.server.warmup_seconds
    warmed = f", warm-up {warm:.0f} s" if warm is not None else ", no warm-up"
    print(f"jaxkv serve: model {name!r} on http://{args.host}:{args.port}/v1 ({args.rows} rows, {auth}{warmed})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
