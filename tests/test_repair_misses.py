"""eval/profile/repair_misses.py: the needle's token span, and the table that sets misses beside hits.

The session trace itself is a real-model run (minutes); here its two pure parts: the span
is the shortest token run of the compressed request whose text holds the needle's
sentence, and the table counts a miss as one whose teacher-forced verdict is wrong."""

from __future__ import annotations

import argparse

import numpy as np

from eval.profile import repair_misses as rm
from jaxkv.tasks import haystack, token_plan


def test_the_needle_span_is_the_shortest_run_holding_the_needle(smollm2_tokenizer):
    tok = smollm2_tokenizer
    example = haystack.examples("niah_single", 1, length=512, tokenizer=tok)[0]
    ids = token_plan(example, tok, "agnostic").compressed
    a, b = rm.needle_span(example, tok, ids)
    needle = example.labels["needles"][0]
    text = example.document[needle["char_start"] : needle["char_end"]].strip()
    assert 0 < a < b <= ids.size
    assert text in tok.decode(ids[a:b].tolist())
    assert text not in tok.decode(ids[a + 1 : b].tolist()) and text not in tok.decode(ids[a : b - 1].tolist())
    assert example.values[0] in tok.decode(ids[a:b].tolist())


def test_the_table_sets_misses_beside_hits():
    def row(seed, tf, whole):
        return {
            "seed": seed,
            "depth": 0.5,
            "n": 100,
            "span": (10, 20),
            "kept_in": 5,
            "evicted_in": 5,
            "promoted_in": 5 if whole else 2,
            "whole_after": whole,
            "promoted": 8,
            "promoted_near": 1,
            "promoted_far": 7 - (5 if whole else 2) + 5,
            "tf_correct": tf,
            "gen_correct": tf,
            "reply": "The number is 12|3.",
        }

    args = argparse.Namespace(method="snapkv", ratio=0.5, k=8, context=512, n=3)
    text = rm.render([row(1, False, False), row(2, True, True), row(3, True, True)], args)
    lines = text.splitlines()
    assert next(line for line in lines if line.startswith("| misses")).split("|")[2].strip() == "1"
    assert next(line for line in lines if line.startswith("| hits")).split("|")[3].strip() == "2/2"
    misses = [line for line in lines if line.startswith("| 1 |")]
    assert len(misses) == 1 and "| 2 of 5 | no |" in misses[0] and "12/3" in misses[0]  # a | in a reply cannot break the row
    assert not any(line.startswith("| 2 |") for line in lines)
    assert np.isclose(float(next(line for line in lines if line.startswith("| hits")).split("|")[4].split()[0]), 5.0)
