"""The ``jaxkv`` command: ``generate``, ``demo`` (the main job) and ``eval`` (the harness).

Every sub-command is a thin shell over the library; errors from jaxkv print as one
line (``error: ...``) with exit code 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxkv.errors import JaxKVError


def _cmd_generate(args) -> int:
    import jaxkv

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
    stop = list(model.config.eos_token_ids)
    if tok.eos_token_id is not None:
        stop.append(tok.eos_token_id)
    t0 = time.perf_counter()
    out = jaxkv.generate(
        model, [list(ids)], args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_ids=stop,
    )[0]
    dt = time.perf_counter() - t0
    print(tok.decode(out, skip_special_tokens=False))
    print(f"[{len(ids)} prompt tokens, {len(out)} generated in {dt:.2f}s]", file=sys.stderr)
    return 0


def _cmd_demo(args) -> int:
    from jaxkv.demo import run_demo

    return run_demo(model_path=args.model, turns=args.turns, seed=args.seed, length=args.length)


def _cmd_eval(args) -> int:
    from eval.harness import run

    run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description="Managed-KV serving for multi-turn agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt")
    g.add_argument("--model", required=True, help="checkpoint folder, HF repo id, or 'embedded'")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=_cmd_generate)

    d = sub.add_parser("demo", help="the main job: multi-turn agent sessions through the engine and radix cache")
    d.add_argument("--model", default=None, help="checkpoint folder with a tokenizer (default: the embedded agent model)")
    d.add_argument("--turns", type=int, default=4, help="generated tasks to run (alternating agent trace / MQ-NIAH), each a multi-turn session")
    d.add_argument("--seed", type=int, default=0, help="task seed (held out from training)")
    d.add_argument("--length", type=int, default=2048, help="target conversation length of each task, in tokens")
    d.set_defaults(func=_cmd_demo)
    from eval.harness import build_parser as eval_parser

    e = sub.add_parser("eval", help="evaluate retention methods x budgets x layouts on generated tasks")
    eval_parser(e)
    e.set_defaults(func=_cmd_eval)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (JaxKVError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
