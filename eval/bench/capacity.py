"""Throughput at a fixed KV memory: how many agent sessions each KV format holds in
the same bytes, and the tokens/s one server serves with them (issue #60, item 4).

    JAX_PLATFORMS=cpu python -m eval.bench.capacity [--model smollm2-135m-instruct]
        [--kinds none,int4,triaxial] [--float-sessions 2 | --budget-mib M] [--length 1024]
        [--turns 0] [--max-new-tokens 32] [--max-traces 48] [--no-warmup] [--out FILE.md]

The workload: held-out multi-turn agent traces (``jaxkv.tasks.agent_traces``,
seeds disjoint from the harness's), rendered for the model's chat template
(``jaxkv.tasks.example.for_template``: SmolLM2's ChatML gets its tools inlined
as text, as ``eval/harness.py`` replays them). A session replays its trace turn
by turn, as ``eval/bench_serving.py`` does: turn ``t`` asks ``Session.start_chat``
for a reply to the recorded history before the trace's t-th assistant message
(teacher-forced history), greedy, exactly ``--max-new-tokens`` tokens
(``ignore_eos``, so every format decodes the same number of tokens), up to
``--turns`` turns (0: every assistant turn of the trace). Between turns a
session's conversation stays in the pool (the radix cache), as an agent's does
while it waits for a tool.

The budget: one KV memory budget in bytes for every format, by default what the
float pool needs to hold ``--float-sessions`` sessions of this workload
(``--budget-mib`` sets it directly). Each format gets the largest pool of its
kind that fits (``Server(kv_memory_bytes=...)``, ``jaxkv.cache.pools.pool_for_bytes``;
the pool's actual device bytes are printed beside the budget). On the CPU the
float pool is float32 (``jaxkv.cache.state.float_pool_dtype``), 4 bytes per
element; INT4 stores 5 bits per element with its scales and zero points, so it
holds 6.4x the float32 pool's tokens (3.2x a bf16 pool's, the GPU's float pool).

Sessions are added, in trace order, while the pool can hold every added
session's whole conversation at once: its last prompt plus one reply per turn
(each turn's generated reply stays cached beside the recorded history that the
next prompt carries). That many sessions ("held") then run at once on one
``Server`` with a row each (continuous batching), one thread per session, and
the run is timed. A triaxial pool gives its INT2 pages the share of tokens the
model's calibrated budget B writes at 2 bits, ``(4 - B) / 2`` (0 for SmolLM2's
shipped calibration, B = 4.0: its triaxial sessions store every token INT4).

Reported per format: the pool's tokens and device bytes, sessions held, turns,
tokens prefilled (not found in the radix cache) and generated, the wall seconds
and the XLA compile seconds inside them, generated tokens/s and served tokens/s
(prefilled + generated) over the wall less compile time, the radix cache's
evicted slots and the turns that re-prefilled their own history (both 0 when the
pool held every session), and the ratios against the float pool. Formats run one
after another, each on a fresh server, measured the same way; by default every
format runs once untimed first (same shapes, so the timed runs compile almost
nothing); ``--no-warmup`` skips that (about half the time), and then the
compile seconds subtracted are all that separates a format that compiles from
one that reuses the programs of the format before it. The header records the machine, the threads the
process may run on (its CPU affinity and the thread environment variables) and
the load average before and after the run.

The goal in issue #60: at a fixed KV budget, TriAxialKV holds >= 3x the float
pool's concurrent sessions and serves >= 1.0x its tokens/s on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxkv.markdown import md_table  # noqa: E402
from jaxkv.kernels.quant import PAGE  # noqa: E402

CAPACITY_SEED_OFFSET = 7_000  # trace seeds: EVAL_SEED_BASE + this (held out, disjoint from bench_serving's 5,000)
COMPILE_EVENTS = (
    "/jax/core/compile/backend_compile_duration",
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
)
COMPILE_SECONDS = [0.0]
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: COMPILE_SECONDS.__setitem__(0, COMPILE_SECONDS[0] + secs) if name in COMPILE_EVENTS else None
)


@dataclasses.dataclass(frozen=True)
class SessionPlan:
    """One session's replay.

    Attributes:
      histories: the recorded history each turn answers (one per turn).
      tools: the tool schemas its requests carry (None: inlined in the history).
      prompt_tokens: each turn's rendered prompt length.
      footprint: KV slots the session holds at its end: the last prompt plus one
        reply of ``max_new_tokens`` per turn.
    """

    histories: list
    tools: list | None
    prompt_tokens: list
    footprint: int


@dataclasses.dataclass(frozen=True)
class Kind:
    """A pool format of the run: its label, ``kv_quant`` and INT2 page share."""

    label: str
    kv_quant: str | None
    page_share: float | None = None


def plans(model, n: int, length: int, turns: int, max_new_tokens: int) -> list[SessionPlan]:
    """``n`` held-out agent traces as session replays for ``model``'s template."""
    from jaxkv.chat import render
    from jaxkv.tasks import agent_traces
    from jaxkv.tasks.example import for_template
    from jaxkv.tasks.seeds import EVAL_SEED_BASE

    out = []
    for ex in agent_traces(n, EVAL_SEED_BASE + CAPACITY_SEED_OFFSET, length=length):
        ex = for_template(ex, model.tokenizer)
        at = [j for j, m in enumerate(ex.messages) if m["role"] == "assistant"]
        at = at[:turns] if turns else at
        histories = [ex.messages[:j] for j in at]
        tokens = [int(render(model.tokenizer, h, ex.tools or None, add_generation_prompt=True).ids.size) for h in histories]
        out.append(SessionPlan(histories, ex.tools or None, tokens, tokens[-1] + len(at) * max_new_tokens))
    return out


def kinds_for(model, names) -> list[Kind]:
    """The formats to run; a triaxial one with its INT2 page share from the
    model's calibrated budget B (``(4 - B) / 2``)."""
    from jaxkv.serving.stages.quantization import resolve_allocation

    out = []
    for name in names:
        name = name.strip()
        if name in ("none", "float"):
            out.append(Kind("float", None))
        elif name.startswith("triaxial"):
            budget = resolve_allocation(model, name, None).budget
            out.append(Kind(f"{name} (B = {budget:g})", name, (4.0 - budget) / 2.0))
        else:
            out.append(Kind(name, name))
    return out


def pool_tokens(pool) -> int:
    """Tokens a pool holds: the token region, plus a quantized pool's INT2 pages."""
    geometry = getattr(pool, "geometry", None)
    pages = 0 if geometry is None else geometry.pages - 1  # page 0 is reserved
    return int(pool.allocator.capacity) + PAGE * pages


def sessions_held(capacity: int, footprints) -> int:
    """Sessions added in order while the pool holds all of them at once."""
    held, used = 0, 0
    for f in footprints:
        if used + f > capacity:
            break
        held, used = held + 1, used + f
    return held


def size_pool(model, kind: Kind, budget: int):
    """The pool ``Server(kv_memory_bytes=budget)`` builds for ``kind`` (no device memory)."""
    from jaxkv.cache.pools import pool_for_bytes
    from jaxkv.cache.state import float_pool_dtype

    return pool_for_bytes(
        kind.kv_quant, budget, model.config, float_dtype=float_pool_dtype(model.dtype, jax.default_backend()), page_share=kind.page_share
    )


def float_budget(model, footprints) -> int:
    """Bytes of the float pool that holds exactly ``footprints`` (the sentinel included)."""
    from jaxkv.cache.pools import FloatKV, kv_bytes
    from jaxkv.cache.state import float_pool_dtype

    dtype = float_pool_dtype(model.dtype, jax.default_backend())
    per_slot = kv_bytes(jax.eval_shape(FloatKV(2).cache_factory(model.config, rows=1, positions=1, dtype=dtype))) // 2
    return per_slot * (1 + sum(footprints))


def run_kind(model, kind: Kind, budget: int, session_plans, max_new_tokens: int) -> dict:
    """Every planned session at once on one server of ``budget`` KV bytes."""
    import jaxkv
    from jaxkv import compiles
    from jaxkv.cache.pools import kv_bytes

    n = len(session_plans)
    max_positions = -(-max(p.footprint for p in session_plans) // 256) * 256
    turns, lock = [], threading.Lock()
    errors = []
    with jaxkv.Server(
        model, rows=n, max_positions=max_positions, kv_quant=kind.kv_quant, kv_memory_bytes=budget, kv_page_share=kind.page_share
    ) as server:
        pool_bytes = kv_bytes(server.engine.cache)
        sessions = [server.session(session_id=f"capacity{i}", max_new_tokens=max_new_tokens) for i in range(n)]

        def run(i):
            try:
                for t, history in enumerate(session_plans[i].histories):
                    turn = sessions[i].start_chat(history, session_plans[i].tools, max_new_tokens=max_new_tokens, ignore_eos=True).result()
                    with lock:
                        turns.append((i, t, turn.prompt_tokens, turn.cached_tokens, len(turn.reply_ids)))
            except Exception as err:  # reported, not raised: the other sessions' numbers still stand
                with lock:
                    errors.append(f"session {i}: {type(err).__name__}: {err}")

        compile0, programs0 = COMPILE_SECONDS[0], compiles.count()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        compile_s, programs = COMPILE_SECONDS[0] - compile0, compiles.count() - programs0
        snap = server.snapshot()
        tokens = pool_tokens(server.engine.pool)
    by = {(i, t): (p, c) for i, t, p, c, _ in turns}
    reprefilled = sum(1 for (i, t), (p, c) in by.items() if t > 0 and c < by.get((i, t - 1), (0, 0))[0] - 1)
    generated = sum(g for *_, g in turns)
    prefilled = snap["prompt_tokens"] - snap["cached_tokens"]
    busy = max(wall - compile_s, 1e-9)
    return {
        "kind": kind.label,
        "budget": budget,
        "pool_bytes": pool_bytes,
        "pool_tokens": tokens,
        "sessions": n,
        "turns": len(turns),
        "prefilled": prefilled,
        "generated": generated,
        "wall_s": wall,
        "compile_s": compile_s,
        "programs": programs,
        "gen_tok_s": generated / busy,
        "served_tok_s": (prefilled + generated) / busy,
        "radix_evicted": snap["radix_evicted_slots"],
        "reprefilled_turns": reprefilled,
        "errors": errors,
    }


def render_report(meta: dict, rows: list[dict]) -> str:
    """The markdown report: header (command, machine, threads, load), one table
    row per format with its ratios against the first (float) row, the goal line."""
    base = rows[0]
    lines = [
        f"# Throughput at a fixed KV memory: {meta['model']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}; jax {meta['jax']} ({meta['backend']}). Threads: {meta['threads']}.",
        f"Load average (1/5/15 min) before the run: {meta['load_before']}; after: {meta['load_after']}.",
        "",
        f"Workload: {meta['workload']}",
        "",
        f"KV budget: **{meta['budget'] / 2**20:.1f} MiB** ({meta['budget']:,} bytes; {meta['budget_note']}). "
        "Pool tokens: the token region plus INT2 pages; pool MiB: the pool's device bytes (codes, scales, zero points).",
        "",
        md_table(
            [
                "pool",
                "pool tokens",
                "pool MiB",
                "sessions held",
                "x float",
                "turns",
                "prefilled tokens",
                "generated tokens",
                "wall s",
                "compile s",
                "generated tok/s",
                "x float",
                "served tok/s",
                "x float",
                "radix evicted slots",
                "re-prefilled turns",
            ],
            [
                [
                    r["kind"],
                    f"{r['pool_tokens']:,}",
                    f"{r['pool_bytes'] / 2**20:.1f}",
                    r["sessions"],
                    f"{r['sessions'] / base['sessions']:.2f}x",
                    r["turns"],
                    f"{r['prefilled']:,}",
                    f"{r['generated']:,}",
                    f"{r['wall_s']:.1f}",
                    f"{r['compile_s']:.1f}",
                    f"{r['gen_tok_s']:.1f}",
                    f"{r['gen_tok_s'] / base['gen_tok_s']:.2f}x",
                    f"{r['served_tok_s']:.1f}",
                    f"{r['served_tok_s'] / base['served_tok_s']:.2f}x",
                    r["radix_evicted"],
                    r["reprefilled_turns"],
                ]
                for r in rows
            ],
            "l" + "r" * 15,
        ),
    ]
    lines += [
        "",
        "Tokens/s are over the wall time less the XLA compile seconds inside it (compiles counted: "
        + ", ".join(f"{r['kind']} {r['programs']}" for r in rows)
        + ").",
    ]
    for r in rows:
        for e in r["errors"]:
            lines.append(f"- {r['kind']}: {e}")
    tri = [r for r in rows if r["kind"].startswith("triaxial")]
    for r in tri:
        s, g = r["sessions"] / base["sessions"], r["gen_tok_s"] / base["gen_tok_s"]
        lines += [
            "",
            f"Goal (issue #60): TriAxialKV >= 3x the float pool's sessions and >= 1.0x its tokens/s. {r['kind']}: "
            f"{s:.2f}x sessions ({'met' if s >= 3 else 'missed'}), {g:.2f}x generated tokens/s ({'met' if g >= 1 else 'missed'}).",
        ]
    return "\n".join(lines) + "\n"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def threads() -> str:
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    env = {k: os.environ[k] for k in ("XLA_FLAGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS") if k in os.environ}
    return f"CPU affinity {affinity} (no pinning beyond it), thread variables {env or 'none set'}"


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kinds", default="none,int4,triaxial", help="pool formats, the float pool first (the ratios' base)")
    ap.add_argument("--float-sessions", type=int, default=2, help="budget = what the float pool needs for this many sessions")
    ap.add_argument("--budget-mib", type=float, default=None, help="the KV budget in MiB (instead of --float-sessions)")
    ap.add_argument("--length", type=int, default=1024, help="trace length (agent_traces' target, task tokenizer)")
    ap.add_argument("--turns", type=int, default=0, help="assistant turns per session (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-traces", type=int, default=48, help="the most sessions any format may hold")
    ap.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run every format once untimed first (default; --no-warmup subtracts compile seconds instead)",
    )
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    import jaxkv

    load_before = load()
    model = jaxkv.load_model(args.model)
    names = [k.strip() for k in args.kinds.split(",")]
    if names[0] not in ("none", "float"):
        raise SystemExit("--kinds must start with the float pool (none): the ratios are against it")
    kinds = kinds_for(model, names)
    pool_plans = plans(model, args.max_traces, args.length, args.turns, args.max_new_tokens)
    footprints = [p.footprint for p in pool_plans]
    if args.budget_mib is not None:
        budget, note = int(args.budget_mib * 2**20), "--budget-mib"
    else:
        budget = float_budget(model, footprints[: args.float_sessions])
        note = f"what the float pool needs for the first {args.float_sessions} sessions"
    held = {}
    for k in kinds:
        tokens = pool_tokens(size_pool(model, k, budget))
        held[k.label] = sessions_held(tokens, footprints)
        print(f"{k.label}: {tokens:,} tokens in {budget:,} bytes -> {held[k.label]} sessions", flush=True)
    capped = [k for k, n in held.items() if n == len(footprints)]
    if args.warmup:
        for k in kinds:
            run_kind(model, k, budget, pool_plans[: held[k.label]], args.max_new_tokens)
    rows = []
    for k in kinds:
        r = run_kind(model, k, budget, pool_plans[: held[k.label]], args.max_new_tokens)
        print(r, flush=True)
        rows.append(r)
    turns_note = f"{args.turns} turns" if args.turns else "every assistant turn"
    lengths = [p.prompt_tokens[-1] for p in pool_plans]
    meta = {
        "model": args.model,
        "command": "python -m eval.bench.capacity " + " ".join(shlex.quote(a) for a in argv),
        "machine": machine(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "threads": threads(),
        "load_before": load_before,
        "load_after": load(),
        "budget": budget,
        "budget_note": note,
        "workload": (
            f"held-out agent traces (`agent_traces(length={args.length})`, rendered for the model's template: "
            f"last prompts {min(lengths)}-{max(lengths)} tokens), {turns_note} per session, "
            f"{args.max_new_tokens} generated tokens per turn (greedy, `ignore_eos`), one row and one thread per session; "
            f"{'a warm-up run of every format first' if args.warmup else 'no warm-up run'}."
            + (f" Capped at --max-traces {args.max_traces} sessions: {', '.join(capped)}." if capped else "")
        ),
    }
    text = render_report(meta, rows)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
