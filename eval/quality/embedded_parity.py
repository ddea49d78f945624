"""Parity of the shipped checkpoint between transformers (torch) and jaxkv.

    JAX_PLATFORMS=cpu python -m eval.quality.embedded_parity [--model PATH] [--n 20] [--max-new-tokens 48]

Loads the folder with ``transformers.AutoModelForCausalLM`` + ``AutoTokenizer`` and
with ``jaxkv.load_model``, builds ``--n`` held-out prompts (alternately an MQ-NIAH
turn-1 request and an agent-trace request, from ``eval.quality.embedded_accuracy``'s held-out
seeds), and compares the greedy continuations token for token (up to and including
the first ``<|im_end|>``). Prints one line per prompt and ``parity: M/N match``;
exits 1 when any continuation differs.
"""

from __future__ import annotations

import argparse
import sys


def parity_prompts(tokenizer, n: int, length: int = 2048) -> list[list[int]]:
    """``n`` held-out requests: MQ-NIAH turn 1 and agent-trace turns, alternating."""
    from eval.quality.embedded_accuracy import LENGTH_MARGIN, example_jobs, heldout_examples

    length += LENGTH_MARGIN  # the examples eval.quality.embedded_accuracy scores
    half = (n + 1) // 2
    mq = [example_jobs(tokenizer, i, ex).jobs[0].prompt for i, ex in enumerate(heldout_examples("mqniah", half, length))]
    agent = []
    for i, ex in enumerate(heldout_examples("agent_traces", half, length)):
        jobs = example_jobs(tokenizer, i, ex).jobs
        agent.append(jobs[i % len(jobs)].prompt)  # vary the turn: search, open, lookup, answer
    out = [p for pair in zip(mq, agent) for p in pair]
    return out[:n]


def _cut(ids: list[int], stop: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in stop:
            return ids[: i + 1]
    return ids


def hf_greedy(folder, prompts: list[list[int]], max_new_tokens: int, stop: set[int]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(stop),
                pad_token_id=sorted(stop)[0],
            )
            outs.append(_cut(gen[0, len(p) :].tolist(), stop))
    return outs


def jaxkv_greedy(model, prompts: list[list[int]], max_new_tokens: int, stop: set[int]) -> list[list[int]]:
    import jaxkv

    return [_cut(o, stop) for o in jaxkv.generate(model, prompts, max_new_tokens, stop_token_ids=sorted(stop))]


def run_parity(model_path="embedded", n: int = 20, max_new_tokens: int = 48, length: int = 2048, verbose: bool = True):
    """Returns ``(matches, n, details)``; ``details[i] = (prompt_len, hf_ids, jaxkv_ids)``."""
    import jaxkv
    from jaxkv.chat import stop_token_ids
    from jaxkv.models.loading import resolve_checkpoint

    folder = resolve_checkpoint(model_path)
    model = jaxkv.load_model(str(folder))
    tok = model.tokenizer
    stop = set(stop_token_ids(model))
    prompts = parity_prompts(tok, n, length)
    hf = hf_greedy(folder, prompts, max_new_tokens, stop)
    jx = jaxkv_greedy(model, prompts, max_new_tokens, stop)
    details = list(zip([len(p) for p in prompts], hf, jx))
    matches = sum(a == b for _, a, b in details)
    if verbose:
        for i, (plen, a, b) in enumerate(details):
            status = "same" if a == b else "DIFFERENT"
            print(f"prompt {i:2d} ({plen} tokens): {status}: {tok.decode(b)[:80]!r}")
            if a != b:
                print(f"    transformers: {tok.decode(a)[:80]!r}")
    return matches, len(prompts), details


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--length", type=int, default=2048)
    args = p.parse_args(argv)
    matches, n, _ = run_parity(args.model, args.n, args.max_new_tokens, args.length)
    print(f"parity: {matches}/{n} greedy continuations match (transformers torch vs jaxkv)")
    return 0 if matches == n else 1


if __name__ == "__main__":
    sys.exit(main())
