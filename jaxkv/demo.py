"""``jaxkv demo``: the main job, a multi-turn agent run through the engine and radix cache.

The demo loads the embedded agent model (``jaxkv/assets/embedded-agent``, or any
checkpoint with a tokenizer via ``--model PATH``) and runs ``turns`` generated tasks
(``eval.tasks``; held-out seeds derived from ``--seed``) as agent sessions on one
``jaxkv.session.Server`` (one paged pool, one radix prefix cache):

* **agent trace** tasks run a real agent loop: the model's own reply is parsed; each
  tool call is executed against the task's simulated environment (the recorded tool
  responses, keyed by tool name and arguments; a call the environment does not know
  gets an error result), the result is appended as a ``tool`` message and the model
  is asked again, until it answers without a tool call (or ``MAX_AGENT_STEPS``);
* **split-query needle** tasks (MQ-NIAH, 4 needles) ask two questions about one long
  document in two user turns; the second turn reuses the document from the radix cache.

Each request prints its prefix hit, what the model did (tool calls, or its answer,
marked right or wrong against the task's target) and the tool result abbreviated.
The final table: task accuracy (an agent task counts when its final answer is exact,
a needle task when both answers are), peak request tokens, prefix-hit rate and KV
reads from the sessions' shared ``Metrics``, then the per-session metrics table.

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
    from train.embedded_model import embedded_tokenizer

    tok = embedded_tokenizer()
    cfg = ModelConfig(
        model_type="qwen3", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, qk_norm=True, tie_word_embeddings=True,
        max_position_embeddings=4096, eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
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
    req = session.metrics.requests[-1]
    return f"  {label}: {req.prefix_hit_tokens:>4}/{req.prompt_tokens:<4} prompt tokens cached; model {_describe(reply)}{mark}"


def run_agent_task(session, example, out=print) -> bool:
    """The agent loop on one trace; True when the final answer is exact."""
    env = ToolEnvironment(example)
    messages = [dict(m) for m in example.messages[:2]]
    expected = example.targets[-1].expected
    out(f"  user: {_short(messages[1]['content'], 110)}")
    for step in range(1, MAX_AGENT_STEPS + 1):
        reply = session.chat(messages, example.tools, max_new_tokens=MAX_NEW_TOKENS)
        calls = reply.get("tool_calls") or []
        if not calls:
            ok = (reply.get("content") or "").strip() == expected
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
    msgs = example.messages
    out(f"  user: document of {len(msgs[1]['content'])} characters; "
        f"{_short(msgs[1]['content'].rsplit(chr(10), 1)[-1], 80)}")
    ok = True
    history = [dict(m) for m in msgs[:2]]
    for turn, target in enumerate(example.targets, 1):
        if turn == 2:
            out(f"  user: {_short(msgs[3]['content'], 80)}")
            history.append(dict(msgs[3]))
        reply = session.chat(history, None, max_new_tokens=MAX_NEW_TOKENS)
        right = (reply.get("content") or "").strip() == target.expected and not reply.get("tool_calls")
        ok &= right
        out(_request_line(session, f"turn {turn}", reply, "  [right]" if right else f"  [wrong: expected {target.expected!r}]"))
        history.append(_assistant_message(reply))
    return ok


def demo_tasks(n: int, seed: int, length: int = 2048):
    """``n`` tasks, alternating agent trace and 4-needle MQ-NIAH (held-out seeds)."""
    from eval.tasks.agent import one_trace
    from eval.tasks.mqniah import one_mqniah

    base = DEMO_SEED_BASE + 1000 * seed
    return [one_trace(base + i, length=length) if i % 2 == 0 else one_mqniah(base + i, needles=4, length=length)
            for i in range(n)]


def run_demo(model_path: str | None = None, turns: int = 4, seed: int = 0, length: int = 2048) -> int:
    """Run ``turns`` generated agent tasks (each a multi-turn session); returns 0."""
    import jaxkv
    from jaxkv.metrics import Metrics
    from jaxkv.models.loading import EMBEDDED_DIR
    from jaxkv.session import Server

    t_start = time.perf_counter()
    if model_path is None and (EMBEDDED_DIR / "config.json").is_file():
        model_path = "embedded"
    with tempfile.TemporaryDirectory() as tmp:
        if model_path is None:
            print("jaxkv demo: the embedded model is not installed; using a tiny random Qwen3 (replies are noise)")
            model_path = build_random_checkpoint(tmp)
        model = jaxkv.load_model(model_path)
        cfg = model.config
        print(f"model {model_path}: {cfg.model_type}, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
              f"width {cfg.hidden_size}, vocab {cfg.vocab_size} ({time.perf_counter() - t_start:.1f}s)")
        tasks = demo_tasks(turns, seed, length)
        positions = min(cfg.max_position_embeddings, max(4096, length * 2))
        server = Server(model, max_positions=positions)
        metrics = Metrics()
        results = []
        for i, ex in enumerate(tasks, 1):
            session = server.session(max_new_tokens=MAX_NEW_TOKENS, session_id=f"task{i}-{ex.task}")
            session.metrics = metrics
            kind = "agent trace" if ex.task == "agent_traces" else "MQ-NIAH, 4 needles"
            print(f"\ntask {i}/{len(tasks)} ({kind}, ~{ex.approx_tokens()} tokens, seed {ex.seed})")
            t0 = time.perf_counter()
            ok = run_agent_task(session, ex) if ex.task == "agent_traces" else run_needle_task(session, ex)
            results.append((ex.task, ok))
            print(f"  -> {'solved' if ok else 'not solved'} in {time.perf_counter() - t0:.1f}s")

        agg = metrics.as_dict()
        rows = [("task accuracy", f"{sum(ok for _, ok in results)}/{len(results)}")]
        for task, name in (("agent_traces", "  agent traces"), ("mqniah", "  MQ-NIAH (both turns)")):
            sel = [ok for t, ok in results if t == task]
            if sel:
                rows.append((name, f"{sum(sel)}/{len(sel)}"))
        rows += [
            ("requests", str(len(metrics.requests))),
            ("peak request tokens", str(agg["peak_request_tokens"])),
            ("prefix-hit rate", f"{100 * agg['prefix_hit_rate']:.1f}% ({agg['prefix_hit_tokens']} tokens)"),
            ("KV reads (raw / effective)", f"{agg['raw_kv_reads']:,} / {agg['effective_kv_reads']:,}"),
            ("wall time", f"{time.perf_counter() - t_start:.1f}s"),
        ]
        width = max(len(k) for k, _ in rows)
        print("\n| metric" + " " * (width - 6) + " | value |")
        print("|" + "-" * (width + 2) + "|-------|")
        for k, v in rows:
            print(f"| {k.ljust(width)} | {v} |")
        print()
        print(metrics.table())
    return 0
