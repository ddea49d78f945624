"""Recall of IntentKV head labels under fixed token-type priors (what the labels reward).

    JAX_PLATFORMS=cpu python -m eval.profile.intentkv_label_baselines --data runs/intentkv-data

On the held-out rows of ``train.intentkv_data`` (token ids re-rendered from each
row's trace seed), counts the positives by token kind (pool keys ``k###``, values
``v###``, document ids ``d###``, other) and prints the recall at each budget, as
``train.intentkv_head.evaluate`` measures it (``select`` with the row's forced
set, rows longer than B), of: the rule score ``s``; value and document-id tokens
first (ties by position); the same then ``s``; every identifier first. The head's
own recall is in its ``summary.json``. Used for the head's card.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.markdown import md_table
from train.intentkv_head import BUDGETS


def main(argv=None):
    import jaxkv
    from jaxkv.chat.render import render
    from jaxkv.policies import select
    from jaxkv.tasks.agent import one_trace
    from jaxkv.tasks.words import DOC_POOL, KEY_POOL, VALUE_POOL
    from train import intentkv_data as data

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="runs/intentkv-data")
    p.add_argument("--model", default="embedded")
    args = p.parse_args(argv)
    meta = (data.load_meta(args.data) or {}).get("args", {})
    lo, hi = meta.get("length_min", 1792), meta.get("length_max", 2304)
    tok = jaxkv.load_model(args.model).tokenizer
    kind_ids = {k: np.asarray(tok.convert_tokens_to_ids(list(pool))) for k, pool in (("k", KEY_POOL), ("v", VALUE_POOL), ("d", DOC_POOL))}
    select_one = jax.jit(select)
    ids_of, kinds, hits = {}, {"k": 0, "v": 0, "d": 0, "other": 0}, {}
    for shard in data.load_shards(args.data, "heldout"):
        for r in range(shard["row_len"].size):
            seed, n = int(shard["row_seed"][r]), int(shard["row_len"][r])
            if seed not in ids_of:
                ex = one_trace(seed, length=data.trace_length(seed, lo, hi))
                ids_of[seed] = render(tok, ex.messages, ex.tools, add_generation_prompt=False).ids
            ids = ids_of[seed][:n]
            o = int(shard["row_offset"][r])
            labels, s = shard["labels"][o : o + n], shard["s"][o : o + n]
            (a, b), p_end = shard["row_span"][r], int(shard["row_protected"][r])
            forced = np.zeros(n, bool)
            forced[:p_end] = forced[a:b] = True
            pos = (labels == 1) & ~forced
            for i in np.flatnonzero(pos):
                kinds[next((k for k, v in kind_ids.items() if ids[i] in v), "other")] += 1
            vd = np.isin(ids, np.concatenate([kind_ids["v"], kind_ids["d"]])).astype(np.float32)
            kvd = np.isin(ids, np.concatenate(list(kind_ids.values()))).astype(np.float32)
            for name, score in (("rule s", s), ("v/d tokens first", vd), ("v/d tokens first, then s", vd + s), ("k/v/d tokens first", kvd)):
                for B in BUDGETS:
                    if n > B:
                        kept = np.asarray(select_one(jnp.asarray(score), jnp.asarray(forced), jnp.asarray(~forced), B))
                        k, t = hits.get((name, B), (0, 0))
                        hits[(name, B)] = (k + int((kept & pos).sum()), t + int(pos.sum()))
    print("held-out positives by token kind:", kinds)
    print(
        md_table(
            ["scorer", *(f"recall B={B}" for B in BUDGETS)],
            [
                [name, *(f"{hits[(name, B)][0] / max(hits[(name, B)][1], 1):.3f}" for B in BUDGETS)]
                for name in dict.fromkeys(n for n, _ in hits)
            ],
            align="l" + "r" * len(BUDGETS),
        )
    )


if __name__ == "__main__":
    main()
