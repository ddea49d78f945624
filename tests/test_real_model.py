"""SmolLM2-135M-Instruct, the real reference model, everywhere a model goes.

Loaded by name (``jaxkv.load_model("smollm2-135m-instruct")``, fetched by ``make
test``). The full 30-layer model answers a real retrieval task through a managed
``Session`` and is served over HTTP to the ``openai`` client (``jaxkv.generate``
on it is checked token for token in ``tests/test_gguf.py``). Every mechanism
(each retention policy, both layouts, RepairKV, ``kv_quant``, segment reuse) is
run on a two-layer cut of the same checkpoint: its real tokenizer, chat template,
head layout (9 query / 3 KV heads, head_dim 64) and tied embeddings, at a
fraction of the compile time of thirty layers.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import pytest
from flax import nnx

import jaxkv
from jaxkv.errors import ChatError, ConfigError
from jaxkv.policies import REGISTRY
from jaxkv.tasks.haystack import niah, passkey, reply_correct, reply_prefix

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return jaxkv.load_model(NAME)


def cut_layers(model, layers: int):
    """The first ``layers`` decoder layers of ``model`` (same embeddings, norm, tokenizer)."""
    cfg = dataclasses.replace(model.config, num_layers=layers)
    small = jaxkv.model_from_config(cfg, tokenizer=model.tokenizer)
    graphdef, state = nnx.split(small.module)
    pure, source = nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.state(model.module))
    pure["embed_tokens"], pure["norm"] = source["embed_tokens"], source["norm"]
    pure["layers"] = jax.tree.map(lambda a: a[:layers], source["layers"])  # the stacked layer weights' first rows
    nnx.replace_by_pure_dict(state, pure)
    small.module = nnx.merge(graphdef, state)
    small.path = model.path
    return small


@pytest.fixture(scope="module")
def shallow(smollm2):
    return cut_layers(smollm2, 2)


def test_by_name_loads_the_real_checkpoint(smollm2):
    cfg = smollm2.config
    assert (cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.max_position_embeddings == 8192
    tok = smollm2.tokenizer
    assert tok.convert_ids_to_tokens(tok("<|im_start|>user")["input_ids"])[0] == "<|im_start|>"
    assert smollm2.path.name == "float32"  # the converted copy, not the GGUF, on a load after fetch


def test_a_managed_session_answers_a_real_passkey_task(smollm2):
    """Question-agnostic passkey: the document is compressed to half its length at
    the end of turn 1 (SnapKV, dead-slot, RepairKV), the question comes in turn 2;
    the real model still names the key. (The full cache's ceiling on this task is
    the real-model report's: ``eval/results/real_smollm2``.)"""
    (ex,) = passkey(1, length=512, seed=20_251_125, tokenizer=smollm2.tokenizer)
    messages = ex.messages("agnostic")
    with jaxkv.Server(smollm2, rows=1, max_positions=640) as server:
        session = server.session(max_new_tokens=8, policy="snapkv", budget=256, layout="dead_slot", repair=32, protect_query=False)
        session.replay(messages[:2])
        reply = session.chat(messages[:3], reply_prefix=reply_prefix(ex))["content"]
        first = session.compressions[0]  # the document was compressed to the budget before the question came
        assert first.live_after <= 256 < first.live_before
        session.close()
    assert reply_correct(ex, reply), reply


SHALLOW_POSITIONS = 512  # every session on the cut model: one cache shape, its programs shared

MECHANISMS = (
    [
        dict(policy=name, budget=160, layout="dead_slot")
        for name in sorted(REGISTRY)
        if not name.startswith("intentkv") and name not in ("oldest", "random")
    ]  # the two controls: tests/test_retention.py
    + [dict(policy="snapkv", budget=160, layout="compact")]
    + [
        dict(policy="snapkv", budget=160, layout="dead_slot", repair=16),
        dict(kv_quant="int4"),
        dict(reuse="segment", tenant="t1"),
        dict(policy="intentkv_memory", budget=160, layout="dead_slot"),
    ]
)


@pytest.mark.parametrize("options", MECHANISMS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_every_mechanism_runs_a_multi_turn_conversation_on_the_real_weights(shallow, options):
    (ex,) = niah(1, length=256, seed=7, tokenizer=shallow.tokenizer, variant="single")  # a document over the budget
    messages, prefix = ex.messages("agnostic"), reply_prefix(ex)
    if "policy" in options:
        options = dict(options, protect_query=False)  # the document is the user turn: let the policy evict in it
    session = jaxkv.Session(shallow, max_new_tokens=6, max_positions=SHALLOW_POSITIONS, **options)
    try:
        first = session.replay(messages[:2])
        reply = session.chat(messages[:3], reply_prefix=prefix)
    finally:
        session.close()
    assert len(first) == 1
    if "policy" in options:
        assert session.compressions and session.compressions[0].live_after <= 160
    assert reply["role"] == "assistant" and reply["content"].startswith(prefix)
    assert len(reply["content"]) > len(prefix)


def test_triaxial_without_a_calibration_for_this_model_is_a_config_error(shallow, tmp_path):
    # the model from a folder with no calibration beside it (SmolLM2's own folder is
    # also looked up in the cache, where train.calibrate_triaxial may have put one)
    uncalibrated = copy.copy(shallow)
    uncalibrated.path = tmp_path
    with pytest.raises(ConfigError, match="triaxial"):
        jaxkv.Session(uncalibrated, kv_quant="triaxial", max_positions=SHALLOW_POSITIONS).chat([{"role": "user", "content": "hi"}])


def test_tools_with_a_template_that_has_no_tool_section_are_refused(shallow):
    session = jaxkv.Session(shallow, max_new_tokens=4, max_positions=SHALLOW_POSITIONS)
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
    try:
        with pytest.raises(ChatError, match="no tool section"):
            session.chat([{"role": "user", "content": "find it"}], tools)
        # the session is not damaged: the same request without tools is answered
        assert session.chat([{"role": "user", "content": "find it"}])["role"] == "assistant"
    finally:
        session.close()


def test_served_over_http_to_the_openai_client(smollm2):
    openai = pytest.importorskip("openai")
    from jaxkv.server import BackgroundServer, make_app

    app = make_app(smollm2, model_name=NAME, rows=1, max_positions=640, max_tokens=16)  # the passkey server's cache shape
    with BackgroundServer(app) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == [NAME]
        r = client.chat.completions.create(
            model=NAME,
            temperature=0,
            max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        )
        assert "Paris" in r.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=NAME,
                max_tokens=4,
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
            )
        body = info.value.body if isinstance(info.value.body, dict) else {}
        assert "no tool section" in str(body.get("message", info.value))
