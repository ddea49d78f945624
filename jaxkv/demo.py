"""``jaxkv demo``: the main job, a multi-turn agent chat through the paged cache.

With ``--model PATH`` it runs on that checkpoint (which needs a tokenizer with a
chat template). Otherwise it uses the embedded agent model when it is installed
and, until then, builds a tiny random Qwen3 checkpoint with a toy Qwen3-format
tokenizer in a temporary folder (the replies of a random model are noise; the
point is the machinery: rendering, radix reuse, prefill of the suffix only,
decoding, parsing, KV accounting).
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

DEMO_WORDS = (
    "find weather paris rome london tokyo sunny rainy cloudy degrees city compare "
    "the is and in what then answer ok warmest".split()
)


def _tool_schema():
    from jaxkv.chat.toy import schema

    return [schema("get_weather", "current weather of a city", city="city name")]


def build_random_checkpoint(folder) -> str:
    """Save a tiny random Qwen3 + toy tokenizer to ``folder``; returns its path."""
    import jaxkv
    from jaxkv.chat import build_tokenizer
    from jaxkv.config import ModelConfig

    tok = build_tokenizer(DEMO_WORDS)
    cfg = ModelConfig(
        model_type="qwen3", vocab_size=len(tok), hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
        max_position_embeddings=4096, eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
    )
    jaxkv.save_pretrained(jaxkv.model_from_config(cfg, seed=0, tokenizer=tok), folder)
    return str(folder)


def _short(text: str, n: int = 70) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def run_demo(model_path: str | None = None, turns: int = 4, seed: int = 0) -> int:
    import jaxkv
    from jaxkv.models.loading import EMBEDDED_DIR
    from jaxkv.session import Session

    if model_path is None and (EMBEDDED_DIR / "config.json").is_file():
        model_path = "embedded"
    with tempfile.TemporaryDirectory() as tmp:
        if model_path is None:
            print("jaxkv demo: no embedded model installed yet; building a tiny random Qwen3 checkpoint")
            model_path = build_random_checkpoint(tmp)
        t0 = time.perf_counter()
        model = jaxkv.load_model(model_path)
        cfg = model.config
        print(
            f"loaded {cfg.model_type} from {model_path}: {cfg.num_layers} layers, "
            f"{cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size} ({time.perf_counter() - t0:.1f}s)"
        )
        session = Session(model, keep_reasoning=True, max_positions=2048, max_new_tokens=24)
        tools = _tool_schema()
        rng = np.random.default_rng(seed)
        cities = ["paris", "rome", "london", "tokyo"]
        messages = [
            {"role": "system", "content": "find the weather and answer"},
            {"role": "user", "content": "what city is the warmest"},
        ]
        for t in range(turns):
            reply = session.chat(messages, tools, max_new_tokens=24, seed=seed + t)
            req = session.metrics.requests[-1]
            hit = f"prefix hit {req.prefix_hit_tokens}/{req.prompt_tokens} tokens"
            calls = reply.get("tool_calls") or []
            shown = (
                "calls " + ", ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in calls)
                if calls else f"says {_short(reply.get('content', ''))!r}"
            )
            print(f"turn {t + 1}: {hit}; model {shown}")
            # The scripted agent loop: record the model's reply, then a tool result.
            city = cities[t % len(cities)]
            messages.append({"role": "assistant", "content": reply.get("content", ""), "tool_calls": calls or None} if calls else {"role": "assistant", "content": reply.get("content", "")})
            result = f"{city} is {rng.choice(['sunny', 'rainy', 'cloudy'])} and {int(rng.integers(5, 30))} degrees"
            print(f"        tool -> {result}")
            messages.append({"role": "tool", "content": result})
        print()
        print(session.metrics.table())
    return 0
