"""``jaxkv demo``: the main job, agent sessions served at once, full cache vs managed cache.

The demo loads the embedded agent model (``jaxkv/assets/embedded-agent``, or any
checkpoint with a tokenizer via ``--model PATH``) and runs ``turns`` generated tasks
(``jaxkv.tasks``; held-out seeds derived from ``--seed``) as agent sessions, twice:

1. **full cache**: every session keeps all of its KV;
2. **managed cache**: a retention policy (``--policy``; default the learned IntentKV
   head for the embedded model, whose shipped head beats every baseline at 1,280
   and 1,536 in ``eval/results/harness_intentkv/``, SnapKV for any other model) keeps
   ``--budget`` live history tokens per request (dead-slot layout, so the radix
   cache keeps its prefix hits), and RepairKV (``--repair`` K rows per turn
   boundary) brings evicted rows back from the host tier when the next turn needs
   them.

Each run serves all its sessions at once on one ``Server`` (one paged pool, one
radix prefix cache, ``--rows`` engine rows): one thread per session, the scheduler
batching their prefills and decode steps (continuous batching). Tasks:

* **agent trace** tasks run a real agent loop: the model's own reply is parsed; each
  tool call is executed against the task's simulated environment (the recorded tool
  responses, keyed by tool name and arguments; a call the environment does not know
  gets an error result), the result is appended as a ``tool`` message and the model
  is asked again, until it answers without a tool call (or ``MAX_AGENT_STEPS``);
* **split-query needle** tasks (MQ-NIAH, 4 needles) ask two questions about one long
  document in two user turns; the second turn reuses the document from the radix cache.

Each task prints, when it ends, its requests (prefix hit, what the model did, right
or wrong against the task's target). The final table compares the two runs side by
side: task accuracy (an agent task counts when its final answer is exact, a needle
task when both answers are), peak live KV, raw vs effective KV reads (IntentKV
§4.1), prefix-hit rate, and wall time.

Tasks alternate agent trace / MQ-NIAH; ``length`` (default 2,048 tokens) is the
generators' target conversation length.
"""

from __future__ import annotations

import json
import tempfile
import time

MAX_AGENT_STEPS = 8
MAX_NEW_TOKENS = 160
DEMO_SEED_BASE = (1 << 30) + 9_000_000  # held out: training seeds are < 1 << 30


def build_random_checkpoint(folder) -> str:
    """Save a tiny random Qwen3 with the task tokenizer to ``folder``; returns its path.

    Used only when the embedded model is not installed (its replies are noise).
    """
    import jaxkv
    from jaxkv.config import ModelConfig
    from jaxkv.tasks import embedded_tokenizer

    tok = embedded_tokenizer()
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
    )
    jaxkv.save_pretrained(jaxkv.model_from_config(cfg, seed=0, tokenizer=tok), folder)
    return str(folder)


def _short(text, n: int = 72) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _args(arguments) -> dict | None:
    if isinstance(arguments, dict):
        return arguments
    try:
        out = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return None
    return out if isinstance(out, dict) else None


def _call_key(name: str, arguments) -> str:
    return json.dumps([name, _args(arguments)], sort_keys=True)


class ToolEnvironment:
    """The simulated tools of one agent trace: recorded results, keyed by call."""

    def __init__(self, example):
        self.results = {}
        msgs = example.messages
        for i, m in enumerate(msgs):
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                self.results[_call_key(fn["name"], fn["arguments"])] = msgs[i + 1]["content"]

    def __call__(self, name: str, arguments) -> str:
        found = self.results.get(_call_key(name, arguments))
        return found if found is not None else f"Error: no {name} result for {_short(arguments, 40)}"


def _describe(reply: dict) -> str:
    calls = reply.get("tool_calls") or []
    if calls:
        parts = []
        for c in calls:
            args = _args(c["function"]["arguments"])
            shown = ", ".join(f"{k}={v}" for k, v in args.items()) if args else c["function"]["arguments"]
            parts.append(f"{c['function']['name']}({shown})")
        return "calls " + "; ".join(parts)
    return f"answers {_short(reply.get('content', ''))!r}"


def _assistant_message(reply: dict) -> dict:
    msg = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("reasoning_content"):
        msg["reasoning_content"] = reply["reasoning_content"]
    if reply.get("tool_calls"):
        msg["tool_calls"] = reply["tool_calls"]
    return msg


def _request_line(session, label: str, reply: dict, mark: str = "") -> str:
    req = [r for r in session.metrics.requests if r.session_id == session.session_id][-1]  # metrics may be shared
    return f"  {label}: {req.prefix_hit_tokens:>4}/{req.prompt_tokens:<4} prompt tokens cached; model {_describe(reply)}{mark}"


def run_agent_task(session, example, out=print) -> bool:
    """The agent loop on one trace; True when the final answer is exact."""
    from jaxkv.tasks import reply_matches

    env = ToolEnvironment(example)
    messages = [dict(m) for m in example.messages[:2]]
    expected = example.targets[-1].expected
    out(f"  user: {_short(messages[1]['content'], 110)}")
    for step in range(1, MAX_AGENT_STEPS + 1):
        reply = session.chat(messages, example.tools, max_new_tokens=MAX_NEW_TOKENS)
        calls = reply.get("tool_calls") or []
        if not calls:
            ok = reply_matches(example.targets[-1], reply)
            out(_request_line(session, f"step {step}", reply, "  [right]" if ok else f"  [wrong: expected {expected!r}]"))
            return ok
        out(_request_line(session, f"step {step}", reply))
        messages.append(_assistant_message(reply))
        for c in calls:
            result = env(c["function"]["name"], c["function"]["arguments"])
            lines = result.split("\n")
            out(f"      tool {c['function']['name']} -> {_short(lines[0], 48)} (+{len(lines) - 1} lines)")
            messages.append({"role": "tool", "name": c["function"]["name"], "content": result})
    out(f"  no answer after {MAX_AGENT_STEPS} steps  [wrong]")
    return False


def run_needle_task(session, example, out=print) -> bool:
    """Two user turns about one document; True when both answers are exact."""
    from jaxkv.tasks import reply_matches

    msgs = example.messages
    out(f"  user: document of {len(msgs[1]['content'])} characters; {_short(msgs[1]['content'].rsplit(chr(10), 1)[-1], 80)}")
    ok = True
    history = [dict(m) for m in msgs[:2]]
    for turn, target in enumerate(example.targets, 1):
        if turn == 2:
            out(f"  user: {_short(msgs[3]['content'], 80)}")
            history.append(dict(msgs[3]))
        reply = session.chat(history, None, max_new_tokens=MAX_NEW_TOKENS)
        right = reply_matches(target, reply)
        ok &= right
        out(_request_line(session, f"turn {turn}", reply, "  [right]" if right else f"  [wrong: expected {target.expected!r}]"))
        history.append(_assistant_message(reply))
    return ok


def run_retrieval_task(session, example, out=print) -> bool:
    """A passkey / needle task (``jaxkv.tasks.haystack``) in the question-agnostic
    setting: the document turn is replayed (its recorded acknowledgement
    teacher-forced, so a managed cache compresses the document before the question
    exists), then the question is answered greedily with the
    reply started by the reference reply's words before the value (``reply_prefix``)."""
    from jaxkv.tasks.haystack import reply_correct, reply_prefix

    msgs = example.messages("agnostic")
    what = "passkey" if example.task == "passkey" else f"needle ({example.labels['variant']})"
    depths = ", ".join(f"{n['depth']:.2f}" for n in example.labels["needles"])
    out(f"  user: {what} document of ~{example.labels['prompt_tokens']:,} tokens (needle depth {depths})")
    session.replay(msgs[:2])
    out(_request_line(session, "turn 1", {"content": msgs[1]["content"]}, "  (recorded)"))
    reply = session.chat(msgs[:3], max_new_tokens=8 * len(example.values) + 8, reply_prefix=reply_prefix(example))
    text = (reply.get("content") or "").strip()
    ok = reply_correct(example, text)
    expected = ", ".join(example.values)
    out(f"  user: {_short(msgs[2]['content'], 80)}")
    out(_request_line(session, "turn 2", reply, "  [right]" if ok else f"  [wrong: expected {expected}]"))
    return ok


def retrieval_tasks(n: int, seed: int, length: int, tokenizer):
    """``n`` tasks for a pretrained model (``jaxkv.tasks.haystack``), alternating
    passkey and single-needle NIAH over the prose haystack (held-out seeds), run
    question-agnostic; ``length`` is the document and question's tokens."""
    from jaxkv.tasks.haystack import niah, passkey

    base = DEMO_SEED_BASE + 1000 * seed
    return [
        passkey(1, length=length, seed=base + i, tokenizer=tokenizer)[0]
        if i % 2 == 0
        else niah(1, length=length, seed=base + i, tokenizer=tokenizer, variant="single")[0]
        for i in range(n)
    ]


def demo_tasks(n: int, seed: int, length: int = 2048):
    """``n`` tasks, alternating agent trace and 4-needle MQ-NIAH (held-out seeds)."""
    from jaxkv.tasks.agent import one_trace
    from jaxkv.tasks.mqniah import one_mqniah

    base = DEMO_SEED_BASE + 1000 * seed
    return [one_trace(base + i, length=length) if i % 2 == 0 else one_mqniah(base + i, needles=4, length=length) for i in range(n)]


KINDS = {"agent_traces": "agent traces", "mqniah": "MQ-NIAH (both turns)", "passkey": "passkey", "niah_single": "needle in a haystack"}

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile_seconds = [0.0]


def _count_compiles() -> None:
    """Sum JAX's tracing + lowering + XLA compile time (once per process)."""
    import jax

    if getattr(_count_compiles, "done", False):
        return
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: _compile_seconds.__setitem__(0, _compile_seconds[0] + secs) if name in _COMPILE_EVENTS else None
    )
    _count_compiles.done = True


def run_mode(model, tasks, *, label: str, rows: int, positions: int, options: dict, out=print) -> dict:
    """Run every task as its own session, all at once on one server; returns the
    mode's row of the final table (and prints each task's transcript when it ends)."""
    import threading

    from jaxkv.metrics import Metrics
    from jaxkv.serving import Server

    metrics = Metrics()
    results: list = [None] * len(tasks)
    lock = threading.Lock()

    def run_task(i, ex, server):
        opts = dict(options)
        if opts.get("policy") and ex.task in (
            "mqniah",
            "passkey",
            "niah_single",
        ):  # the document is the user turn: not protected as the query
            opts["protect_query"] = False
        session = server.session(max_new_tokens=MAX_NEW_TOKENS, session_id=f"task{i + 1}-{ex.task}", **opts)
        session.metrics = metrics
        lines = []
        t0 = time.perf_counter()
        runner = {"agent_traces": run_agent_task, "mqniah": run_needle_task}.get(ex.task, run_retrieval_task)
        try:
            ok = runner(session, ex, lines.append)
        except Exception as err:  # shown, counted wrong; the other sessions go on
            lines.append(f"  failed: {type(err).__name__}: {err}")
            ok = False
        finally:
            session.close()
        kind = KINDS.get(ex.task, ex.task)
        tokens = ex.labels.get("prompt_tokens") or ex.approx_tokens()
        with lock:
            out(f"\n[{label}] task {i + 1}/{len(tasks)} ({kind}, ~{tokens} tokens, seed {ex.seed})")
            for line in lines:
                out(line)
            out(f"  -> {'solved' if ok else 'not solved'} in {time.perf_counter() - t0:.1f}s")
        results[i] = (ex.task, ok)

    _count_compiles()
    compile0 = _compile_seconds[0]
    t_start = time.perf_counter()
    with Server(model, rows=rows, max_positions=positions) as server:
        threads = [threading.Thread(target=run_task, args=(i, ex, server)) for i, ex in enumerate(tasks)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    agg = metrics.as_dict()
    return {
        "task accuracy": f"{sum(ok for _, ok in results)}/{len(results)}",
        **{task: _share(results, task) for task in dict.fromkeys(t for t, _ in results)},
        "requests": str(len(metrics.requests)),
        "peak request tokens": f"{agg['peak_request_tokens']:,}",
        "peak live KV": f"{agg['peak_live_kv']:,}",
        "KV reads (raw / effective)": f"{agg['raw_kv_reads']:,} / {agg['effective_kv_reads']:,}",
        "prefix-hit rate": f"{100 * agg['prefix_hit_rate']:.1f}%",
        "wall time (of it, jit compiles)": f"{time.perf_counter() - t_start:.1f}s ({_compile_seconds[0] - compile0:.1f}s)",
    }


def _share(results, task) -> str:
    sel = [ok for t, ok in results if t == task]
    return f"{sum(sel)}/{len(sel)}" if sel else "-"


def print_table(columns: dict, out=print) -> None:
    """Metrics down, modes across, as a markdown table."""
    names = list(columns)
    keys = list(next(iter(columns.values())))
    labels = {task: f"  {kind}" for task, kind in KINDS.items()}
    rows = [["metric", *names]] + [[labels.get(k, k), *(columns[n][k] for n in names)] for k in keys]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for j, r in enumerate(rows):
        out("| " + " | ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths))) + " |")
        if j == 0:
            out("|" + "|".join("-" * (w + 1) + (":" if c else "-") for c, w in enumerate(widths)) + "|")


def run_demo(
    model_path: str | None = None,
    turns: int = 4,
    seed: int = 0,
    length: int = 2048,
    *,
    policy: str | None = None,
    budget: int = 1280,
    repair: int = 64,
    rows: int | None = None,
) -> int:
    """Run ``turns`` generated agent tasks with the full cache, then with the managed
    cache, all sessions of a run at once; print both and the side-by-side table."""
    import jaxkv
    from jaxkv.models.loading import EMBEDDED_DIR

    t_start = time.perf_counter()
    if model_path is None and (EMBEDDED_DIR / "config.json").is_file():
        model_path = "embedded"
    with tempfile.TemporaryDirectory() as tmp:
        made_random = model_path is None
        if made_random:
            print("jaxkv demo: the embedded model is not installed; using a tiny random Qwen3 (replies are noise)")
            model_path = build_random_checkpoint(tmp)
        model = jaxkv.load_model(model_path)
        cfg = model.config
        synthetic = model_path == "embedded" or made_random
        if policy is None:  # the shipped IntentKV head was trained for the embedded model only
            policy = "intentkv" if model_path == "embedded" else "snapkv"
        print(
            f"model {model_path}: {cfg.model_type}, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
            f"width {cfg.hidden_size}, vocab {cfg.vocab_size} ({time.perf_counter() - t_start:.1f}s)"
        )
        if synthetic:
            tasks = demo_tasks(turns, seed, length)
        else:
            print(
                f"tasks for a pretrained model: passkey and needle retrieval at {length:,} tokens, question-agnostic "
                f"(the document is compressed at the end of turn 1, the question comes in turn 2)"
            )
            tasks = retrieval_tasks(turns, seed, length, model.tokenizer)
        positions = min(cfg.max_position_embeddings, max(4096, length * 2))
        rows = rows or len(tasks)
        managed = dict(policy=policy, budget=budget, layout="dead_slot")
        if repair:
            managed.update(repair=repair)
        modes = {"full cache": {}, f"managed ({policy} B={budget}, dead-slot" + (f", RepairKV K={repair})" if repair else ")"): managed}
        columns = {}
        for label, options in modes.items():
            print(f"\n=== {label}: {len(tasks)} sessions at once on one server ({rows} rows)")
            columns[label] = run_mode(model, tasks, label=label, rows=rows, positions=positions, options=options)
        print()
        print_table(columns)
        print(f"\ntotal {time.perf_counter() - t_start:.1f}s")
    return 0
