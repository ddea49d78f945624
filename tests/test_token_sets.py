"""eval/quality/token_sets.py: where the top-k is taken, at equal KV.

On synthetic scores: ``layer`` keeps the top-k of the head mean in every head of a
layer, ``one`` the top-k of the mean over layers and heads in every layer, and all
granularities keep the same number of rows per layer and KV head. On SmolLM2 (a
short passkey prompt): the ``head`` cell is the press's own cell bit for bit, and
TOVAPress's ``layer`` cell is TOVAPress's own (its score is a head mean).
kvpress is not in the test extra, so those skip without it, as tests/test_kvpress_side.py;
the report's tests (the lm score, the journals merged, the one-set cells set beside
jaxkv's methods) run on journals written here.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from eval.quality import kvpress_side as K

needs_kvpress = pytest.mark.skipif(not K.kvpress_available(), reason="kvpress not installed (eval/quality/requirements-kvpress.txt)")

LAYERS, HEADS, N, DIM = 3, 2, 40, 4


def fake_press(ratio: float, table):
    """A ScorerPress whose score is ``table[layer]`` (HEADS, N)."""
    import torch

    K.import_kvpress()  # with its stub for `datasets`, which the test extra lacks
    from kvpress.presses.scorer_press import ScorerPress

    @dataclasses.dataclass
    class TablePress(ScorerPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return torch.as_tensor(table[module.layer_idx])[None]

    return TablePress(compression_ratio=ratio)


def kept_positions(keys) -> np.ndarray:
    """(HEADS, k) positions of gathered keys whose channel 0 is the position."""
    return np.sort(keys[0, :, :, 0].numpy().astype(int), axis=-1)


def run_cells(ratio: float, table):
    import torch

    from eval.quality import token_sets as T

    full = []
    for _ in range(LAYERS):
        keys = torch.zeros(1, HEADS, N, DIM)
        keys[..., 0] = torch.arange(N, dtype=torch.float32)
        full.append((keys, keys.clone()))
    presses = {g: T.TokenSetPress(fake_press(ratio, table), g) for g in T.GRANULARITIES}
    cells = {g: [None] * LAYERS for g in presses}
    for layer, (keys, values) in enumerate(full):
        module = types.SimpleNamespace(layer_idx=layer, head_dim=DIM)
        for g, press in presses.items():
            cells[g][layer] = press.compress(module, None, keys, values, None, {})
    prefill = K.Prefill(N, None, full, cells)
    T.select_one_sets(prefill, presses)
    return prefill.cells


@needs_kvpress
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_granularity_decides_only_where_the_top_k_is_taken(ratio):
    K.import_kvpress()
    from kvpress.utils import compute_n_kept

    rng = np.random.default_rng(7)
    table = rng.random((LAYERS, HEADS, N)).astype(np.float32)
    cells = run_cells(ratio, table)
    k = compute_n_kept(N, ratio)
    top = lambda s: np.sort(np.argsort(-s)[:k])  # noqa: E731 (distinct random scores: no ties)
    for layer in range(LAYERS):
        for g in cells:
            assert cells[g][layer][0].shape == (1, HEADS, k, DIM)  # equal KV in every layer and head
        heads = kept_positions(cells["head"][layer][0])
        assert [list(h) for h in heads] == [list(top(table[layer, h])) for h in range(HEADS)]
        per_layer = kept_positions(cells["layer"][layer][0])
        assert (per_layer == top(table[layer].mean(0))).all()
        one = kept_positions(cells["one"][layer][0])
        assert (one == top(table.mean((0, 1)))).all()
    # the synthetic heads disagree, so the three granularities really keep different sets
    assert not (kept_positions(cells["head"][0][0])[0] == kept_positions(cells["head"][0][0])[1]).all()
    assert not (kept_positions(cells["layer"][0][0]) == kept_positions(cells["one"][0][0])).all()


@needs_kvpress
def test_unknown_granularity_is_refused():
    from eval.quality import token_sets as T

    with pytest.raises(ValueError, match="granularity"):
        T.TokenSetPress(fake_press(0.5, None), "kv_head")


@needs_kvpress
def test_on_smollm2_head_cells_are_the_presses_own(smollm2_gguf):
    import torch

    from eval.quality import token_sets as T
    from jaxkv import tasks

    torch.set_num_threads(1)
    K.import_kvpress()
    folder = K.model_folder(K.MODEL)
    tok = K.load_tokenizer(folder)
    model = K.load_hf(folder, "sdpa")
    example = K.eval_examples("passkey", 1, 320, tok)[0]
    plan = tasks.token_plan(example, tok, "agnostic")
    presses = {
        "snap_own": K.make_press("SnapKVPress", 0.5),
        "snap_head": T.TokenSetPress(K.make_press("SnapKVPress", 0.5), "head"),
        "tova_own": K.make_press("TOVAPress", 0.5),
        "tova_layer": T.TokenSetPress(K.make_press("TOVAPress", 0.5), "layer"),
        "tova_one": T.TokenSetPress(K.make_press("TOVAPress", 0.5), "one"),
    }
    prefill = K.shared_prefill(model, plan.compressed, presses, example.seed)
    T.select_one_sets(prefill, presses)
    for a, b in (("snap_own", "snap_head"), ("tova_own", "tova_layer")):
        for (ka, va), (kb, vb) in zip(prefill.cells[a], prefill.cells[b]):
            # the same rows; TOVA's per-layer order may differ from kvpress's (ties in topk), so compare as sets
            assert ka.shape == kb.shape
            assert torch.equal(ka.sort(dim=2).values, kb.sort(dim=2).values)
            assert torch.equal(va.sort(dim=2).values, vb.sort(dim=2).values)
    one = prefill.cells["tova_one"]
    assert all(k.shape == prefill.cells["tova_own"][i][0].shape for i, (k, _) in enumerate(one))


@needs_kvpress
def test_accumulated_attention_is_the_raw_sum_with_h2os_recent_floor():
    """jaxkv's H2O score in kvpress's frame: ObservedAttentionPress's mass times the
    number of queries that saw each token, the last ``recent`` positions kept."""
    import torch

    from eval.quality import token_sets as T

    K.import_kvpress()
    n, q_heads, kv_heads = 48, 4, 2
    torch.manual_seed(0)
    logits = torch.randn(1, q_heads, n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = logits.softmax(-1)
    keys = torch.zeros(1, kv_heads, n, DIM)
    module = types.SimpleNamespace(layer_idx=0, head_dim=DIM)
    raw = T.accumulated_attention_press(0.5).score(module, None, keys, keys, attn, {})
    observed = K.make_press("ObservedAttentionPress", 0.5).score(module, None, keys, keys, attn, {})
    assert T.H2O_RECENT == 32 and raw.shape == (1, kv_heads, n)
    floor = n - T.H2O_RECENT
    assert torch.isinf(raw[..., floor:]).all() and torch.isfinite(raw[..., :floor]).all()
    seen_by = torch.arange(n, 0, -1, dtype=torch.float32)  # queries at or after each position
    torch.testing.assert_close(raw[..., :floor], (observed * seen_by)[..., :floor])
    want = attn.sum(2).view(1, kv_heads, q_heads // kv_heads, n).mean(2)
    torch.testing.assert_close(raw[..., :floor], want[..., :floor])
    no_floor = T.accumulated_attention_press(0.5, recent=0).score(module, None, keys, keys, attn, {})
    torch.testing.assert_close(no_floor, want)


@needs_kvpress
def test_windowed_expected_attention_takes_the_last_rows_statistics_at_the_prompts_end(smollm2_gguf):
    """The EA variant with jaxkv's observation window (``EA_WINDOW``): its query mean and
    covariance are those of the last ``window`` rows' pre-RoPE queries, each rotated to
    every position after the prompt's end and averaged, computed here directly with
    transformers' RoPE; with a window as long as the prompt it is kvpress's own press."""
    import torch
    from transformers.models.llama.modeling_llama import rotate_half

    from eval.quality import token_sets as T

    torch.manual_seed(0)
    model = K.load_hf(K.model_folder(K.MODEL), "sdpa")
    lm = model.model
    module = lm.layers[3].self_attn
    module.rotary_emb = lm.rotary_emb  # as kvpress's hooks (and shared_prefill) attach it
    n, window = 300, 64
    hidden = torch.randn(1, n, model.config.hidden_size)
    press = T.expected_attention_press(0.5, vnorm=False, window=window)
    assert press.window == window and not press.use_vnorm
    with torch.no_grad():
        mu, cov = press.get_query_statistics(module, hidden)
        heads, d = model.config.num_attention_heads, module.head_dim
        q = (hidden[0, n - window :] @ module.q_proj.weight.T).view(window, heads, d).transpose(0, 1)  # (H, W, d)
        future = torch.arange(n, n + press.n_future_positions)[None]
        cos, sin = lm.rotary_emb(q, future)  # (1, F, d)
        # RoPE at position t is q cos_t + rotate_half(q) sin_t; averaged over the future positions:
        f = q * cos[0].mean(0) + rotate_half(q) * sin[0].mean(0)  # (H, W, d)
        want_mu = f.mean(1)
        centred = f - want_mu[:, None]
        want_cov = centred.transpose(1, 2) @ centred / window
        torch.testing.assert_close(mu[0], want_mu, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cov[0], want_cov, rtol=1e-4, atol=1e-3)
        whole = T.expected_attention_press(0.5, vnorm=True, window=n)
        own = K.make_press("ExpectedAttentionPress", 0.5)
        for a, b in zip(whole.get_query_statistics(module, hidden), own.get_query_statistics(module, hidden)):
            torch.testing.assert_close(a, b)


def _lm_line(seed: int, cells: dict) -> str:
    import json

    return json.dumps(
        {
            "task": "lm",
            "example_task": "lm",
            "context": 2048,
            "length": 2048,
            "seed": seed,
            "settings": {"agnostic": {"cells": cells}},
            "seconds": {"total": 1.0},
        }
    )


def test_report_scores_lm_by_nll_increase_and_sets_one_set_cells_beside_jaxkv(tmp_path):
    """On ``lm`` a cell's score is its NLL increase over the full cache; journals merge by
    example; a one-set cell is compared with the jaxkv method of the same rule on the
    examples both ran (jaxkv minus one set, paired)."""
    import json

    from eval.quality import token_sets as T

    out, jaxkv = tmp_path / "token_sets", tmp_path / "jaxkv"
    out.mkdir(), jaxkv.mkdir()
    cell = "AccumulatedAttentionPress/one@0.5"
    full = {1: 2.0, 2: 2.5, 3: 3.0}
    mine = {1: 2.1, 2: 2.7, 3: 3.3}  # increases 0.1, 0.2, 0.3
    theirs = {1: 2.1, 2: 2.8, 4: 9.9}  # jaxkv's h2o: increases 0.1, 0.3 on the common examples 1, 2
    (out / "examples.jsonl").write_text(_lm_line(1, {"full": {"nll": 2.0}, "RandomPress/head@0.5": {"nll": 2.4}}) + "\n")
    (tmp_path / "kvpress").mkdir()  # kvpress's own RandomPress on example 1: the same cell, reproduced
    (tmp_path / "kvpress" / "examples.jsonl").write_text(_lm_line(1, {"full": {"nll": 2.0}, "RandomPress@0.5": {"nll": 2.4}}) + "\n")
    (out / "examples_h2o_random.jsonl").write_text(
        "\n".join(_lm_line(s, {"full": {"nll": full[s]}, cell: {"nll": mine[s]}}) for s in full) + "\n"
    )
    (jaxkv / "examples.jsonl").write_text(
        "\n".join(
            json.dumps(
                {
                    "task": "lm",
                    "context": 2048,
                    "seed": s,
                    "setting": "agnostic",
                    "cells": {"full": {"nll": full.get(s, 9.0)}, "h2o@0.5": {"nll": nll}},
                }
            )
            for s, nll in theirs.items()
        )
        + "\n"
    )

    tables = T.read(out)
    values = T.cell_values("lm", tables[("lm", 2048, "agnostic")], cell)
    assert values == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    rows = [r for r in T.counterpart_rows(out, tables) if "| h2o@" in r]
    assert len(rows) == 1
    parts = [p.strip() for p in rows[0].strip("|").split("|")]
    assert parts[1:4] == [cell, "h2o@0.5", "2"]  # only the examples both ran
    assert parts[4:6] == ["+0.150", "+0.200"]
    assert parts[6].startswith("+0.050 [")
    reproduced = [r for r in T.counterpart_rows(out, tables) if "| RandomPress/head@0.5 | RandomPress@0.5 | 1 |" in r]
    assert len(reproduced) == 1 and reproduced[0].rstrip(" |").endswith("+0.000 [+0.000, +0.000]")
    text = T.report(out)
    assert "NLL increase" in text and "| AccumulatedAttentionPress | 0.5 | - | - | +0.200 |" in text
