"""Running the app: ``jaxkv serve`` (uvicorn in the foreground) and
``BackgroundServer`` (uvicorn in a thread on a free localhost port, for tests,
benchmarks and notebooks).

``make_app(model, ...)`` builds a ``Server`` (its KV pool in the format of
``rules.kv_quant``) and the app that owns it (closed when the app shuts down);
before the app exists it builds a session for the default options and for each
allowed ``kv_quant`` mode (``check_rules``), so what the server cannot serve is
a ``ConfigError`` at start-up, not a 400 on every request. ``serve(args)`` is
the command: it turns the flags into ``OptionRules`` (``rules_from_args``;
``--allow OPTION=VALUES`` with ``parse_allow``), loads the model, builds the app
(warm-up on unless ``--no-warmup``: every engine program compiled, with those
of the retention policies the rules allow, through the persistent compilation
cache, before the port opens) and runs uvicorn until
interrupted.

``--allow`` (repeatable): ``policy=A,B`` / ``layout=A,B`` / ``kv_quant=A,B`` /
``reuse=A,B`` name the values a request may choose besides the default
(``all``: every one; for ``kv_quant``, every mode the pool serves);
``budget=MAX`` / ``repair=MAX`` / ``kv_bits=MAX`` cap the numbers.
``--allow-policies``, ``--max-budget`` and ``--max-repair`` are aliases.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from jaxkv.engine import PREFILL_CHUNK
from jaxkv.server.protocol import KEEPALIVE_S
from jaxkv.server.sessions import CAPS, CHOICES, OPTIONS, OptionRules, known_values, load_api_keys
from jaxkv.serving.scheduler import DECODE_CHUNK


def make_app(
    model,
    *,
    model_name: str = "embedded",
    rows: int = 4,
    max_queue: int = 64,
    max_positions: int | None = None,
    num_slots: int | None = None,
    api_keys=(),
    rules: OptionRules = OptionRules(),
    max_tokens: int = 256,
    session_cap: int = 1024,
    decode_chunk: int = DECODE_CHUNK,
    prefill_chunk: int = PREFILL_CHUNK,
    warmup: bool = False,
    kv_quant: str | None = None,
    keepalive_s: float | None = KEEPALIVE_S,
):
    """A ``Server`` on ``model`` and the OpenAI app over it (the app owns the server);
    ``warmup`` compiles the server's whole shape set first (``Server.warmup``),
    with the programs of the retention policies ``rules`` let requests run.
    ``keepalive_s``: a silent stream's SSE comment interval (``ServeConfig``).

    The KV pool's format is ``rules.kv_quant`` (``jaxkv.cache.quantized``; every
    session's default); ``kv_quant`` is the same, for callers without rules (the two
    must agree). Before the app exists, one session is built for the defaults and one
    for each allowed ``kv_quant`` mode (``check_rules``), so a default or an
    allow-list the server cannot serve (a missing calibration, options that do
    not compose) is a ``ConfigError`` now, not a 400 on every request."""
    import dataclasses

    from jaxkv.cache.quantized_host import check_mode
    from jaxkv.errors import ConfigError
    from jaxkv.server.app import ServeConfig, create_app
    from jaxkv.serving import Server

    if check_mode(kv_quant) is not None:
        if rules.kv_quant not in (None, check_mode(kv_quant)):
            raise ConfigError(f"kv_quant={kv_quant!r} but rules.kv_quant={rules.kv_quant!r}: the pool has one format")
        rules = dataclasses.replace(rules, kv_quant=check_mode(kv_quant))
    server = Server(
        model,
        rows=rows,
        max_queue=max_queue,
        max_positions=max_positions,
        num_slots=num_slots,
        decode_chunk=decode_chunk,
        prefill_chunk=prefill_chunk,
        warmup=False,
        kv_quant=rules.kv_quant,
    )
    try:
        check_rules(server, rules)
        if warmup:
            samplers = {} if warmup is True else {"samplers": tuple(warmup)}
            server.warmup(**samplers, session_options=_warmup_options(rules), policies=_warmup_policies(rules))
    except BaseException:
        server.close()
        raise
    config = ServeConfig(model_name, tuple(api_keys), rules, max_tokens, session_cap, keepalive_s=keepalive_s)
    return create_app(server, config, own_server=True)


def _warmup_policies(rules: OptionRules) -> list[str]:
    """The retention policies a request on this server may run (the default and
    the allow-list, ``"full"`` aside): the warm-up compiles their programs."""
    return sorted(({rules.policy} | set(rules.allow_policies)) - {None, "full"})


def _warmup_options(rules: OptionRules) -> dict:
    """The options of the warm-up's scratch session: the pool's format with its
    calibration (what the pool needs to run a turn at all), nothing else."""
    options = {"kv_quant": rules.kv_quant} if rules.kv_quant is not None else {}
    if rules.kv_quant is not None and rules.kv_quant.startswith("triaxial") and rules.kv_allocation is not None:
        options["kv_allocation"] = rules.kv_allocation
    return options


def check_rules(server, rules: OptionRules) -> None:
    """Build (and drop) a session with the defaults, and one with each allowed
    ``kv_quant`` mode (its default ``kv_bits`` and calibration, other options
    left out), on ``server``: ``ConfigError`` for what it cannot serve."""
    from jaxkv.errors import ConfigError

    probes = [({}, rules.resolve({}))]
    for mode in sorted(rules.allow_kv_quant - {rules.kv_quant or "none"}):
        options = {"kv_quant": mode}
        if mode.startswith("triaxial"):
            options.update({k: v for k, v in (("kv_bits", rules.kv_bits), ("kv_allocation", rules.kv_allocation)) if v is not None})
        probes.append(({"kv_quant": mode}, options))
    for asked, options in probes:
        try:
            server.session(**options)
        except ConfigError as err:
            what = "the default session options" if not asked else f"--allow kv_quant={asked['kv_quant']}"
            raise ConfigError(f"{what} cannot run on this server: {err}") from None


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
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY|FILE",
        help="accepted Bearer key, or a file of keys (one per line); repeatable. None given: no authentication",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=4, help="turns that run at once (engine rows)")
    p.add_argument("--max-queue", type=int, default=64, help="turns that may wait for a row before 429")
    p.add_argument(
        "--decode-chunk",
        type=int,
        default=DECODE_CHUNK,
        help="decode steps per batched engine call: rows join and leave, and streams flush, between calls",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=PREFILL_CHUNK,
        help="prompt tokens of one turn per engine step; a step's token budget is this plus a token of every row, "
        "so a smaller chunk shortens the steps decoding rows share with a prompt",
    )
    p.add_argument("--max-positions", type=int, default=None, help="positions per request (default: the model context, at most 8192)")
    p.add_argument("--num-slots", type=int, default=None, help="KV pool slots (default: 2 x rows x positions + 1)")
    p.add_argument("--max-tokens", type=int, default=256, help="reply budget of a request that names none")
    p.add_argument("--policy", default=None, help="retention policy of every session (jaxkv.policies.REGISTRY; default: full cache)")
    p.add_argument("--budget", type=int, default=None, help="retention budget B (with --policy)")
    p.add_argument("--layout", default="dead_slot", choices=["dead_slot", "compact"])
    p.add_argument("--repair", type=int, default=0, help="RepairKV K rows per turn boundary (0: off; needs --policy)")
    p.add_argument(
        "--kv-quant",
        default=None,
        metavar="FORMAT",
        help="the KV pool's format and every session's default: int4, kivi2, kivi4, triaxial or its ablations "
        "(jaxkv.cache.quantized_host.MODES; default: float)",
    )
    p.add_argument(
        "--kv-bits", type=float, default=None, metavar="B", help="average bits of triaxial sessions, in [2, 4] (default: the calibration's)"
    )
    p.add_argument(
        "--kv-allocation",
        default=None,
        metavar="PATH",
        help="TriAxialKV calibration of triaxial sessions (default: triaxial.json in the model folder)",
    )
    p.add_argument(
        "--reuse",
        default=None,
        choices=["segment", "cacheblend"],
        help="cross-query segment reuse of every session, per tenant (default: off)",
    )
    p.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="OPTION=VALUES",
        help="what a request may choose in extra_body instead of the default; repeatable. "
        "policy=A,B (or 'all'; 'full' = full cache), layout=dead_slot,compact, "
        "kv_quant=int4,triaxial,... (modes the pool serves; 'all'), reuse=segment,cacheblend,none; "
        "caps: budget=MAX, repair=MAX, kv_bits=MAX",
    )
    p.add_argument("--allow-policies", default="", metavar="A,B", help="same as --allow policy=A,B")
    p.add_argument("--max-budget", type=int, default=None, help="same as --allow budget=MAX (default: any budget)")
    p.add_argument("--max-repair", type=int, default=0, help="same as --allow repair=MAX (default: --repair)")
    p.add_argument("--keep-reasoning", action="store_true", help="render earlier turns' reasoning too (append-only histories)")
    p.add_argument("--session-cap", type=int, default=1024, help="live sessions kept (LRU)")
    p.add_argument(
        "--keepalive",
        type=float,
        default=KEEPALIVE_S,
        metavar="SECONDS",
        help="a stream silent this long (a long prefill) gets an SSE comment line, ': keep-alive' (0: never)",
    )
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip compiling every engine program at start-up (the first requests then compile theirs)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def parse_allow(values) -> dict:
    """``--allow`` values (``OPTION=A,B`` or ``OPTION=MAX``, repeatable) as
    ``{option: set of values}`` for ``CHOICES`` and ``{option: maximum}`` for
    ``CAPS`` (``jaxkv.server.sessions``); ``all`` allows every value of a choice
    (every mode the pool serves, for ``kv_quant``: resolved by ``rules_from_args``).
    A choice named twice adds up; a cap named twice with two values, or anything
    malformed, is a ``ConfigError``."""
    from jaxkv.errors import ConfigError

    out: dict = {}
    for value in values or ():
        name, sep, rest = str(value).partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not rest.strip():
            raise ConfigError(f"--allow {value!r}: write OPTION=VALUES, e.g. --allow policy=snapkv,h2o or --allow repair=64")
        if name in CHOICES:
            out.setdefault(name, set()).update(v.strip() for v in rest.split(",") if v.strip())
        elif name in CAPS:
            try:
                cap = int(rest) if name != "kv_bits" else float(rest)
            except ValueError:
                raise ConfigError(f"--allow {value!r}: {name} takes one maximum, a number") from None
            if name in out and out[name] != cap:
                raise ConfigError(f"--allow {name} given twice ({out[name]} and {cap})")
            out[name] = cap
        else:
            raise ConfigError(f"--allow {value!r}: unknown option {name!r}; a request may choose {', '.join(OPTIONS)}")
    return out


def rules_from_args(args) -> OptionRules:
    """``OptionRules`` from the command's flags (``--allow`` merged with its
    aliases ``--allow-policies``, ``--max-budget``, ``--max-repair``); bad
    names, values or combinations: ``ConfigError``."""
    from jaxkv.cache.quantized_host import servable_modes
    from jaxkv.errors import ConfigError

    allow = parse_allow(getattr(args, "allow", ()))
    aliases = [
        ("policy", {n.strip() for n in args.allow_policies.split(",") if n.strip()} or None),
        ("budget", args.max_budget),
        ("repair", args.max_repair or None),
    ]
    for name, value in aliases:
        if value is None:
            continue
        if name in CHOICES:
            allow.setdefault(name, set()).update(value)
        elif name in allow and allow[name] != value:
            raise ConfigError(f"the {name} cap is given twice ({allow[name]} and {value})")
        else:
            allow[name] = value
    kv_quant = getattr(args, "kv_quant", None)
    for name in CHOICES:
        if "all" in allow.get(name, ()):
            every = [m or "none" for m in servable_modes(kv_quant)] if name == "kv_quant" else known_values(name)
            allow[name] = (allow[name] - {"all"}) | set(every)
    return OptionRules(
        policy=args.policy,
        budget=args.budget,
        layout=args.layout,
        repair=args.repair,
        keep_reasoning=args.keep_reasoning,
        kv_quant=kv_quant,
        kv_bits=getattr(args, "kv_bits", None),
        reuse=getattr(args, "reuse", None),
        kv_allocation=getattr(args, "kv_allocation", None),
        allow_policies=frozenset(allow.get("policy", ())),
        allow_layouts=frozenset(allow.get("layout", ())),
        allow_kv_quant=frozenset(allow.get("kv_quant", ())),
        allow_reuse=frozenset(allow.get("reuse", ())),
        max_budget=allow.get("budget"),
        max_repair=allow.get("repair", 0),
        max_kv_bits=allow.get("kv_bits"),
    )


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
    app = make_app(
        model,
        model_name=name,
        rows=args.rows,
        max_queue=args.max_queue,
        max_positions=args.max_positions,
        num_slots=args.num_slots,
        api_keys=keys,
        rules=rules,
        max_tokens=args.max_tokens,
        session_cap=args.session_cap,
        decode_chunk=args.decode_chunk,
        prefill_chunk=args.prefill_chunk,
        warmup=args.warmup,
        keepalive_s=args.keepalive,
    )  # bad defaults or allow-lists fail here, before the port opens
    auth = f"{len(keys)} API key(s)" if keys else "no authentication"
    server = app.state.jaxkv.server
    warm = server.warmup_seconds
    warmed = f", warm-up compiled {server.warmup_programs} XLA programs in {warm:.0f} s" if warm is not None else ", no warm-up"
    print(f"jaxkv serve: model {name!r} on http://{args.host}:{args.port}/v1 ({args.rows} rows, {auth}{warmed})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
