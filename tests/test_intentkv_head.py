"""IntentKV Phase 2: the residual head, its policies, its training rows and its trainer.

What each test pins down: at init ``z == s`` bit for bit and training reaches α and
the whole MLP; ``intentkv_no_residual`` keeps exactly ``intentkv_memory``'s set
while the full head (with a non-zero residual) does not; heads round-trip through
``head.safetensors`` + ``head.json`` and a head for another ``head_dim`` raises
``ConfigError``; an empty or missing query span gives finite scores; labels on a
hand-built conversation are exactly the argument-value tokens of the next 5 calls;
a row's rule score is what a real ``Session`` scores at its compression event; the
training script runs 3 steps end to end and its loss falls; it resumes from its checkpoint.
Shapes are tiny (L=2, N=48, Hq=4, Hkv=2, D=16).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxkv
from jaxkv.config import ModelConfig
from jaxkv.serving.stages.events import score_and_select
from jaxkv.serving.stages.retention import head_folder_of
from jaxkv.policies import EventFeatures, get_policy
from jaxkv.policies import intentkv_head as ih
from jaxkv.policies.intentkv import QueryMemory

L, N, HQ, HKV, D = 2, 48, 4, 2, 16
MODEL_CFG = ModelConfig(
    model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=L, num_heads=HQ, num_kv_heads=HKV, head_dim=D
)
ABLATIONS = ("intentkv", "intentkv_no_memory", "intentkv_no_xattn", "intentkv_no_residual")


def make_feats(seed, span=True, n=N):
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.choice(n + 16, size=n, replace=False)).astype(np.int32)
    span_N = np.zeros(n, bool)
    span_N[-10:] = True
    return EventFeatures(
        keys_LNKD=jnp.asarray(rng.normal(size=(L, n, HKV, D)), jnp.float32),
        positions_N=jnp.asarray(positions),
        phase_N=jnp.zeros(n, jnp.int32),
        window_q_LWHD=jnp.zeros((L, 1, HQ, D), jnp.float32),
        window_pos_W=jnp.zeros(1, jnp.int32),
        window_valid_W=jnp.zeros(1, bool),
        acc_mass_N=jnp.zeros(n, jnp.float32),
        query_mean_LHD=jnp.asarray(rng.normal(size=(L, HQ, D)), jnp.float32),
        seq_len=jnp.asarray(positions[-1] + 1, jnp.int32),
        query_span_N=jnp.asarray(span_N) if span else None,
    )


def perturbed(head: ih.Head, seed: int, scale: float = 0.1) -> ih.Head:
    """The head with every parameter moved randomly (a non-zero residual)."""
    leaves, treedef = jax.tree_util.tree_flatten(head.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return dataclasses.replace(head, params=jax.tree_util.tree_unflatten(treedef, leaves))


@pytest.fixture(scope="module")
def trained_like_head(tmp_path_factory):
    """A head for D=16 with non-zero output layer, saved as a folder."""
    folder = tmp_path_factory.mktemp("head")
    ih.save_head(perturbed(ih.init_head(ih.HeadConfig(head_dim=D), seed=1), seed=2), folder, base_model={"name": "test"})
    return str(folder)


def memory_state(seed):
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(L, HQ, D))
    return QueryMemory(jnp.asarray(m / np.linalg.norm(m, axis=-1, keepdims=True), jnp.float32), jnp.asarray(True))


# -- the head ---------------------------------------------------------------------------------
def test_at_init_z_equals_s_exactly_and_training_reaches_alpha_and_the_mlp():
    from train.intentkv_head import LossConfig, batch_loss

    head = ih.init_head(ih.HeadConfig(head_dim=D), seed=0)
    rng = np.random.default_rng(0)
    B, n = 2, 64
    labels = (rng.random((B, n)) < 0.1).astype(np.int8)
    labels[:, 0] = 1
    batch = {
        "kbar": rng.normal(size=(B, n, D)).astype(np.float32),
        "s": rng.random((B, n)).astype(np.float32) / n,
        "labels": labels,
        "forced": np.arange(n)[None].repeat(B, 0) >= n - 8,
        "valid": np.ones((B, n), bool),
        "span": np.arange(n)[None].repeat(B, 0) >= n - 8,
        "mbar": rng.normal(size=(B, D)).astype(np.float32),
        "norm_err": np.zeros(B, np.float32),
    }
    r = jax.jit(jax.vmap(lambda k, m, sp: ih.residual_scores(head.graphdef, head.params, k, m, sp)))(
        batch["kbar"], batch["mbar"], batch["span"]
    )
    z = ih.combine(batch["s"], r, ih.alpha_of(head.params, 2.0))
    np.testing.assert_array_equal(np.asarray(z), batch["s"])  # bit for bit

    # one jitted gradient per head structure (graphdef static), not op-by-op dispatch
    grad_of = jax.jit(lambda graphdef, p: jax.grad(lambda p: batch_loss(graphdef, p, batch, LossConfig())[0])(p), static_argnums=0)

    def grads(params):
        return ih.flat_params(grad_of(head.graphdef, params))

    g0 = grads(head.params)
    # at init r = 0: the gradient reaches the zero output layer through α = 1 ...
    assert np.abs(g0["fc2.kernel"]).max() > 0 and np.abs(g0["fc2.bias"]).max() > 0
    # ... and after one update it reaches α, the hidden layer and the cross-attention
    opt = optax.sgd(0.1)
    updates, _ = opt.update(grad_of(head.graphdef, head.params), opt.init(head.params))
    g1 = grads(optax.apply_updates(head.params, updates))
    for name in ("alpha", "fc1.kernel", "fc1.bias", "xq.kernel", "xk.kernel", "xv.kernel", "xo.kernel"):
        assert np.abs(g1[name]).max() > 0, name
    # with α = 0 instead, nothing would ever move (the saddle the paper avoids)
    frozen = ih.init_head(ih.HeadConfig(head_dim=D, alpha_init=0.0), seed=0)
    g_frozen = ih.flat_params(grad_of(frozen.graphdef, frozen.params))
    assert all(np.abs(v).max() == 0 for v in g_frozen.values())


def test_head_round_trips_and_records_its_head_dim(trained_like_head, tmp_path):
    head = ih.load_head(trained_like_head)
    record = json.loads((tmp_path.parent / trained_like_head / ih.CONFIG_FILE).read_text())
    assert record["config"]["head_dim"] == D and record["base_model"] == {"name": "test"}
    again = ih.load_head(ih.save_head(head, tmp_path / "copy"))
    for name, value in ih.flat_params(head.params).items():
        np.testing.assert_array_equal(ih.flat_params(again.params)[name], value)
    assert np.asarray(ih.flat_params(head.params)["alpha"]).shape == ()


def test_a_head_for_another_head_dim_raises_config_error(trained_like_head):
    policy = get_policy("intentkv")
    other = dataclasses.replace(MODEL_CFG, head_dim=2 * D)
    with pytest.raises(jaxkv.ConfigError, match="head_dim 16"):
        policy.init_state(policy.make_config(head=trained_like_head), other)
    with pytest.raises(jaxkv.ConfigError, match="head_dim 32"):  # the shipped head is for the embedded model
        policy.init_state(policy.make_config(), MODEL_CFG)


def test_a_head_for_another_model_with_the_same_head_dim_raises_config_error(tmp_path):
    """The trainer records the model's signature; a model of the same head_dim but
    other layer counts is refused, the model it was trained for is not."""
    policy = get_policy("intentkv")
    head = ih.init_head(ih.HeadConfig(head_dim=D), seed=3)
    folder = ih.save_head(head, tmp_path / "h", base_model={"name": "model A", "signature": ih.model_signature(MODEL_CFG)})
    policy.init_state(policy.make_config(head=str(folder)), MODEL_CFG)
    deeper = dataclasses.replace(MODEL_CFG, num_layers=L + 1)
    with pytest.raises(jaxkv.ConfigError, match=r"model A, not this model: num_layers 2 \(head\) vs 3 \(model\)"):
        policy.init_state(policy.make_config(head=str(folder)), deeper)


def test_missing_or_malformed_head_raises_typed_errors(tmp_path, trained_like_head):
    with pytest.raises(jaxkv.CheckpointNotFoundError):
        ih.load_head(tmp_path / "nothing")
    bad = tmp_path / "bad"
    ih.save_head(ih.load_head(trained_like_head), bad)
    record = json.loads((bad / ih.CONFIG_FILE).read_text())
    record["config"]["hidden"] = 8  # the weights no longer fit the config
    (bad / ih.CONFIG_FILE).write_text(json.dumps(record))
    with pytest.raises(jaxkv.CheckpointError, match="shape"):
        ih.load_head(bad)


# -- the policies -----------------------------------------------------------------------------
def decide(name, head, feats, forced, budget, state=None):
    policy = get_policy(name)
    cfg = policy.make_config() if head is None else policy.make_config(head=head)
    if state is None:
        state = policy.init_state(cfg, MODEL_CFG)
    if hasattr(state, "memory"):
        state = state.replace(memory=memory_state(3))
    else:
        state = memory_state(3)
    kept, scores, _ = score_and_select(policy, cfg, state, feats, jnp.asarray(forced), jnp.int32(budget))
    return np.asarray(kept), np.asarray(scores)


def test_no_residual_keeps_exactly_the_memory_rules_set(trained_like_head):
    forced = np.zeros(N, bool)
    forced[:4] = forced[-10:] = True
    differs = False
    for seed in range(4):
        feats = make_feats(seed)
        for budget in (16, 24, 30):
            kept_rule, s = decide("intentkv_memory", None, feats, forced, budget)
            kept_nr, z_nr = decide("intentkv_no_residual", trained_like_head, feats, forced, budget)
            np.testing.assert_array_equal(kept_nr, kept_rule)
            np.testing.assert_array_equal(z_nr, s)
            kept_full, z = decide("intentkv", trained_like_head, feats, forced, budget)
            differs |= not np.array_equal(kept_full, kept_rule)
            assert kept_full.sum() == budget and (kept_full[forced]).all()
    assert differs  # the residual of this head changes some kept set, so the check above can fail


def test_ablations_change_what_they_name(trained_like_head):
    feats = make_feats(5)
    forced = np.zeros(N, bool)
    forced[-10:] = True
    cand = ~forced
    z = {name: decide(name, trained_like_head, feats, forced, 30)[1] for name in ABLATIONS}
    for name in ("intentkv", "intentkv_no_memory", "intentkv_no_xattn"):
        assert np.isfinite(z[name]).all() and (z[name][~cand] == 0).all()
    assert np.abs(z["intentkv_no_xattn"] - z["intentkv"])[cand].max() > 1e-4
    assert np.abs(z["intentkv_no_memory"] - z["intentkv"])[cand].max() > 1e-4
    # no cross-attention == the full head reading no span key
    no_span = dataclasses.replace(feats, query_span_N=None)
    np.testing.assert_allclose(decide("intentkv", trained_like_head, no_span, forced, 30)[1], z["intentkv_no_xattn"], rtol=1e-6)
    # no memory: the rule score against the unit-norm q̄_t, as intentkv_memory's first turn
    fresh = get_policy("intentkv_memory")
    s_q, _ = fresh.score(fresh.make_config(), fresh.init_state(fresh.make_config(), MODEL_CFG), feats, jnp.asarray(cand))
    head = ih.load_head(trained_like_head)
    m = feats.query_mean_LHD / jnp.linalg.norm(feats.query_mean_LHD, axis=-1, keepdims=True)
    r = ih.residual_scores(head.graphdef, head.params, ih.mean_keys(feats.keys_LNKD), ih.mean_query(m), feats.query_span_N)
    expected = np.where(cand, np.asarray(s_q) + float(ih.alpha_of(head.params, 2.0)) * np.asarray(r), 0.0)
    # float32 under jit vs eager: agreement to ~1e-6 of the scores' scale
    np.testing.assert_allclose(z["intentkv_no_memory"], expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_empty_span_and_alpha_clip(trained_like_head):
    head = ih.load_head(trained_like_head)
    kbar = ih.mean_keys(make_feats(6).keys_LNKD)
    m = jnp.ones(D) / 4
    empty = ih.residual_scores(head.graphdef, head.params, kbar, m, jnp.zeros(N, bool))
    none = ih.residual_scores(head.graphdef, head.params, kbar, m, None)
    assert np.isfinite(np.asarray(empty)).all()
    np.testing.assert_array_equal(empty, none)
    # K̄_Q holds the last span_keys live span positions, in position order
    span = np.zeros(N, bool)
    span[[3, 7, 20, 30, 41]] = True
    keys, valid = ih.span_keys_of(kbar, jnp.asarray(span), 3)
    np.testing.assert_array_equal(keys, kbar[np.asarray([20, 30, 41])])
    assert valid.all()
    for alpha, clipped in ((5.0, 2.0), (-1.0, 0.0), (0.5, 0.5)):
        params = ih.init_head(ih.HeadConfig(head_dim=D, alpha_init=alpha)).params
        assert float(ih.alpha_of(params, 2.0)) == clipped and float(ih.alpha_of(params)) == alpha


def test_learned_policies_run_in_a_session(task_model_dir, tmp_path):
    """Every learned policy runs through a real session (engine-filled features, no span),
    on both layouts and with RepairKV."""
    from jaxkv.serving import Session
    from jaxkv.tasks import agent_traces

    model = jaxkv.load_model(task_model_dir)
    head = ih.save_head(perturbed(ih.init_head(ih.HeadConfig(head_dim=model.config.head_dim), 0), 1), tmp_path / "h")
    ex = agent_traces(1, seed=3, length=1200, n_docs=2, registry=False)[0]
    runs = [(name, {}) for name in ABLATIONS] + [("intentkv", {"layout": "compact"}), ("intentkv", {"repair": 16})]
    for name, options in runs:
        session = Session(model, policy=name, budget=700, head=str(head), max_positions=2048, **options)
        session.replay(ex.messages[:-1], ex.tools)
        assert session.compressions, (name, options)
        assert all(c.live_after < c.live_before for c in session.compressions), (name, options)
        if "repair" in options:
            assert any(r.promoted_positions.size for r in session.repairs)


# -- training rows ----------------------------------------------------------------------------
def hand_built_conversation():
    from jaxkv.tasks.agent import tool_schema
    from jaxkv.tasks.example import tool_call

    tools = [tool_schema("open"), tool_schema("lookup")]
    opens = ["d011", "d012", "d013", "d014", "d015", "d016"]
    messages = [
        {"role": "system", "content": "You open documents. Never open d012 twice."},
        {"role": "user", "content": f"Open {', '.join(opens)} in this order, then look up v021."},
    ]
    for i, d in enumerate(opens):
        messages.append(
            {"role": "assistant", "content": "", "reasoning_content": "Next document.", "tool_calls": [tool_call("open", doc_id=d)]}
        )
        body = f"Document {d}: k100: v100" + (", see d013" if i == 0 else "")
        messages.append({"role": "tool", "name": "open", "content": body})
    messages.append(
        {"role": "assistant", "content": "", "reasoning_content": "The lookup.", "tool_calls": [tool_call("lookup", key="v021")]}
    )
    messages.append({"role": "tool", "name": "lookup", "content": "v021: v022"})
    messages.append({"role": "assistant", "content": "Answer: v022.", "reasoning_content": "Done."})
    return messages, tools


def test_labels_are_exactly_the_argument_values_of_the_next_five_calls(task_model_dir):
    from jaxkv.chat.render import render
    from train import intentkv_data as data

    model = jaxkv.load_model(task_model_dir)
    tok = model.tokenizer
    messages, tools = hand_built_conversation()
    out = data.trace_rows(model, messages, tools, answer_values=("v022",), keep_empty=True)
    rows = {r["turn"]: r for r in out["rows"]}
    # the second call's event: the next five calls open d012..d016; the lookup (v021) is the sixth
    row = rows[1]
    assert row["values"] == ("d012", "d013", "d014", "d015", "d016")
    j = [i for i, m in enumerate(messages) if m["role"] == "assistant"][1]
    prompt = render(tok, messages[:j], tools, add_generation_prompt=True)
    a, b = prompt.spans.actionable_query
    p = prompt.spans.protected_prefix[1]
    pieces = tok.convert_ids_to_tokens(prompt.ids.tolist())
    expected = np.asarray([t in row["values"] for t in pieces]) & (np.arange(prompt.ids.size) >= p)
    expected &= ~((np.arange(prompt.ids.size) >= a) & (np.arange(prompt.ids.size) < b))
    assert expected.sum() == 5  # d012..d016 in the user message; d013 in the query span and d012 in the system prompt are not
    np.testing.assert_array_equal(row["labels"] == 1, expected)
    # forced positions (protected prefix, query span) and template tokens are ignored (−1)
    assert (row["labels"][:p] == -1).all() and (row["labels"][a:b] == -1).all()
    delim = data.template_mask(tok, prompt)
    assert (row["labels"][delim] == -1).all()
    assert ((row["labels"] == 0) | (row["labels"] == 1))[p:a][~delim[p:a]].all()
    # the final answer is an action too: the lookup's event sees v021 and the answer's v022
    assert rows[6]["values"] == ("v021", "v022")
    assert data.future_values(messages, j, horizon=6) == ["d012", "d013", "d014", "d015", "d016", "v021"]


@pytest.fixture(scope="module")
def seed11_rows(task_model_dir):
    """The model, a 1400-token agent trace (seed 11) and its full-cache rows (``trace_rows``), made once."""
    from jaxkv.tasks import agent_traces
    from train import intentkv_data as data

    model = jaxkv.load_model(task_model_dir)
    ex = agent_traces(1, seed=11, length=1400, n_docs=3, registry=True)[0]
    return model, ex, data.trace_rows(model, ex.messages, ex.tools, data.answer_values_of(ex), keep_empty=True)


def test_row_scores_are_what_a_session_scores_at_its_event(seed11_rows):
    """The row's rule score, memory and forced set reproduce a real session's first event."""
    from jaxkv.policies import select
    from jaxkv.serving import Session

    model, ex, out = seed11_rows
    row = out["rows"][2]
    budget = max(out["rows"][1]["len"], row["len"] - 60)
    assert row["turn"] == 2 and out["rows"][1]["len"] <= budget < row["len"]  # the first event is this row's
    session = Session(model, policy="intentkv_memory", budget=budget, max_positions=4096)
    turn_j = [i for i, m in enumerate(ex.messages) if m["role"] == "assistant"][2]
    session.replay(ex.messages[: turn_j + 1], ex.tools)
    report = session.compressions[0]
    n = row["len"]
    assert report.live_before == n
    forced = row["labels"] == -1
    cand = np.ones(n, bool)
    a, b = row["span"]
    cand[: row["protected"]] = cand[a:b] = False
    kept = np.asarray(select(jnp.asarray(row["s"]), jnp.asarray(~cand), jnp.asarray(cand), budget))
    np.testing.assert_array_equal(np.flatnonzero(kept), report.kept_positions)
    np.testing.assert_allclose(row["s"][report.plan.evicted_positions], report.evicted_scores, rtol=2e-4, atol=1e-7)
    assert forced[~cand].all()


def test_managed_rows_are_what_each_event_of_a_managed_session_saw(seed11_rows):
    """``--events managed``: one row per compression event of a session running the
    rule. Its score and forced set reproduce the event's kept set; it holds only the
    live positions; its keys before the first event are the full-cache forward's and
    after it differ (computed over the kept rows: what the full-cache rows cannot
    show); its labels are the full cache's reads at its positions."""
    from jaxkv.policies import select
    from jaxkv.serving import Server
    from train import intentkv_data as data

    model, ex, full = seed11_rows
    by_turn = {r["turn"]: r for r in full["rows"]}
    first_event_len = by_turn[2]["len"]
    budget = max(by_turn[1]["len"], first_event_len - 60)
    server = Server(model, max_positions=4096)
    traces = data.managed_trace_rows(model, ex.messages, ex.tools, data.answer_values_of(ex), server=server, budget=budget)
    # the reference on a server of its own: on the same one the replay would share the rows'
    # session (its id derives from the conversation, ALGORITHMS.md §4) and its memory
    session = Server(model, max_positions=4096).session(policy="intentkv_memory", budget=budget, layout="dead_slot")
    session.replay(ex.messages, ex.tools)
    reports = session.compressions
    assert len(reports) >= 2 and len(traces) == len(reports)
    for trace, report in zip(traces, reports):
        row = trace["rows"][0]
        n = row["len"]
        assert n == report.live_before and trace["kbar"].shape == (n, model.config.head_dim)
        cand = ~row["forced"]
        kept = np.asarray(select(jnp.asarray(row["s"]), jnp.asarray(row["forced"]), jnp.asarray(cand), budget))
        np.testing.assert_array_equal(row["positions"][kept], report.kept_positions)
        assert (row["labels"][row["forced"]] == -1).all() and (row["labels_read"][row["forced"]] == -1).all()
        np.testing.assert_allclose(row["read_mass"], by_turn[row["turn"]]["read_mass"][row["positions"]], rtol=1e-6)
    assert traces[0]["rows"][0]["len"] == first_event_len
    second = traces[1]["rows"][0]
    assert not np.isin(reports[0].plan.evicted_positions, second["positions"]).any()
    before = second["positions"] < first_event_len
    diff = np.abs(traces[1]["kbar"] - full["kbar"][second["positions"]]).max(axis=-1)
    assert diff[before].max() < 1e-4
    assert diff[~before].max() > 100 * max(diff[before].max(), 1e-6)


def test_seed_ranges_are_disjoint_from_evaluation():
    from train import intentkv_data as data

    data.check_seed_ranges()
    seeds = range(data.TRAIN_SEED_BASE, data.TRAIN_SEED_BASE + data.SPLIT_SEEDS)
    for name, r in data.evaluation_seed_ranges().items():
        assert seeds.stop <= r.start or r.stop <= seeds.start, name
    from jaxkv.tasks.example import example_seed
    from jaxkv.tasks.seeds import EVAL_SEED_BASE

    assert example_seed(EVAL_SEED_BASE, 0) in data.evaluation_seed_ranges()["harness agent"]


# -- the trainer --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_run(task_model_dir, tmp_path_factory):
    from train import intentkv_data, intentkv_head

    folder = tmp_path_factory.mktemp("ikv")
    shutil.copytree(task_model_dir, folder / "model")  # --export writes the head into this model's folder
    intentkv_data.generate(
        intentkv_data.parse_args(
            [
                "--out",
                str(folder / "data"),
                "--model",
                str(task_model_dir),
                "--quick",
                "--quiet",
                "--length-min",
                "1300",
                "--length-max",
                "1500",
                "--heldout",  # of --quick's 4: the first two give the 4 held-out rows --quick's training measures
                "2",
            ]
        )
    )
    args = intentkv_head.parse_args(
        [
            "--data",
            str(folder / "data"),
            "--out",
            str(folder / "head"),
            "--quick",
            "--quiet",
            "--lr",
            "3e-3",
            "--export",
            str(folder / "model" / ih.HEAD_FOLDER),
            "--measure-labels",
            "actions,read@0.05",
        ]
    )
    return folder, intentkv_head.train(args)


def test_training_runs_three_steps_and_its_loss_falls(quick_run):
    folder, result = quick_run
    losses = result["losses"]  # --quick: every step is the same 8 rows, so the losses compare
    assert len(losses) == 3 and np.isfinite(losses).all()
    assert losses[2] < losses[1] < losses[0]
    first, last = result["summary"]["heldout_initial"], result["summary"]["heldout_final"]
    assert first["auc_z"] == first["auc_s"] and last["auc_s"] == first["auc_s"]  # z == s before training
    # the label-free yardstick: the share of the next replies' attention mass kept at B
    measured = [b for b in (1024, 1280, 1536) if f"mass{b}_z" in first]
    assert 1024 in measured
    for b in measured:
        assert first[f"mass{b}_z"] == first[f"mass{b}_s"] and 0.0 < last[f"mass{b}_z"] <= 1.0
    assert last["auc_z"] != first["auc_z"]
    for name in ("head.safetensors", "head.json", "training.png", "metrics.jsonl", "summary.json"):
        assert (folder / "head" / name).is_file(), name
    head = ih.load_head(folder / "head")
    assert head.cfg.head_dim == 16 and head.meta["training"]["heldout_final"]["update"] == 3


def test_a_resumed_data_run_states_the_seconds_of_every_run(quick_run, task_model_dir):
    """Rerun over the same folder: every shard exists, so nothing is generated, and
    meta.json's ``seconds`` still counts the run that wrote the shards."""
    from train import intentkv_data

    folder, _ = quick_run
    first = json.loads((folder / "data" / "meta.json").read_text())
    shards = sorted(p.stat().st_mtime_ns for p in (folder / "data").glob("*.npz"))
    again = intentkv_data.generate(
        intentkv_data.parse_args(
            [
                "--out",
                str(folder / "data"),
                "--model",
                str(task_model_dir),
                "--quick",
                "--quiet",
                "--length-min",
                "1300",
                "--length-max",
                "1500",
                "--heldout",  # of --quick's 4: the first two give the 4 held-out rows --quick's training measures
                "2",
            ]
        )
    )
    assert sorted(p.stat().st_mtime_ns for p in (folder / "data").glob("*.npz")) == shards  # nothing rewritten
    assert again["seconds"] == pytest.approx(first["seconds"] + again["seconds_this_run"], abs=0.11)
    assert again["train"] == first["train"] and again["heldout"] == first["heldout"]


def test_the_trained_head_is_also_measured_on_other_labels(quick_run):
    """``--measure-labels actions,read@0.05`` with ``--labels actions``: the final head
    is measured once more, on the held-out rows with a ``read@0.05`` positive, in the
    summary and the card; the training labels are not measured twice."""
    from train import intentkv_head
    from train.intentkv_data import load_shards

    folder, result = quick_run
    other = result["summary"]["heldout_final_on"]
    assert set(other) == {"read@0.05"}
    m = other["read@0.05"]
    rows = intentkv_head.Rows(load_shards(folder / "data", "heldout"), "read@0.05")
    assert m["heldout_rows"] == min(4, len(rows))  # --quick keeps 4 held-out rows
    assert all(0.0 <= m[f"recall{b}_{name}"] <= 1.0 for b in (1024, 1280, 1536) for name in "zs")
    card = (folder / "head" / "README.md").read_text()
    assert "The same head on `read@0.05` labels" in card and f"{m['auc_z']:.3f}" in card


def test_an_exported_head_is_what_sessions_on_its_model_load_and_carries_its_card(quick_run, task_model_dir):
    """``--export MODEL_FOLDER/intentkv-head``: a session with ``policy="intentkv"``
    and no ``head=`` on that model runs the trained head; the same model without
    one is refused (the embedded model's head was trained for another model)."""
    from jaxkv.errors import ConfigError
    from jaxkv.serving import Session

    folder, result = quick_run
    exported = folder / "model" / ih.HEAD_FOLDER
    for name in ("head.safetensors", "head.json", "training.png", "README.md"):
        assert (exported / name).is_file(), name
    card = (exported / "README.md").read_text()
    assert str(task_model_dir) in card and "ROC-AUC" in card and f"{result['summary']['alpha']:.3f}" in card
    assert f"python -m train.intentkv_data --out {folder / 'data'} --model {task_model_dir}" in card  # both commands
    with pytest.raises(ConfigError, match="intentkv-head"):
        Session(jaxkv.load_model(task_model_dir), policy="intentkv", budget=700)
    model = jaxkv.load_model(folder / "model")
    assert head_folder_of(model) == exported
    session = Session(model, policy="intentkv", budget=700, max_positions=2048)
    (stage,) = [s for s in session.stages if s.name == "retention"]
    assert stage.spec.config.head == str(exported)
    head = ih.load_head(stage.spec.config.head)
    for name, value in ih.flat_params(result["head"].params).items():
        np.testing.assert_array_equal(ih.flat_params(head.params)[name], value)


def test_training_resumes_from_its_checkpoint(quick_run, tmp_path):
    """Stopping after 2 updates and rerunning gives the 3-update run's losses and head."""
    from train import intentkv_head

    folder, result = quick_run
    out = tmp_path / "resume"
    base = ["--data", str(folder / "data"), "--out", str(out), "--quick", "--quiet", "--lr", "3e-3"]
    first = intentkv_head.train(intentkv_head.parse_args(base + ["--stop-after", "2"]))
    resumed = intentkv_head.train(intentkv_head.parse_args(base))
    np.testing.assert_allclose(first["losses"], result["losses"][:2], rtol=1e-6)
    np.testing.assert_allclose(resumed["losses"], result["losses"][2:], rtol=1e-5)
    for name, value in ih.flat_params(result["head"].params).items():
        np.testing.assert_allclose(ih.flat_params(resumed["head"].params)[name], value, rtol=1e-5, atol=1e-7)


def test_init_starts_from_a_trained_heads_weights_and_refuses_another_config(quick_run, tmp_path):
    """--init: the held-out metrics before the first update are the trained head's, and
    a head whose HeadConfig differs from the one the rows and flags ask for is refused."""
    from train import intentkv_head

    folder, result = quick_run
    base = ["--data", str(folder / "data"), "--quick", "--quiet", "--lr", "3e-3", "--init", str(folder / "head")]
    warm = intentkv_head.train(intentkv_head.parse_args(base + ["--out", str(tmp_path / "warm"), "--steps", "2"]))
    assert warm["summary"]["heldout_initial"]["auc_z"] == result["summary"]["heldout_final"]["auc_z"]
    assert warm["summary"]["heldout_initial"]["auc_z"] != result["summary"]["heldout_initial"]["auc_z"]
    with pytest.raises(jaxkv.ConfigError, match="--init"):
        intentkv_head.train(intentkv_head.parse_args(base + ["--out", str(tmp_path / "other"), "--span-keys", "64"]))


# -- label variants (named options beside §4's default) -------------------------------------------
def test_cue_variant_adds_the_tokens_before_a_match_on_its_line():
    from train import intentkv_data as data

    pieces = ["k173", ":", " v032", "\n", "Orchid", " travel", ":", " d017", " v032x"]
    text = "".join(pieces)
    ends = np.cumsum([len(p) for p in pieces])
    offsets = np.stack([ends - [len(p) for p in pieces], ends], axis=1)
    values = ("v032", "d017")
    plain = data.value_masks(text, offsets, values)
    np.testing.assert_array_equal(plain, [0, 0, 1, 0, 0, 0, 0, 1, 0])  # §4: whole-word matches only
    cue = data.value_masks(text, offsets, values, cue_tokens=4)
    np.testing.assert_array_equal(cue, [1, 1, 1, 0, 1, 1, 1, 1, 0])  # the newline is on the previous line
    np.testing.assert_array_equal(data.value_masks(text, offsets, values, cue_tokens=1), [0, 1, 1, 0, 0, 0, 1, 1, 0])


def test_read_strength_is_the_largest_attention_a_reply_row_gives_each_prompt_position():
    from train import intentkv_data as data

    rng = np.random.default_rng(0)
    T, n, end = 12, 7, 10
    q = rng.normal(size=(L, T, HQ, D)).astype(np.float32)
    k = rng.normal(size=(L, T, HKV, D)).astype(np.float32)
    got = data.read_strength(q, k, n, end)
    strongest, mass = data.read_stats(q, k, n, end)
    want, want_mass = np.zeros(n), np.zeros(n)
    for layer in range(L):
        for h in range(HQ):
            for r in range(n, end):
                logits = k[layer, : r + 1, h // (HQ // HKV)] @ q[layer, r, h] / np.sqrt(D)
                p = np.exp(logits - logits.max())
                want = np.maximum(want, (p / p.sum())[:n])
                want_mass += (p / p.sum())[:n] / (L * HQ * (end - n))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(strongest, got)
    np.testing.assert_allclose(mass, want_mass, rtol=1e-5, atol=1e-8)  # mean over layers, heads and rows


def test_mass_labels_are_the_top_fraction_of_each_rows_candidates_by_attention_mass():
    from train import intentkv_data as data

    # two rows of 5 and 4 positions; the first row's position 0 is forced
    arrays = {
        "labels_read": np.asarray([-1, 0, 1, 0, 0, 0, 0, 1, 0], np.int8),
        "read_mass": np.asarray([9.0, 0.1, 0.4, 0.3, 0.2, 0.5, 0.9, 0.1, 0.7], np.float32),
        "row_offset": np.asarray([0, 5, 9]),
    }
    got = data.label_array(arrays, "mass@0.5")
    # row 1: 4 candidates, top 2 by mass (0.4, 0.3); row 2: 4 candidates, top 2 (0.9, 0.7)
    np.testing.assert_array_equal(got, [-1, 0, 1, 1, 0, 0, 1, 0, 1])
    assert data.label_keys("actions+mass@0.3") == ["labels", "labels_read", "read_mass"]
    one_row = {k: v[:5] for k, v in arrays.items() if k != "row_offset"}  # a row of trace_rows
    np.testing.assert_array_equal(data.label_array(one_row, "mass@0.25"), [-1, 0, 1, 0, 0])
    for bad in ("mass@1", "mass@0", "mass@x", "mass"):
        with pytest.raises(ValueError, match="fraction"):
            data.label_keys(bad)
    with pytest.raises(KeyError):
        data.label_array({"labels_read": arrays["labels_read"]}, "mass@0.5")


def test_label_variants_share_ignored_positions_and_union_by_spec(task_model_dir):
    from train import intentkv_data as data

    model = jaxkv.load_model(task_model_dir)
    messages, tools = hand_built_conversation()
    every = data.trace_rows(model, messages, tools, answer_values=("v022",), keep_empty=True, read_threshold=0.0)
    none = data.trace_rows(model, messages, tools, answer_values=("v022",), keep_empty=True, read_threshold=1.01)
    for row, row_none in zip(every["rows"], none["rows"]):
        ignored = row["labels"] == -1
        forced = np.zeros(row["len"], bool)
        forced[: row["protected"]] = True
        forced[slice(*row["span"])] = True
        np.testing.assert_array_equal(row["labels_cue"] == -1, ignored)  # §4's ignored set
        np.testing.assert_array_equal(row["labels_read"] == -1, forced)  # template tokens are labelled
        assert (row["labels_read"][~forced] == 1).all()  # threshold 0: every position is read
        assert (row_none["labels_read"][~forced] == 0).all()  # above 1: none is
        assert ((row["labels_cue"] == 1) >= (row["labels"] == 1)).all()  # cue extends §4's label
        np.testing.assert_array_equal(data.label_array(row_none, "actions+cue"), row_none["labels_cue"])
        union = data.label_array(row_none, "actions+read")  # template tokens: read's 0; the rest: §4's
        np.testing.assert_array_equal(union, np.where(ignored & ~forced, 0, row_none["labels"]))
    assert sum((r["labels_cue"] == 1).sum() > (r["labels"] == 1).sum() for r in every["rows"]) > 0
    with pytest.raises(ValueError):
        data.label_keys("actions+attention")
    with pytest.raises(ValueError, match="threshold"):
        data.label_keys("read@2")
    with pytest.raises(KeyError):
        data.label_array({"labels": np.zeros(3, np.int8)}, "read")
    # read@T relabels from the stored strengths: at the generation threshold it is the read variant itself
    for row in none["rows"]:
        at = data.READ_THRESHOLD
        strong = row["read_max"].astype(np.float32) >= at
        relabelled = data.label_array(row, f"read@{at}")
        np.testing.assert_array_equal(relabelled == -1, row["labels_read"] == -1)
        np.testing.assert_array_equal(relabelled[relabelled >= 0], strong[relabelled >= 0])
        assert data.label_keys(f"actions+read@{at}") == ["labels", "labels_read", "read_max"]
        lower = data.label_array(row, "read@0.01")
        assert ((lower == 1) >= (relabelled == 1)).all() and (lower == 1).sum() > (relabelled == 1).sum()


def test_traces_for_a_template_without_tools_give_rows_of_that_models_shapes(smollm2_tokenizer):
    """SmolLM2's template has no tool section: the agent trace is rendered with its
    tools inlined (``jaxkv.tasks.example.for_template``), one message for one, and
    the rows take the model's own shapes (head_dim 64, its layers and heads), with
    labels read from the original calls (here a 2-layer cut, for time)."""
    from jaxkv.chat.render import render, template_takes_tools
    from jaxkv.models import registry
    from jaxkv.models.loading import read_config
    from jaxkv.tasks import agent_traces
    from jaxkv.tasks.example import for_template
    from train.intentkv_data import answer_values_of, trace_rows

    full = read_config(registry.converted_dir("smollm2-135m-instruct"))  # its config, without loading its weights
    model = jaxkv.model_from_config(dataclasses.replace(full, num_layers=2), tokenizer=smollm2_tokenizer)
    (ex,) = agent_traces(1, 200_000_123, length=700)
    assert not template_takes_tools(model.tokenizer)
    shown = for_template(ex, model.tokenizer)
    assert shown.tools == [] and len(shown.messages) == len(ex.messages)
    text = render(model.tokenizer, shown.messages, None, add_generation_prompt=False).text
    call = ex.messages[2]["tool_calls"][0]["function"]
    assert f'"name": "{call["name"]}"' in text and all(t["function"]["name"] in text for t in ex.tools)
    out = trace_rows(model, shown.messages, None, answer_values_of(ex), label_messages=ex.messages, keep_empty=True)
    cfg = model.config
    assert out["kbar"].shape == (out["ids"].size, cfg.head_dim) and out["rows"]
    assert any((r["labels"] == 1).any() for r in out["rows"])  # the original calls' values label the rows
    for r in out["rows"]:
        assert r["mbar"].shape == r["qbar"].shape == (cfg.head_dim,) and r["s"].shape == r["labels"].shape == (r["len"],)
    assert ex is not shown and for_template(shown, model.tokenizer) is shown  # nothing left to inline


def test_a_named_models_head_is_found_beside_its_converted_copy(tmp_path, monkeypatch, trained_like_head):
    """A model loaded by name lives in ``<cache>/models/<name>/float32``, which a
    reconversion replaces: its head is looked for one folder up (where
    ``--export`` puts it), then in the package's assets, which only the weights the
    shipped head was trained for find (their ``weights_id``, recorded in the
    assets' ``weights.json``); any other folder and weights have none."""
    import json
    import types

    from jaxkv.models import registry

    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path / "cache"))
    name = next(iter(registry.REFERENCE_MODELS))
    converted = registry.converted_dir(name)
    converted.mkdir(parents=True)
    shipped_id = json.loads((registry.SHIPPED_ASSETS / name / registry.WEIGHTS_MANIFEST).read_text())["weights_id"]
    model = types.SimpleNamespace(path=converted, weights_id=lambda: shipped_id)
    shipped = registry.SHIPPED_ASSETS / name / ih.HEAD_FOLDER
    assert head_folder_of(model) == shipped
    assert head_folder_of(types.SimpleNamespace(path=converted)) is None  # the folder alone: not the shipped head
    assert head_folder_of(types.SimpleNamespace(path=converted, weights_id=lambda: "w1:other")) is None
    shutil.copytree(trained_like_head, registry.model_dir(name) / ih.HEAD_FOLDER)
    assert head_folder_of(model) == registry.model_dir(name) / ih.HEAD_FOLDER
    elsewhere = types.SimpleNamespace(path=tmp_path / "elsewhere", weights_id=lambda: shipped_id)
    assert head_folder_of(elsewhere) == registry.model_dir(name) / ih.HEAD_FOLDER  # the weights name the model
    assert head_folder_of(types.SimpleNamespace(path=tmp_path / "elsewhere")) is None
    assert head_folder_of(types.SimpleNamespace(path=None)) is None


def test_row_generation_turns_on_the_persistent_compilation_cache(task_model_dir, tmp_path, monkeypatch):
    """A resumed run loads the programs of shapes an earlier run compiled (module
    docstring, Cost): ``generate`` turns the cache on before it loads the model."""
    from jaxkv import compiles
    from train import intentkv_data

    calls = []
    monkeypatch.setattr(compiles, "enable_persistent_cache", lambda *a, **k: calls.append(a))
    summary = intentkv_data.generate(
        intentkv_data.parse_args(
            ["--out", str(tmp_path / "data"), "--model", str(task_model_dir), "--traces", "0", "--heldout", "0", "--quiet"]
        )
    )
    assert calls == [()]
    assert summary["train"]["rows"] == 0 and summary["heldout"]["rows"] == 0
