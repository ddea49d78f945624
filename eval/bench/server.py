"""Load test of ``jaxkv serve``: concurrent OpenAI clients replaying agent traces.

Starts ``jaxkv serve`` (the real command, in a subprocess, on 127.0.0.1 and a
free port; nothing leaves localhost) with the embedded agent model, then runs
two phases of ``--seconds`` each, one client and ``--clients`` clients, after
``--warmup`` seconds of the same load unmeasured (the engine compiles a program
per shape bucket it meets; a cold server spends most of a minute compiling). The
server starts with ``--no-warmup`` unless ``--server-warmup`` asks for the
command's start-up warm-up (every program of the shape set, minutes on 2 cores):

* each client takes held-out agent traces (``jaxkv.tasks.agent_traces``, seeds
  from ``jaxkv.tasks.seeds.EVAL_SEED_BASE``, a separate pool per phase, at most
  ``--traces`` per phase) and replays each as one session (``session_id`` in
  ``extra_body``): at every recorded assistant turn it sends the recorded history
  so far (teacher forcing, so one odd reply does not change what follows) with
  the trace's tools, greedy, and records the reply, latency and usage;
* a client starts no request after the phase's deadline (it finishes the one
  in flight), so a phase lasts about ``--seconds``.

Reported per phase: requests, errors, p50/p95 request latency, aggregate
generated tokens/s (completion tokens / phase wall time), requests/s and the
prefix-hit rate (cached / prompt tokens), with the throughput ratio of the two
phases (target >= 3x at 16 clients); and, from the server's ``/metrics``, where
its time went: the share of the phase the engine spent in batched prefill and
decode steps, and generated tokens per batched decode call (how full the
batches were).

Then every session is run again offline, one at a time: a ``jaxkv.Session`` on
one in-process ``jaxkv.Server`` (rows=1, the same session options as the
served sessions), with the same requests; its replies (content, reasoning, tool
calls) must equal the served ones. The count of equal sessions and turns is
reported (the served turns were batched with up to ``--clients`` others), and for
every differing turn the first divergent token of the offline reply with its
top-2 logit margin in that solo run (``first_divergence``): below 1e-4 it is a
greedy near tie that batched arithmetic (XLA:CPU is not batch-invariant, ~4e-6)
can flip.

Usage:
  python -m eval.bench.server [--seconds 60] [--clients 16] [--warmup 60] [--length 1024]
      [--max-tokens 96] [--traces 200] [--policy P --budget B --repair K] [--out FILE.md]
      [--stage all|serve|check] [--model embedded|qwen3-125m|FOLDER]

The embedded model is KV-bound (4.4 MB of weights against ~4-8 MB of KV per row
per decode step), so a batched step costs about as much per token as a single
row's and concurrency buys little on it; ``--model qwen3-125m`` serves a random
model whose weights dominate a step, as a real checkpoint's do (its replies are
random text: the traces still replay teacher-forced, and the offline check still
compares every reply).

``--stage serve`` runs the served phases and saves them (``FILE.phases.json``);
``--stage check`` then runs the offline check and writes the report, so the two
halves fit in separate bounded jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from eval.common.servers import ServerProcess, free_port, metric  # noqa: E402
from jaxkv.markdown import md_table  # noqa: E402

MAX_POSITIONS = 4096  # per request: the traces are ~1-2k tokens (the pool is rows x 2 x this)
SEED_OFFSET = 70_000  # trace seeds: EVAL_SEED_BASE + SEED_OFFSET + ... (held out from training)


def server_command(args, port: int) -> tuple[list[str], dict]:
    """``jaxkv serve``'s argv and environment for this bench's options."""
    cmd = [
        sys.executable,
        "-m",
        "jaxkv.cli",
        "serve",
        "--model",
        checkpoint(args.model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--rows",
        str(args.clients),
        "--max-positions",
        str(MAX_POSITIONS),
        "--max-queue",
        str(4 * args.clients),
        "--max-tokens",
        str(args.max_tokens),
        "--log-level",
        "warning",
    ]
    if args.policy:
        cmd += ["--policy", args.policy, "--budget", str(args.budget)]
    if args.repair:
        cmd += ["--repair", str(args.repair)]
    if not args.server_warmup:  # the bench warms the server with its own unmeasured load
        cmd += ["--no-warmup"]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return cmd, env


def checkpoint(model: str) -> str:
    """The folder ``jaxkv serve --model`` gets. ``qwen3-125m`` is the random ~125M
    Qwen3 body of ``eval/bench/decode.py`` with the task tokenizer and its
    1,909-token vocabulary (so every generated id prints; 78M parameters),
    exported once to the temp folder (seed 0: the same weights every time);
    any other name is passed through (a checkpoint folder, or ``embedded``)."""
    if model != "qwen3-125m":
        return model
    import tempfile

    folder = Path(tempfile.gettempdir()) / "jaxkv-bench-qwen3-125m-v1909"
    if not (folder / "config.json").exists():
        from eval.bench.serving import random_qwen3_125m
        from jaxkv.models.loading import save_pretrained
        from jaxkv.tasks import embedded_tokenizer

        partial = folder.with_name(folder.name + ".partial")
        save_pretrained(random_qwen3_125m(vocab_size=len(embedded_tokenizer())), partial)
        partial.rename(folder)
    return str(folder)


def turns_of(example) -> list[int]:
    """Indices of the recorded assistant messages to replay (up to the last scored one)."""
    last = max(t.message_index for t in example.targets)
    return [j for j, m in enumerate(example.messages) if m.get("role") == "assistant" and j <= last]


def reply_of(message) -> dict:
    """The comparable part of a reply: content, reasoning, tool calls."""
    if isinstance(message, dict):
        calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or ()]
        return {"content": message.get("content") or "", "reasoning": message.get("reasoning_content") or "", "calls": calls}
    calls = [[c.function.name, c.function.arguments] for c in message.tool_calls or ()]
    return {"content": message.content or "", "reasoning": (message.model_extra or {}).get("reasoning_content") or "", "calls": calls}


def first_divergence(served: dict, offline_turn, tokenizer) -> tuple[int | None, float]:
    """Where a served reply first differs from its offline replay, as the index of
    the offline reply token whose text the first differing character falls in,
    and that token's top-2 logit margin in the offline (solo) run. The fields
    (reasoning, content, each call's name and arguments) are compared in order;
    the first differing one is located in the offline reply text. When it cannot
    be located, the smallest margin of the whole reply is returned (index None)."""
    offline = reply_of(offline_turn.reply)
    fields = lambda r: [r["reasoning"], r["content"], *[part for call in r["calls"] for part in call]]  # noqa: E731
    a, b = fields(offline), fields(served)
    margins = np.asarray(offline_turn.reply_margins if offline_turn.reply_margins is not None else [], np.float32)
    fallback = (None, float(margins.min()) if margins.size else float("inf"))
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if diff >= len(a) or not a[diff]:
        return fallback
    value, other = a[diff], b[diff] if diff < len(b) else ""
    at = offline_turn.text.find(value)
    if at < 0:
        return fallback
    char = at + len(os.path.commonprefix([value, other]))
    ids = offline_turn.reply_ids
    for k in range(len(ids)):
        if len(tokenizer.decode(ids[: k + 1], skip_special_tokens=False)) > char:
            return k, float(margins[k]) if k < margins.size else float("inf")
    return fallback


def server_counters(url: str) -> dict:
    """The engine counters of ``/metrics``: busy seconds by phase, decode calls, tokens."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=60).text
    return {
        "prefill_s": metric(text, "jaxkv_engine_seconds_total", phase="prefill"),
        "decode_s": metric(text, "jaxkv_engine_seconds_total", phase="decode"),
        "decode_calls": metric(text, "jaxkv_decode_steps_total"),
        "generated": metric(text, "jaxkv_generated_tokens_total"),
        "prefilled": metric(text, "jaxkv_prefill_tokens_total"),
    }


def run_phase(url: str, model_name: str, clients: int, seconds: float, examples, args) -> dict:
    """``clients`` threads replay traces from ``examples`` until the deadline;
    with the server's engine counters over the phase."""
    import openai

    pool = list(reversed(examples))
    lock = threading.Lock()
    sessions, requests, errors = [], [], []
    deadline = [0.0]

    def client_loop(k: int):
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        while time.perf_counter() < deadline[0]:
            with lock:
                if not pool:
                    return
                example = pool.pop()
            sid = f"bench-{clients}-{example.seed}"
            record = {"seed": example.seed, "session_id": sid, "turns": [], "replies": []}
            with lock:
                sessions.append(record)
            for j in turns_of(example):
                if time.perf_counter() >= deadline[0]:
                    break
                t0 = time.perf_counter()
                try:
                    r = c.chat.completions.create(
                        model=model_name,
                        messages=example.messages[:j],
                        tools=example.tools,
                        temperature=0,
                        max_tokens=args.max_tokens,
                        extra_body={"session_id": sid},
                    )
                except Exception as err:  # counted: the bench requires zero
                    with lock:
                        errors.append(f"{type(err).__name__}: {err}")
                    break
                latency = time.perf_counter() - t0
                record["turns"].append(j)
                record["replies"].append(reply_of(r.choices[0].message))
                with lock:
                    requests.append(
                        (latency, r.usage.completion_tokens, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens)
                    )

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(clients)]
    before = server_counters(url)
    t_start = time.perf_counter()
    deadline[0] = t_start + seconds
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t_start
    engine = {k: v - before[k] for k, v in server_counters(url).items()}
    lat = np.asarray([r[0] for r in requests]) if requests else np.zeros(1)
    completion = sum(r[1] for r in requests)
    prompt, cached = sum(r[2] for r in requests), sum(r[3] for r in requests)
    return {
        "clients": clients,
        "wall_s": wall,
        "requests": len(requests),
        "errors": errors,
        "sessions": [s for s in sessions if s["turns"]],
        "traces": len(sessions),
        "p50_s": float(np.percentile(lat, 50)),
        "p95_s": float(np.percentile(lat, 95)),
        "completion_tokens": completion,
        "tokens_per_s": completion / wall,
        "requests_per_s": len(requests) / wall,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "engine": engine,
    }


def warm_up(url: str, model_name: str, clients: int, seconds: float, examples, args) -> None:
    """The same load, unmeasured, so the timed phases run on compiled code: the
    engine compiles one program per (rows, chunk, read length) bucket it meets,
    and a cold server spends most of a minute doing so."""
    third = max(len(examples) // 3, 1)
    run_phase(url, model_name, 1, seconds / 3, examples[:third], args)
    run_phase(url, model_name, clients, seconds, examples[third:], args)


def verify_offline(phases, examples_by_seed, args) -> dict:
    """Replay every served session alone on an in-process Server; compare replies."""
    import jaxkv

    model = jaxkv.load_model(checkpoint(args.model))
    options = {}
    if args.policy:
        options.update(policy=args.policy, budget=args.budget, layout="dead_slot")
    if args.repair:
        options["repair"] = args.repair
    sessions = equal_sessions = turns = equal_turns = 0
    mismatches = []
    t0 = time.perf_counter()
    with jaxkv.Server(model, rows=1) as server:
        for phase in phases:
            for record in phase["sessions"]:
                example = examples_by_seed[record["seed"]]
                session = server.session(session_id=record["session_id"], **options)
                session.record_margins = True  # each offline reply token's top-2 logit margin
                same = True
                for j, served in zip(record["turns"], record["replies"]):
                    result = session.start_chat(
                        example.messages[:j], example.tools, max_new_tokens=args.max_tokens, temperature=0.0
                    ).result()
                    offline = reply_of(result.reply)
                    turns += 1
                    if offline == served:
                        equal_turns += 1
                    else:
                        same = False
                        token, margin = first_divergence(served, result, model.tokenizer)
                        mismatches.append(
                            {
                                "session": record["session_id"],
                                "turn": j,
                                "served": served,
                                "offline": offline,
                                "first_token": token,
                                "margin": margin,
                            }
                        )
                session.close()
                sessions += 1
                equal_sessions += same
    return {
        "sessions": sessions,
        "equal_sessions": equal_sessions,
        "turns": turns,
        "equal_turns": equal_turns,
        "mismatches": mismatches,
        "wall_s": time.perf_counter() - t0,
    }


def engine_ceiling(one: dict, many: dict) -> str:
    """What the engine's own work allows: at ``many`` clients, engine seconds
    (prefill + decode) per generated token, against one client's wall seconds per
    token. Their quotient bounds the throughput ratio even if the server never
    idled and HTTP cost nothing."""
    gen = many["engine"]["generated"]
    prefill_ms = 1e3 * many["engine"]["prefill_s"] / max(gen, 1)
    decode_ms = 1e3 * many["engine"]["decode_s"] / max(gen, 1)
    one_ms = 1e3 / max(one["tokens_per_s"], 1e-9)
    busy = (many["engine"]["prefill_s"] + many["engine"]["decode_s"]) / many["wall_s"]
    return (
        f"Engine ceiling: at {many['clients']} clients the engine spends {prefill_ms:.2f} ms of prefill and {decode_ms:.2f} ms "
        f"of decode per generated token and is busy {busy:.0%} of the wall; one client takes {one_ms:.2f} ms of wall per token, "
        f"so no scheduling can take the ratio above {one_ms / (prefill_ms + decode_ms):.2f}x with this engine work. "
        f"3x needs at most {one_ms / 3:.2f} ms of engine work per token."
    )


def report(args, phases, check, command: str) -> str:
    one, many = phases
    ratio = many["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else float("nan")
    rows = [
        ("clients", one["clients"], many["clients"]),
        ("requests (traces started)", f"{one['requests']} ({one['traces']})", f"{many['requests']} ({many['traces']})"),
        ("errors", len(one["errors"]), len(many["errors"])),
        ("wall time", f"{one['wall_s']:.1f} s", f"{many['wall_s']:.1f} s"),
        ("latency p50 / p95", f"{one['p50_s']:.2f} / {one['p95_s']:.2f} s", f"{many['p50_s']:.2f} / {many['p95_s']:.2f} s"),
        ("generated tokens/s (aggregate)", f"{one['tokens_per_s']:.1f}", f"{many['tokens_per_s']:.1f}"),
        ("requests/s", f"{one['requests_per_s']:.2f}", f"{many['requests_per_s']:.2f}"),
        ("prefix-hit rate", f"{100 * one['prefix_hit_rate']:.1f}%", f"{100 * many['prefix_hit_rate']:.1f}%"),
        (
            "engine busy: prefill / decode (share of wall)",
            *(f"{p['engine']['prefill_s'] / p['wall_s']:.0%} / {p['engine']['decode_s'] / p['wall_s']:.0%}" for p in phases),
        ),
        (
            "decode calls; generated tokens per call",
            *(f"{p['engine']['decode_calls']:.0f}; {p['engine']['generated'] / max(p['engine']['decode_calls'], 1):.1f}" for p in phases),
        ),
        ("decode tokens/s while decoding", *(f"{p['engine']['generated'] / max(p['engine']['decode_s'], 1e-9):.0f}" for p in phases)),
    ]
    lines = [
        "# jaxkv serve load test (eval/bench/server.py)",
        "",
        f"`{command}`",
        "",
        f"Model {args.model}, agent traces of ~{args.length} tokens (held-out seeds), greedy, max_tokens {args.max_tokens}; "
        f"server `jaxkv serve --rows {args.clients}` on 127.0.0.1"
        + (f", {args.policy} B={args.budget}" if args.policy else ", full cache")
        + (f", RepairKV K={args.repair}" if args.repair else "")
        + f"; {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), clients and server on the same machine.",
        "",
        md_table(["metric", "1 client", f"{many['clients']} clients"], rows[1:], align="lrr"),
    ]
    lines += [
        "",
        f"Throughput at {many['clients']} clients / 1 client: **{ratio:.2f}x** (target >= 3x).",
        "",
        engine_ceiling(one, many),
        "",
        f"Offline check (each session alone, jaxkv.Session on an in-process Server, same options): "
        f"{check['equal_sessions']}/{check['sessions']} sessions and {check['equal_turns']}/{check['turns']} turns "
        f"reply exactly as served ({check['wall_s']:.0f} s).",
    ]
    for m in check["mismatches"][:5]:
        lines.append(
            f"- mismatch {m['session']} turn {m['turn']}: first divergent token {m['first_token']} of the offline reply, "
            f"its solo top-2 logit margin {m['margin']:.2e} ({'a near tie' if m['margin'] < 1e-4 else 'NOT a near tie'}); "
            f"served {json.dumps(m['served'])[:160]} / offline {json.dumps(m['offline'])[:160]}"
        )
    for phase in phases:
        for e in phase["errors"][:5]:
            lines.append(f"- error ({phase['clients']} clients): {e[:200]}")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="embedded",
        help="checkpoint with a tokenizer (default: the embedded agent model), "
        "or qwen3-125m: a random ~125M Qwen3 body with the task tokenizer, built once into the temp folder",
    )
    p.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients of the second phase (and server rows)")
    p.add_argument(
        "--warmup", type=float, default=60.0, help="seconds of unmeasured load first (1 client for a third of it, then --clients)"
    )
    p.add_argument("--length", type=int, default=1024, help="target length of each agent trace, in tokens")
    p.add_argument("--max-tokens", type=int, default=96, help="reply budget of every request")
    p.add_argument("--traces", type=int, default=200, help="at most this many traces per phase")
    p.add_argument("--policy", default=None, help="retention policy of the served (and offline) sessions")
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--repair", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the report (markdown) and a .json beside it")
    p.add_argument(
        "--server-warmup",
        action="store_true",
        help="start jaxkv serve with its start-up warm-up (every engine program compiled) instead of --no-warmup",
    )
    p.add_argument(
        "--stage",
        default="all",
        choices=["all", "serve", "check"],
        help="serve: the timed phases only, saved to OUT.phases.json; check: the offline check of a saved "
        "run and the report (two shorter jobs instead of one)",
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.clients < 2 or args.seconds <= 0 or (args.policy and args.budget is None):
        raise SystemExit("need --clients >= 2, --seconds > 0, and --budget with --policy")
    from jaxkv.tasks import agent_traces
    from jaxkv.tasks.seeds import EVAL_SEED_BASE

    base = EVAL_SEED_BASE + SEED_OFFSET
    pools = [agent_traces(args.traces, base + 1000 * (k + 1), length=args.length) for k in range(2)]
    examples_by_seed = {ex.seed: ex for pool in pools for ex in pool}
    command = "python -m eval.bench.server " + re.sub(r"\s*--stage[ =]\S+", "", " ".join(sys.argv[1:] if argv is None else argv))
    if args.stage != "all" and not args.out:
        raise SystemExit("--stage serve/check needs --out")
    saved = Path(args.out).with_suffix(".phases.json") if args.out else None
    if args.stage == "check":
        run = json.loads(saved.read_text())
        phases, command = run["phases"], run["command"]
    else:
        phases = serve_phases(args, pools)
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps({"command": command, "phases": phases}, default=str))
        if args.stage == "serve":
            return 0 if not any(p["errors"] for p in phases) else 1
    check = verify_offline(phases, examples_by_seed, args)
    text = report(args, phases, check, command)
    print(text)
    if args.out:
        out = Path(args.out)
        out.write_text(text)
        summary = {
            "phases": [{k: v for k, v in p.items() if k != "sessions"} for p in phases],
            "offline": {k: v for k, v in check.items() if k != "mismatches"},
            "mismatches": check["mismatches"],
        }
        out.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=str))
    ok = not any(p["errors"] for p in phases) and check["equal_sessions"] == check["sessions"]
    return 0 if ok else 1


def serve_phases(args, pools) -> list[dict]:
    """Start ``jaxkv serve``, warm it up, run the two timed phases, stop it."""
    from jaxkv.tasks import agent_traces
    from jaxkv.tasks.seeds import EVAL_SEED_BASE

    warm = agent_traces(args.traces, EVAL_SEED_BASE + SEED_OFFSET, length=args.length)
    port = free_port()
    argv, env = server_command(args, port)
    with ServerProcess(
        argv, port, name="jaxkv serve", env=env, ready_path="/health", stop_timeout=60.0, timeout=3600.0 if args.server_warmup else 300.0
    ) as server:
        import httpx

        url = server.base
        model_name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        t0 = time.perf_counter()
        warm_up(url, model_name, args.clients, args.warmup, warm, args)
        print(f"warm-up {time.perf_counter() - t0:.1f}s", flush=True)
        phases = []
        for clients, pool in zip((1, args.clients), pools):
            phase = run_phase(url, model_name, clients, args.seconds, pool, args)
            print(
                f"{clients:>3} clients: {phase['requests']} requests, {len(phase['errors'])} errors, "
                f"p50 {phase['p50_s']:.2f}s p95 {phase['p95_s']:.2f}s, {phase['tokens_per_s']:.1f} tok/s",
                flush=True,
            )
            phases.append(phase)
    return phases


if __name__ == "__main__":
    sys.exit(main())
