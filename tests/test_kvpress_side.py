"""eval/quality/kvpress_side.py: the shared prefill equals kvpress's own path.

kvpress is not in the test extra (eval/quality/requirements-kvpress.txt installs it), so
these tests skip without it. With it, on SmolLM2-135M-Instruct and a short passkey
example: every press's compressed cache from the one shared prefill equals what
``with press(model): model(ids, past_key_values=cache)`` leaves (bit for bit), and
the answer logits fed after it agree to float tolerance with the same argmax, in
both settings; ObservedAttentionPress under eager attention too. Then one run of
the CLI writes a line and ``--resume`` skips it.

Issue #75's presses: the head-wise ones (AdaKV, CriticalAdaKV, KVzip: keys masked by
kvpress's attention patch), the per-layer budgets (PyramidKV), the presses with
their own hooks and the re-rotating wrapper equal kvpress's own path the same way;
each keeps what it promises (the counts per layer and head, the safeguard, the
sinks); KVzipPress's scores are jaxkv's ``policies.kvzip`` on the same queries and
keys, and its reconstruction inputs jaxkv's builder's; the multi-question task runs
through the CLI, every question from one cache.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval.quality import kvpress_side as K

pytestmark = pytest.mark.skipif(not K.kvpress_available(), reason="kvpress not installed (eval/quality/requirements-kvpress.txt)")

LENGTH = 320
# Logits are ~10-30. A 76-key row padded to 307 beside full-length rows sums in another
# order through 30 layers: up to ~1e-3 (the same row in a narrower batch: ~1e-4). A
# wrong mask or a missed key moves them by whole units.
ATOL = 2e-3


@pytest.fixture(scope="module")
def setup(smollm2_gguf):
    import torch

    torch.set_num_threads(1)  # one per xdist worker (spinning OpenMP threads on shared cores crawl)
    K.import_kvpress()
    folder = K.model_folder(K.MODEL)
    tok = K.load_tokenizer(folder)
    example = K.eval_examples("passkey", 1, LENGTH, tok)[0]
    return folder, tok, example


@pytest.fixture(scope="module")
def model(setup):
    return K.load_hf(setup[0], "sdpa")


@pytest.mark.parametrize("setting,ratio", [("aware", 0.75), ("agnostic", 0.25)])
def test_shared_prefill_matches_kvpress_own_path(setup, model, setting, ratio):
    folder, tok, example = setup
    report = K.verify(
        model, tok, example, setting, ["SnapKVPress", "KnormPress", "RandomPress", "ExpectedAttentionPress"], [ratio], max_new_tokens=8
    )
    for name, cell in report["cells"].items():
        assert cell["cache_equal"], (name, cell)
        assert cell["same_argmax"] and cell["answer_logits_max_abs_diff"] < 1e-4, (name, cell)
        assert cell["same_greedy"], (name, cell)
    assert report["ok"]


def test_observed_attention_under_eager(setup, model):
    """ObservedAttentionPress reads the attention weights: the prefill runs eager (the
    model's sdpa outside it), on both paths alike."""
    folder, tok, example = setup
    report = K.verify(model, tok, example, "agnostic", ["ObservedAttentionPress", "TOVAPress"], [0.5], max_new_tokens=8)
    assert report["ok"] and report["prefill_attention"] == "eager", report
    assert all(cell["cache_equal"] for cell in report["cells"].values())
    assert model.config._attn_implementation == "sdpa"


def test_hook_kwargs_shim():
    """transformers >= 5.3 passes ``cache`` and no ``cache_position``; the shim gives
    kvpress both, with cache_position = the new tokens' slots in the cache."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 3, 7, 4), torch.zeros(1, 3, 7, 4), 0)
    module = type("Attn", (), {"layer_idx": 0})()
    kw = K.kvpress_hook_kwargs(module, {"hidden_states": torch.zeros(1, 7, 8), "cache": cache})
    assert kw["past_key_values"] is cache and kw["cache_position"].tolist() == list(range(7))
    cache.update(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), 0)
    kw = K.kvpress_hook_kwargs(module, {"hidden_states": torch.zeros(1, 2, 8), "cache": cache})
    assert kw["cache_position"].tolist() == [7, 8]


def test_cli_writes_and_resumes(setup, tmp_path, capsys):
    args = [
        "--task",
        "passkey",
        "--context",
        str(LENGTH),
        "--n",
        "1",
        "--presses",
        "StreamingLLMPress,KnormPress",
        "--ratios",
        "0.5",
        "--max-new-tokens",
        "4",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert K.main(args) == 0
    lines = (tmp_path / "examples.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    assert set(rec["settings"]) == {"aware", "agnostic"}
    cells = rec["settings"]["agnostic"]["cells"]
    assert set(cells) == {"full", "StreamingLLMPress@0.5", "KnormPress@0.5"}
    n = rec["settings"]["agnostic"]["n_compressed"]
    assert cells["full"]["kept"] == n and cells["KnormPress@0.5"]["kept"] == int(n * 0.5)
    assert rec["setup"]["presses"]["StreamingLLMPress"] == {"n_sink": 4}
    assert K.main(args + ["--resume"]) == 0
    assert len((tmp_path / "examples.jsonl").read_text().splitlines()) == 1


NEW_PRESSES = [
    "AdaKVPress(SnapKVPress)",
    "CriticalAdaKVPress(ExpectedAttentionPress)",
    "CriticalKVPress(SnapKVPress)",
    "PyramidKVPress",
    "LagKVPress",
    "CURPress",
    "KVzipPress",
    "KeyRerotationPress(SnapKVPress)",
    "KVComposePress",
]


@pytest.mark.parametrize("setting,ratio", [("agnostic", 0.5), ("aware", 0.75)])
def test_issue75_presses_match_kvpress_own_path(setup, model, setting, ratio):
    """Every kind of cell: compressed in the shared prefill, masked per head (the masks
    the same set as kvpress's), a count per layer (continued one token at a time on
    kvpress's side, where transformers 5 cannot feed several), its own hooks, its own
    reconstruction passes, positions re-rotated."""
    folder, tok, example = setup
    report = K.verify(model, tok, example, setting, NEW_PRESSES, [ratio], atol=ATOL, max_new_tokens=8)
    for name, cell in report["cells"].items():
        assert cell["cache_equal"] and cell["masks_equal"], (name, cell)
        assert cell["same_argmax"] and cell["answer_logits_max_abs_diff"] < ATOL, (name, cell)
        assert cell["same_greedy"], (name, cell)
    assert report["ok"]


@pytest.fixture(scope="module")
def cells(setup, model):
    """Every issue-#75 press at ratio 0.5 on the agnostic request, from ``cells_prefill``."""
    from jaxkv.tasks import real

    folder, tok, example = setup
    plan = real.plans(example, tok, "agnostic")[0]
    presses = {spec: K.make_press(spec, 0.5) for spec in K.PRESSES_75}
    return plan, presses, K.cells_prefill(model, plan.compressed, dict(presses), example.seed)


def test_issue75_presses_keep_what_they_promise(cells, model):
    import torch
    from kvpress.utils import compute_n_kept

    plan, presses, prefill = cells
    n = prefill.length
    n_kept = compute_n_kept(n, 0.5)
    layers = K.language_model(model).layers
    heads = prefill.full[0][0].shape[1]
    for spec in ("AdaKVPress(SnapKVPress)", "CriticalAdaKVPress(SnapKVPress)", "AdaKVPress(KeyDiffPress)"):
        for layer, (heads_idx, seqs) in enumerate(prefill.masks[spec]):  # the full cache, keys masked per head
            assert prefill.cells[spec][layer][0].shape[2] == n
            assert seqs.numel() == heads * (n - n_kept)  # the layer's budget, shared by its heads
            per_head = np.bincount(heads_idx.numpy(), minlength=heads)
            assert (n - per_head >= max(1, int(n_kept * presses[spec].alpha_safeguard))).all()  # the safeguard
        assert K.kept_of(prefill.cells[spec], prefill.masks[spec]) == n_kept
    kvzip = prefill.masks["KVzipPress"]  # one budget over every layer, KV head and position
    masked = [int(m[1].numel()) for m in kvzip]
    assert sum(masked) == int(len(layers) * heads * n * 0.5) and len(set(masked)) > 1
    assert all(int(m[1].min()) >= presses["KVzipPress"].n_sink for m in kvzip)  # sinks never masked
    pyramid = [k.shape[2] for k, _ in prefill.cells["PyramidKVPress"]]
    assert pyramid == [presses["PyramidKVPress"].get_layer_budget(layer.self_attn, n) for layer in layers]
    assert pyramid == sorted(pyramid, reverse=True) and abs(sum(pyramid) - len(layers) * n * 0.5) <= len(layers)
    for spec in ("LagKVPress", "CURPress", "CriticalKVPress(SnapKVPress)"):
        assert all(k.shape[2] == n_kept for k, _ in prefill.cells[spec])
    # CURPress: the sinks are among every head's kept keys
    lag = presses["LagKVPress"]
    tail = lag.lag_size + n - (lag.n_sink + (n - lag.n_sink) // lag.lag_size * lag.lag_size)
    for layer in (0, len(layers) - 1):
        full = prefill.full[layer][0]
        cur = prefill.cells["CURPress"][layer][0]
        for h in range(heads):
            for i in range(presses["CURPress"].num_sinks):
                assert (cur[0, h] == full[0, h, i]).all(-1).any(), ("CURPress", layer, h, i)
        # LagKVPress: the sinks and the last partition score highest; here they outnumber the
        # budget, so every kept key is one of them
        assert lag.n_sink + tail > n_kept
        protected = torch.cat([full[0, :, : lag.n_sink], full[0, :, n - tail :]], dim=1)  # [Hkv, P, D]
        kept = prefill.cells["LagKVPress"][layer][0][0]
        assert all((kept[h][:, None] == protected[h][None]).all(-1).any(-1).all() for h in range(heads))
    assert prefill.shift["KeyRerotationPress(SnapKVPress)"] == n - n_kept and "SnapKVPress" not in prefill.shift


def test_kvzip_scores_are_jaxkvs_on_the_same_queries_and_keys(setup, model):
    """KVzipPress's scores (``score_val`` after its selection set the sinks) equal
    ``jaxkv.policies.kvzip`` on the post-RoPE queries and keys of its reconstruction
    pass, captured from the model (transformers' own projection and rotation); its
    reconstruction input is ``kvzip.repeat_chunks``'s."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from jaxkv.policies import kvzip
    from jaxkv.tasks import real

    folder, tok, example = setup
    ids = real.plans(example, tok, "agnostic")[0].compressed
    press = K.make_press("KVzipPress", 0.5)
    lm = K.language_model(model)
    fed, captured = [], {}

    def capture(module, args, kwargs, output):
        if kwargs["hidden_states"].shape[1] == len(ids):
            return  # the context's own prefill
        h = kwargs["hidden_states"]
        q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        captured[module.layer_idx] = (q[0].transpose(0, 1).detach(), cache.layers[module.layer_idx].keys[0].transpose(0, 1).clone())

    select, scores = type(press).compress_post.__get__(press), {}

    def keep_scores(model_):
        select(model_)
        scores["val"] = press.score_val.clone()

    press.compress_post = keep_scores
    handles = [layer.self_attn.register_forward_hook(capture, with_kwargs=True) for layer in lm.layers]
    handles.append(lm.embed_tokens.register_forward_hook(lambda m, a, out: fed.append(a[0][0].clone())))
    try:
        K.own_path_prefill(model, ids, press, example.seed)
    finally:
        for h in handles:
            h.remove()
        del press.compress_post
        K.take_masks(model)
    (chunk,) = kvzip.repeat_chunks(tok, ids)
    assert [f.tolist() for f in fed] == [ids.tolist(), chunk.ids.tolist()]
    q = np.stack([captured[l][0].numpy() for l in range(len(lm.layers))])  # [L, X, Hq, D]
    keys = np.stack([captured[l][1].numpy() for l in range(len(lm.layers))])  # [L, N + X, Hkv, D]
    n = len(ids)
    softmax_n, scored_n = kvzip.chunk_masks(n, chunk.start, chunk.end)
    ours = kvzip.context_scores([kvzip.reconstruction_scores(q, keys[:, :n], keys[:, n:], softmax_n, scored_n, np.ones(q.shape[1], bool))])
    theirs = scores["val"][:, 0].permute(0, 2, 1).numpy()  # [L, 1, Hkv, N] -> [L, N, Hkv]
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-6)


def test_cli_runs_the_multi_question_task_with_issue75_presses(setup, tmp_path):
    args = [
        "--task",
        "multiq",
        "--context",
        "384",
        "--n",
        "1",
        "--presses",
        "KVzipPress,AdaKVPress(SnapKVPress),PyramidKVPress",
        "--ratios",
        "0.5",
        "--settings",
        "agnostic",
        "--max-new-tokens",
        "4",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
        "--journal",
        "examples_75.jsonl",
    ]
    assert K.main(args) == 0
    (rec,) = [json.loads(line) for line in (tmp_path / "examples_75.jsonl").read_text().splitlines()]
    block = rec["settings"]["agnostic"]
    assert rec["task"] == rec["example_task"] == "multiq" and block["n_questions"] == len(block["n_answer"]) >= 4
    assert set(block["cells"]) == {"full", "KVzipPress@0.5", "AdaKVPress(SnapKVPress)@0.5", "PyramidKVPress@0.5"}
    for name, cell in block["cells"].items():
        assert len(cell["questions"]) == block["n_questions"] and 0.0 <= cell["tf_correct"] <= 1.0
        assert cell["tf_correct"] == pytest.approx(np.mean([q["tf_correct"] for q in cell["questions"]]), abs=1e-5)
    n = block["n_compressed"]
    assert block["cells"]["AdaKVPress(SnapKVPress)@0.5"]["kept"] == int(n * 0.5)
    assert abs(block["cells"]["KVzipPress@0.5"]["kept"] - n * 0.5) <= 1
    assert rec["setup"]["presses"]["AdaKVPress(SnapKVPress)"]["press"]["name"] == "SnapKVPress"
    assert K.main(args + ["--resume"]) == 0
    assert len((tmp_path / "examples_75.jsonl").read_text().splitlines()) == 1
    with pytest.raises(SystemExit):  # a press that takes no ratio is refused before anything runs
        K.main(["--presses", "ThinKPress", "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
