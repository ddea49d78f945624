"""Full-cache exact-match accuracy of the embedded model on held-out generated tasks.

    JAX_PLATFORMS=cpu python -m eval.quality.embedded_accuracy [--model embedded] [--n 200]
        [--length 2048] [--out table.md]

What it measures (issue 4): for ``--n`` held-out examples of each task,

* **MQ-NIAH** (``jaxkv.tasks.mqniah``, 4 needles, split query): both assistant turns;
  a turn is correct when its answer (``key: value, ...``) equals the target exactly.
* **Agent traces** (``jaxkv.tasks.agent_traces``): every assistant turn (``search``,
  ``open``, ``lookup`` calls and the final answer); a tool-call turn is correct when
  the parsed call's name and JSON arguments equal the target's, an answer turn when
  its content equals the target's.

Each scored turn is replayed with teacher-forced history (the recorded conversation
before it, rendered by the model's chat template with the generation prompt) and
generated greedily until ``<|im_end|>``; the reply is parsed with
``jaxkv.chat.parse_assistant``. Everything runs through jaxkv's ``Engine`` with the
full cache: one cache row per example; a turn's prompt reuses the row's cached prefix
(the row is truncated to the longest common prefix with the previous request, so the
discarded generation and any re-rendered tail are recomputed), then the new suffix is
prefilled and decoded. Rows of several examples run as one batch.

Held-out examples: per-example seeds ``ACCURACY_SEED_BASE + i`` (MQ-NIAH) and
``ACCURACY_SEED_BASE + 100_000 + i`` (agent traces; ``jaxkv.tasks.seeds``). Bit 30 is set in all of them;
the trainer (``train.embedded_model``) draws its training example seeds below
``1 << 30``, so the two sets are disjoint by construction.

``--length`` is the generator's target conversation length; by default the examples
are generated so that the longest request of every example holds at least 2,048
tokens (``length + LENGTH_MARGIN``); the table reports the request sizes actually measured.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np

from jaxkv.markdown import md_table
from jaxkv.tasks.example import reply_matches
from jaxkv.tasks.seeds import ACCURACY_SEED_BASE

LENGTH_MARGIN = 80  # tokens added to --length so every MQ-NIAH request and the last agent request are >= --length


@dataclass
class Job:
    """One scored assistant turn: its request and what it must produce."""

    example: int
    kind: str  # "answer" or "tool_call"
    expected: object
    prompt: list[int]
    label: str  # turn label in the table: "turn 1", "open", ...
    generated: dict | None = None
    correct: bool | None = None


@dataclass
class ExampleJobs:
    task: str
    jobs: list[Job] = field(default_factory=list)
    tool_names: list[str] | None = None


def heldout_examples(task: str, n: int, length: int):
    """The held-out examples (seeds documented in the module docstring)."""
    from jaxkv.tasks.agent import one_trace
    from jaxkv.tasks.mqniah import one_mqniah

    if task == "mqniah":
        return [one_mqniah(ACCURACY_SEED_BASE + i, needles=4, length=length) for i in range(n)]
    return [one_trace(ACCURACY_SEED_BASE + 100_000 + i, length=length) for i in range(n)]


def example_jobs(tokenizer, idx: int, example) -> ExampleJobs:
    from jaxkv.chat.render import render

    out = ExampleJobs(example.task, tool_names=[t["function"]["name"] for t in example.tools] or None)
    for n, t in enumerate(example.targets):
        prompt = render(tokenizer, example.messages[: t.message_index], example.tools or None, add_generation_prompt=True)
        label = f"turn {n + 1}" if example.task == "mqniah" else (t.expected["name"] if t.kind == "tool_call" else "answer")
        out.jobs.append(Job(idx, t.kind, t.expected, prompt.ids.tolist(), label))
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def run_jobs(model, examples: list[ExampleJobs], *, batch: int = 8, max_new_tokens: int = 128, progress=None) -> None:
    """Generate every job's reply greedily through one ``Engine`` (full cache), in place."""
    from jaxkv.buckets import bucket
    from jaxkv.chat.parse import parse_assistant, stop_token_ids
    from jaxkv.engine import Engine

    tok = model.tokenizer
    stop = sorted(stop_token_ids(model))
    longest = max(len(j.prompt) for ex in examples for j in ex.jobs) + max_new_tokens + 1
    P = min(bucket(longest, step=512), model.config.max_position_embeddings)
    engine = Engine(model, rows=batch, max_positions=P)
    for start in range(0, len(examples), batch):
        group = examples[start : start + batch]
        rows = [engine.open_row() for _ in group]
        cached: list[list[int]] = [[] for _ in group]
        for k in range(max(len(ex.jobs) for ex in group)):
            active = [i for i, ex in enumerate(group) if k < len(ex.jobs)]
            suffixes = []
            for i in active:
                prompt = group[i].jobs[k].prompt
                keep = min(_common_prefix(cached[i], prompt), len(prompt) - 1)
                engine.truncate_row(rows[i], keep)
                suffixes.append(prompt[keep:])
                cached[i] = list(prompt)
            logits = engine.prefill([rows[i] for i in active], suffixes)
            first = [int(np.argmax(lg)) for lg in logits]
            todo = [n for n, t in enumerate(first) if t not in stop]
            replies = {n: [t] for n, t in enumerate(first)}
            if todo and max_new_tokens > 1:
                toks, _ = engine.decode([rows[active[n]] for n in todo], [first[n] for n in todo], max_new_tokens - 1, stop_token_ids=stop)
                for n, t in zip(todo, toks):
                    replies[n] += t
            for n, i in enumerate(active):
                job = group[i].jobs[k]
                text = tok.decode(replies[n], skip_special_tokens=False)
                job.generated = parse_assistant(text, group[i].tool_names)
                job.correct = reply_matches(job, job.generated)
        for r in rows:
            engine.close_row(r)
        if progress is not None:
            progress(len(group))


def summarize(task: str, examples: list[ExampleJobs]) -> list[dict]:
    """Table rows: every label, then all turns, then whole examples."""
    jobs = [j for ex in examples for j in ex.jobs]
    labels = list(dict.fromkeys(j.label for j in jobs))
    rows = []
    for label in labels:
        sel = [j.correct for j in jobs if j.label == label]
        rows.append({"task": task, "scored": label, "n": len(sel), "acc": float(np.mean(sel))})
    rows.append({"task": task, "scored": "all scored turns", "n": len(jobs), "acc": float(np.mean([j.correct for j in jobs]))})
    whole = [all(j.correct for j in ex.jobs) for ex in examples]
    rows.append({"task": task, "scored": "whole examples (every turn)", "n": len(whole), "acc": float(np.mean(whole))})
    return rows


def markdown_table(rows: list[dict], request_tokens: dict[str, tuple[int, int, int]]) -> str:
    bold = lambda r: "**" if r["scored"] == "all scored turns" else ""  # noqa: E731
    accuracy = md_table(
        ["task", "scored", "n", "exact match"],
        [[r["task"], r["scored"], r["n"], f"{bold(r)}{100 * r['acc']:.1f}%{bold(r)}"] for r in rows],
        align="llrr",
    )
    lengths = md_table(
        ["task", "request tokens: shortest", "longest request per example: min", "max"],
        [[task, *spans] for task, spans in request_tokens.items()],
        align="lrrr",
    )
    return accuracy + "\n\n" + lengths


def evaluate(model, n: int = 200, length: int = 2048, batch: int = 8, tasks=("mqniah", "agent_traces"), verbose: bool = True):
    """Returns ``(rows, request_tokens, per-task ExampleJobs)``."""
    from tqdm import tqdm

    all_rows, request_tokens, by_task = [], {}, {}
    names = {"mqniah": "MQ-NIAH (4 needles, split query)", "agent_traces": "agent traces"}
    for task in tasks:
        exs = [example_jobs(model.tokenizer, i, ex) for i, ex in enumerate(heldout_examples(task, n, length + LENGTH_MARGIN))]
        max_target = 160 if task == "agent_traces" else 96
        with tqdm(total=len(exs), desc=task, disable=not verbose) as bar:
            run_jobs(model, exs, batch=batch, max_new_tokens=max_target, progress=bar.update)
        sizes = [len(j.prompt) for ex in exs for j in ex.jobs]
        peaks = [max(len(j.prompt) for j in ex.jobs) for ex in exs]
        request_tokens[names[task]] = (min(sizes), min(peaks), max(peaks))
        all_rows += summarize(names[task], exs)
        by_task[task] = exs
    return all_rows, request_tokens, by_task


def main(argv=None) -> int:
    import jaxkv

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded", help="checkpoint folder or 'embedded'")
    p.add_argument("--n", type=int, default=200, help="held-out examples per task")
    p.add_argument("--length", type=int, default=2048, help="longest request of each example, at least (tokens)")
    p.add_argument("--batch", type=int, default=8, help="examples decoded together")
    p.add_argument("--tasks", default="mqniah,agent_traces")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--failures", type=int, default=0, help="print up to this many wrong replies per task")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    model = jaxkv.load_model(args.model)
    rows, request_tokens, by_task = evaluate(model, args.n, args.length, args.batch, tuple(args.tasks.split(",")))
    table = markdown_table(rows, request_tokens)
    wall = time.perf_counter() - t0
    print(table)
    print(f"\n[{args.model}: {args.n} held-out examples per task, {wall:.0f}s]")
    for task, exs in by_task.items():
        shown = 0
        for ex in exs:
            for j in ex.jobs:
                if not j.correct and shown < args.failures:
                    shown += 1
                    print(
                        f"{task} #{j.example} {j.label}: expected {j.expected!r}, got "
                        f"{j.generated.get('tool_calls') or j.generated.get('content')!r}"
                    )
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
