"""kvpress on jaxkv's real-model tasks: the peer side of issues #32 and #75.

What it is for
--------------
Issue #32 compares jaxkv's KV retention methods with NVIDIA's kvpress on
SmolLM2-135M-Instruct, on the very same examples. This module runs kvpress's
presses (``PRESSES``, issue #32's: ``SnapKVPress``, ``StreamingLLMPress``,
``TOVAPress``, ``ObservedAttentionPress``, ``RandomPress``, ``KnormPress``,
``ExpectedAttentionPress``, ``KeyDiffPress``; ``PRESSES_75``, issue #75's: every
other press of kvpress 0.5.5 that runs on SmolLM2 at a given ratio, ``KVzipPress``,
the AdaKV- and CriticalKV-wrapped scorers, ``PyramidKVPress``, ``LagKVPress``,
``CURPress`` and the rest; each with kvpress's own defaults, recorded in every
output line) at kvpress compression ratios (the fraction of the KV removed), in
transformers, float32, on the CPU, on the examples of ``jaxkv.tasks`` (``passkey``,
``niah``, ``lm``, ``multiq``), both settings (``aware``, ``agnostic``). The token ids
come from ``jaxkv.tasks.real.plans`` (``token_plan``), i.e. from jaxkv's own
renderer, so both sides consume identical ids. ``docs/retention.md`` lists the
presses that cannot run here, and why.

A press spec names a wrapper around a scorer as ``Wrapper(Scorer)``
(``AdaKVPress(SnapKVPress)``); under the CriticalKV wrappers an
``ExpectedAttentionPress`` scorer runs without its value-norm rescaling, as they ask.

Protocol (kvpress's pipeline, ``KVPressTextGenerationPipeline``)
-------------------------------------------------------------------
The request (``plan.compressed``: the document, plus the question in the
``aware`` setting, plus the generation prompt) is prefilled once with the press
applied: after each decoder layer's attention, the press's ``compress`` turns
that layer's full keys/values into the kept ones. Then ``plan.rest`` (the
``agnostic`` setting's acknowledgement and question turn; empty when ``aware``)
and ``plan.answer`` are fed on the compressed cache at their original positions:
position ids continue from the *uncompressed* length, as kvpress's
``generate_answer`` does. Scores per (press, ratio) cell, plus the full cache:

* teacher forced: ``tf_correct`` = the argmax equals the reference at every
  digit-bearing answer token (``answer_digit_positions``); ``answer_nll`` = the
  mean NLL over those tokens;
* greedy: up to ``haystack.reply_budget`` tokens (the reference reply + 8, at most
  ``--max-new-tokens``) after ``compressed + rest``, stopped at
  the end-of-turn token, scored by ``reply_correct``; a cell whose every answer
  token is its teacher-forced argmax is not decoded (greedy would emit the answer
  itself; its reply is the answer), as on jaxkv's side;
* ``lm``: ``compressed`` = the context, ``answer`` = the 256 target tokens:
  the mean NLL per target token and the mean KL(full || pressed) per token.

In the ``aware`` setting ``rest`` is empty, so the first answer token is
predicted by the prefill's last position, which no compression touches (in
kvpress and in any prefill-then-compress cache alike); the reference replies
start with words ("The pass key is ..."), so every digit is predicted after it.

ObservedAttentionPress reads the attention weights, which only eager attention
returns: when it is among the presses the prefill runs eager (for every press,
as it would in kvpress with an eager model; the other presses keep the same
token sets as under sdpa) and the rest runs sdpa. ``eager_sdpa_check`` records
how far the two implementations' logits are apart (about 1e-4, same argmax).

Several questions over one context (``multiq``): the request is compressed once,
as above, and every question is answered from that one cache in conversation
order (``continue_questions``): the turn since the last answer fed, the answer
teacher forced and scored, a greedy reply where the answer's tokens are not all
the argmax, then the reference answer put back, so each question sees the
reference history, as on jaxkv's side. kvpress's own pipeline answers a list of
questions each from the bare context (it drops every question and answer); the
issue's protocol is the conversation. A cell records each question and their means
(``jaxkv.tasks.multiq.cell_record``).

Presses beyond one compress() per layer
---------------------------------------
* **Head-wise presses** (``AdaKVPress``, ``CriticalAdaKVPress``, ``KVzipPress``,
  ``KVgradPress``) keep the full cache and name the keys each head drops in
  ``module.masked_key_indices``; kvpress's attention patch (installed by ``import
  kvpress``) then swaps those keys for a key whose weight underflows to zero for
  the current queries. The shared prefill records each cell's masks; the batched
  continuation sets them on the modules per forward with the cell's row as the
  batch index (``Rows``). kvpress asserts these presses never run eager: beside
  ``ObservedAttentionPress`` they get a second, sdpa prefill (``cells_prefill``).
* **A count per layer** (``PyramidKVPress``; ``KVComposePress``): each layer of a
  row keeps its own count, and the row's slots past a layer's count are masked the
  same way in that layer. transformers 5 cannot feed several tokens on such a
  ``DynamicCache`` (its causal mask is sized for layer 0), so ``verify`` continues
  kvpress's own cache one token per forward (``stepwise_continue``).
* **Their own hooks or context manager** (``KVComposePress``): a prefill of their
  own per cell, kvpress's path (``own_path_prefill``: ``with press(model):
  model.model(ids, past_key_values=cache)``, as its pipeline calls it).
* **Context reconstruction** (``KVzipPress``, ``KVgradPress``): one prefill and
  the press's reconstruction passes per example, at the spec's highest ratio; its
  selection (``compress_post``) is then run on a copy of the same scores for each
  ratio (``own_cells``), which is what a run at that ratio would select.
* **Re-rotated keys** (``KeyRerotationPress``): the kept keys move to positions
  ``0 .. kept - 1`` and the continuation starts at the kept length, as kvpress's
  pipeline does for it (``Prefill.shift``).

Why one forward is shared, and why that is faithful
---------------------------------------------------
kvpress compresses inside forward hooks: ``BasePress.forward_hook`` runs after
each attention layer of the prefill, reads that layer's keys/values from the
cache, calls ``press.compress(module, hidden_states, keys, values, attentions,
kwargs)`` and writes the result back into the cache. Writing back cannot change
the prefill itself: within one forward, layer ``l`` attends with the keys/values
it has just computed, and no later layer reads layer ``l``'s cache. So the
prefill's hidden states, keys, values and attention weights are the same for
every press, and one prefill can serve every (press, ratio) cell:
``shared_prefill`` registers one hook per attention module that calls every
cell's own ``compress`` (the very method kvpress's hook calls, with the same
arguments) on the layer's full keys/values and keeps each result, leaving the
cache itself uncompressed (it is the full-cache cell). ``RandomPress`` (seed
``None``, kvpress's default) draws from torch's global generator; each cell
draws from its own generator state, seeded with the example's seed, which is
what the global generator holds after ``torch.manual_seed(seed)`` in a run of
that press alone.

The continuation runs every cell as one batch (``Rows``): one row per cell, the
shorter caches (higher ratios) padded and the padding masked out, new tokens
written in place (``GrowLayer``) rather than concatenated onto a copy of the
cache at every step, and rows leaving the batch as they stop generating.

``verify`` (``--verify``, and ``tests/test_kvpress_side.py``) checks all of it
against kvpress's own path, press by press: ``with press(model): model(ids,
past_key_values=cache)``, then ``rest`` + ``answer`` fed on that cache alone
(``plain_continue``) and greedy generation as kvpress's ``generate_answer``
does it (``plain_greedy``). The compressed caches are equal bit for bit, the
answer logits within 1e-4 with the same argmax, and the greedy tokens equal.

Compatibility (kvpress 0.5.5 with transformers 5.24-5.25 and torch 2.13)
-------------------------------------------------------------------------
kvpress 0.5.5 pins ``transformers<5.3``; it is installed with ``--no-deps``
(``eval/quality/requirements-kvpress.txt``). Three shims, all here, nothing patched in
site-packages:

* transformers 5.x passes the attention module its cache as ``cache`` (``past_key_values``
  is a deprecated alias) and no ``cache_position``; kvpress's hooks read
  ``kwargs["past_key_values"]`` and ``kwargs["cache_position"]``
  (``is_prefilling``). ``kvpress_hook_kwargs`` adds both (``cache_position`` =
  the new tokens' slots in the cache, what transformers < 5.3 passed), and
  ``kvpress_applied`` runs ``with press(model)`` with kvpress's own hooks called
  through it.
* ``import kvpress`` imports ``datasets`` (for presses that download calibration
  sets: DuoAttention, ExpectedAttentionStats; none is used here). When
  ``datasets`` is not installed, ``import_kvpress`` imports kvpress with a stub
  in its place, then removes the stub.
* ``KVgradPress`` replays the context on its ``ReadOnlyDynamicLayer``, whose
  ``update`` does not take the ``kwargs`` keyword transformers 5 passes;
  ``import_kvpress`` gives that class an ``update`` that accepts and ignores it
  (in this process only).

``verify`` (and ``tests/test_kvpress_side.py``) holds every kind above to kvpress's
own path: the same caches, the same masked keys, answer logits within float
tolerance and the same greedy tokens.

Seeds
-----
The examples are ``jaxkv.tasks.real.examples(task, n, length=, tokenizer=)``, the one
example source of both sides (``multiq``: from ``multiq.EVAL_SEED``, 100 above the
haystack tasks' base), drawn from ``haystack.EVAL_SEED = 2**30 + 11,000,000``
(above every training seed, < 2**30, and apart from the repository's other held-out
bases: +3e6 held-out, +7e6 calibration, +9e6 agent evaluation). Example ``i`` has the
seed ``example_seed(EVAL_SEED, i)`` (recorded per line), so a run of 8 is the first 8
of a run of 50, and jaxkv's driver (``eval/quality/real_model.py``) runs the same examples.

Threads: ``--threads`` (torch.set_num_threads, default 2), with
``OMP_WAIT_POLICY=PASSIVE`` unless set: on 2 shared cores, spinning OpenMP
threads made a run 3x slower than one thread.

Run (one JSON line per example in ``OUT/examples.jsonl``, or ``--journal
examples_NAME.jsonl`` for more presses on the same examples, with the run's setup;
``--resume`` skips the (task, length, seed) entries already there; ``--first``
splits a run)::

    python -m eval.quality.kvpress_side --task passkey --context 2048 --n 50 \\
        --out eval/results/real_smollm2/kvpress --resume
    python -m eval.quality.kvpress_side --task multiq --context 2048 --n 50 --presses issue75 \\
        --journal examples_75.jsonl --out eval/results/real_smollm2/kvpress --resume
    python -m eval.quality.kvpress_side --task passkey --context 2048 --verify   # the faithfulness check
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import inspect
import json
import math
import os
import platform
import sys
import time
import types
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# OpenMP threads that spin while they wait collapse when the 2 cores are shared: a decode
# step with 2 threads took 2.4 s instead of 0.34 s beside other work. Passive waiting,
# set before torch is imported (``python -m eval.quality.kvpress_side`` imports torch lazily).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODEL = "smollm2-135m-instruct"
TASK_CHOICES = ("passkey", "niah", "niah_single", "niah_multikey", "niah_multivalue", "lm", "multiq")

# Issue #32's grid (the journals of eval/results/real_smollm2/kvpress): the default.
PRESSES = (
    "SnapKVPress",
    "StreamingLLMPress",
    "TOVAPress",
    "ObservedAttentionPress",
    "RandomPress",
    "KnormPress",
    "ExpectedAttentionPress",
    "KeyDiffPress",
)
# Issue #75's: every other press of kvpress 0.5.5 that runs on SmolLM2 at a given ratio
# (docs/retention.md lists the rest and why not), a wrapper as "Wrapper(Scorer)".
PRESSES_75 = (
    "KVzipPress",
    "KVgradPress",
    "PyramidKVPress",
    "LagKVPress",
    "CURPress",
    "LeverageScorePress",
    "NonCausalAttnPress",
    "CompactorPress",
    "CapPress",
    "AdaKVPress(SnapKVPress)",
    "AdaKVPress(ExpectedAttentionPress)",
    "AdaKVPress(KeyDiffPress)",
    "CriticalKVPress(SnapKVPress)",
    "CriticalKVPress(ExpectedAttentionPress)",
    "CriticalAdaKVPress(SnapKVPress)",
    "CriticalAdaKVPress(ExpectedAttentionPress)",
    "ChunkKVPress(SnapKVPress)",
    "ChunkPress(SnapKVPress)",
    "EntropyGatedChunkKVPress(SnapKVPress)",
    "BlockPress(KeyDiffPress)",
    "MergingPress(KnormPress)",
    "KeyRerotationPress(SnapKVPress)",
    "KVComposePress",
)
KNOWN_PRESSES = PRESSES + PRESSES_75
# Wrappers whose ``press`` is a scorer: "AdaKVPress(SnapKVPress)"
WRAPPERS = (
    "AdaKVPress",
    "CriticalKVPress",
    "CriticalAdaKVPress",
    "ChunkKVPress",
    "ChunkPress",
    "BlockPress",
    "MergingPress",
    "EntropyGatedChunkKVPress",
    "KeyRerotationPress",
)
EAGER_PRESSES = frozenset({"ObservedAttentionPress"})  # need the attention weights (eager attention)
RATIOS = (0.25, 0.5, 0.75)
SETTINGS = ("aware", "agnostic")
MAX_NEW_TOKENS = 48  # the cap; each reply's own budget is haystack.reply_budget (the same rule as jaxkv's)
FULL = "full"
# the presses --verify compares with kvpress's own path (plus ObservedAttentionPress when eager)
VERIFY_PRESSES = ("SnapKVPress", "RandomPress", "ExpectedAttentionPress")


# --------------------------------------------------------------------------- kvpress import and shims
def import_kvpress():
    """``import kvpress``; with a stub ``datasets`` module while it imports when
    ``datasets`` is not installed (kvpress imports it for calibration downloads of
    presses not used here). The stub is removed afterwards."""
    if "kvpress" in sys.modules:
        return sys.modules["kvpress"]
    stub = None
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.__spec__ = importlib.machinery.ModuleSpec("datasets", None)

        def load_dataset(*args, **kwargs):
            raise ImportError("eval.quality.kvpress_side: `datasets` is not installed (kvpress imported with a stub)")

        stub.load_dataset = load_dataset
        sys.modules["datasets"] = stub
    try:
        import kvpress
    finally:
        if stub is not None and sys.modules.get("datasets") is stub:
            del sys.modules["datasets"]
    _read_only_layer_takes_cache_kwargs()
    return kvpress


def _read_only_layer_takes_cache_kwargs() -> None:
    """``KVgradPress`` replays the context on a ``ReadOnlyDynamicLayer`` whose
    ``update(key_states, value_states, cache_kwargs=None)`` predates transformers 5's
    ``update(..., kwargs=...)``; give it a method that accepts the keywords it does not
    use and does the same. The class is patched in this process only."""
    from kvpress.presses import kvgrad_press

    layer = kvgrad_press.ReadOnlyDynamicLayer
    if getattr(layer.update, "_takes_cache_kwargs", False):
        return
    original = layer.update

    def update(self, key_states, value_states, *args, **kwargs):
        return original(self, key_states, value_states)

    update._takes_cache_kwargs = True
    layer.update = update


def kvpress_available() -> bool:
    return importlib.util.find_spec("kvpress") is not None


def kvpress_hook_kwargs(module, kwargs: dict) -> dict:
    """The attention module's kwargs as kvpress 0.5.5's hooks read them.

    transformers >= 5.3 passes the cache as ``cache`` and no ``cache_position``;
    kvpress reads ``past_key_values`` and ``cache_position`` (the new tokens' slots
    in the cache, so ``cache_position[-1] + 1 == q_len`` exactly at the prefill).
    After the attention forward the layer's cache already holds the new tokens."""
    if "past_key_values" in kwargs and "cache_position" in kwargs:
        return kwargs
    import torch

    kw = dict(kwargs)
    cache = kw.get("past_key_values", kw.get("cache"))
    kw["past_key_values"] = cache
    if "cache_position" not in kw:
        hidden = kw["hidden_states"]
        n = cache.layers[module.layer_idx].get_seq_length()
        kw["cache_position"] = torch.arange(n - hidden.shape[1], n, device=hidden.device)
    return kw


def _adapted(hook):
    def adapted(module, args, kwargs, output):
        return hook(module, args, kvpress_hook_kwargs(module, kwargs), output)

    return adapted


def language_model(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


@contextlib.contextmanager
def kvpress_applied(press, model):
    """kvpress's own path: ``with press(model)`` (``BasePress.__call__``: its
    ``post_init_from_model``, rotary embedding and one ``press.forward_hook`` per
    attention module; ``KVzipPress`` registers its hooks later, for its
    reconstruction passes), every hook of the press called through
    ``kvpress_hook_kwargs``: the press's ``forward_hook`` is shadowed by an adapted
    one on the instance while it is applied."""
    press.forward_hook = _adapted(type(press).forward_hook.__get__(press))
    try:
        with press(model):
            yield
    finally:
        del press.forward_hook


def split_specs(text: str) -> list[str]:
    """A comma list of press specs, the commas inside a wrapper's parentheses kept."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [x.strip() for x in out + [cur] if x.strip()]


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``"AdaKVPress(SnapKVPress)"`` -> ``("AdaKVPress", "SnapKVPress")``; a plain name -> ``(name, None)``."""
    outer, _, inner = spec.partition("(")
    if inner and not inner.endswith(")"):
        raise ValueError(f"unbalanced press spec {spec!r}")
    return outer, inner[:-1] or None if inner else None


def make_press(name: str, ratio: float):
    """The press a spec names at ``ratio``, kvpress's defaults otherwise. A wrapper
    (``WRAPPERS``) takes its scorer at the ratio; under ``CriticalKVPress`` and
    ``CriticalAdaKVPress`` an ``ExpectedAttentionPress`` scorer runs without its
    value-norm rescaling (``use_vnorm=False``), as those presses ask (they weight
    by ``‖W_O v‖`` themselves and warn otherwise)."""
    kvpress = import_kvpress()
    outer, inner = parse_spec(name)
    if inner is None:
        return getattr(kvpress, outer)(compression_ratio=ratio)
    if outer not in WRAPPERS:
        raise ValueError(f"{outer} does not wrap a scorer; wrappers: {', '.join(WRAPPERS)}")
    base = make_press(inner, ratio)
    if outer.startswith("Critical") and isinstance(base, kvpress.ExpectedAttentionPress):
        base.use_vnorm = False
    press = getattr(kvpress, outer)(press=base)
    press.compression_ratio = ratio
    return press


def press_defaults(name: str) -> dict:
    """A press's settings other than the ratio (kvpress's defaults: windows, sinks, ...;
    a wrapper's with its scorer's under ``press``): its constructor's parameters."""
    press = make_press(name, 0.0)
    out = {}
    for param in inspect.signature(type(press).__init__).parameters:
        if param in ("self", "compression_ratio") or param.startswith("_"):
            continue
        value = getattr(press, param, None)
        if param == "press":
            out[param] = {"name": type(value).__name__, **press_defaults(type(value).__name__)}
            if getattr(value, "use_vnorm", True) is False:
                out[param]["use_vnorm"] = False
        elif isinstance(value, (int, float, str, bool, type(None))):
            out[param] = value
        else:
            out[param] = repr(value)
    return out


def press_kind(press) -> str:
    """How a cell of ``press`` is made: ``"shared"`` (its ``compress`` is the whole
    method: one shared prefill serves it), ``"kvzip"`` (``KVzipPress`` and its
    subclasses: a prefill of its own, then its context-reconstruction passes) or
    ``"own"`` (its own hooks or context manager: one prefill per cell)."""
    kvpress = import_kvpress()
    if isinstance(press, kvpress.KVzipPress):
        return "kvzip"
    base = kvpress.BasePress
    if type(press).__call__ is not base.__call__ or type(press).forward_hook is not base.forward_hook:
        return "own"
    return "shared"


def masks_keys(press) -> bool:
    """Whether ``press`` masks keys per head instead of removing them (AdaKV-style:
    ``module.masked_key_indices``), which kvpress's masking asserts never runs eager."""
    kvpress = import_kvpress()
    return isinstance(press, (kvpress.AdaKVPress, kvpress.CriticalAdaKVPress, kvpress.KVzipPress))


def prefill_attention(presses) -> str | None:
    """``"eager"`` when a press reads the attention weights (ObservedAttentionPress), else
    None (the model's own, sdpa). Only the prefill runs eager; ``rest``, the answer and
    generation run sdpa (``eager_sdpa_check`` measures the difference)."""
    return "eager" if any(type(p).__name__ in EAGER_PRESSES for p in presses) else None


def cell_name(press: str, ratio: float) -> str:
    return f"{press}@{ratio:g}"


# --------------------------------------------------------------------------- model
def model_folder(name_or_path: str = MODEL) -> Path:
    """The float32 HF folder: a path as given, or the reference model's converted copy
    (``jaxkv fetch NAME`` writes it; fetched and converted here when missing)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from jaxkv.models import registry
    from jaxkv.models.loading import fetch_reference

    folder = registry.converted_copy(name_or_path)
    if folder is None:
        fetch_reference(name_or_path)
        folder = registry.converted_dir(name_or_path)
    return Path(folder)


def load_hf(folder, attn: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation=attn).eval()


@contextlib.contextmanager
def attention(model, impl: str | None):
    """Run the model with attention ``impl`` (``eager``: the attention weights, which
    ObservedAttentionPress reads) inside, its own implementation outside."""
    before = model.config._attn_implementation
    if impl is None or impl == before:
        yield
        return
    model.set_attn_implementation(impl)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def cache_kw(model) -> str:
    """The forward's cache keyword: ``cache`` (transformers >= 5.x), else ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def stop_ids(tokenizer, model) -> list[int]:
    """End-of-turn ids (the template's message-closing tokens) and the EOS ids."""
    from jaxkv.chat.render import chat_markers

    ids = set(chat_markers(tokenizer).msg_close)
    eos = model.generation_config.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


# --------------------------------------------------------------------------- the shared prefill
@dataclasses.dataclass
class Prefill:
    length: int  # uncompressed length (positions continue from here)
    last_logits: Any  # (V,) the prefill's last position
    full: list  # per layer (keys, values), (1, kv_heads, length, head_dim)
    cells: dict  # cell name -> per layer (keys, values), compressed
    # cell name -> per layer (head indices, position indices) of the keys a head-wise press
    # masks (AdaKV-style ``masked_key_indices``, batch row 0), or None for a layer without
    masks: dict = dataclasses.field(default_factory=dict)
    # cell name -> how far its positions move back: a press that re-rotates its kept keys
    # to 0..kept-1 (KeyRerotationPress) continues at its kept length, as kvpress's pipeline does
    shift: dict = dataclasses.field(default_factory=dict)


def take_masks(model) -> list | None:
    """Every attention module's ``masked_key_indices`` (a head-wise press's masked keys)
    as per-layer ``(head indices, position indices)`` of batch row 0, cleared from the
    modules; None when no layer has any."""
    out = []
    for layer in language_model(model).layers:
        found = getattr(layer.self_attn, "masked_key_indices", None)
        layer.self_attn.masked_key_indices = None
        out.append(None if found is None else (found[-2].clone(), found[-1].clone()))
    return out if any(m is not None for m in out) else None


def _rng_state(seed: int):
    import torch

    return torch.Generator().manual_seed(seed).get_state()


def shared_prefill(model, ids, presses: dict, seed: int, attn: str | None = None) -> Prefill:
    """Prefill ``ids`` once (with attention ``attn``, default the model's); every press in
    ``presses`` (cell name -> press) compresses each layer's full keys/values with its
    own ``compress`` (as kvpress's ``forward_hook`` does); the cache itself stays
    uncompressed (the full cell)."""
    import torch
    from kvpress.presses.base_press import is_prefilling
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    lm = language_model(model)
    n_layers = len(lm.layers)
    for press in presses.values():
        press.post_init_from_model(model)
    rng = {name: _rng_state(seed) for name in presses}
    kept = {name: [None] * n_layers for name in presses}
    masks: dict = {}

    def hook(module, args, kwargs, output):
        kw = kvpress_hook_kwargs(module, kwargs)
        if not is_prefilling(kw["cache_position"], kw["hidden_states"].shape[1]):
            return output
        keys, values = extract_keys_and_values(kw["past_key_values"], module.layer_idx)
        outer = torch.get_rng_state()
        try:
            for name, press in presses.items():
                torch.set_rng_state(rng[name])
                module.masked_key_indices = None
                kept[name][module.layer_idx] = press.compress(module, kw["hidden_states"], keys, values, output[1], kw)
                found = getattr(module, "masked_key_indices", None)  # a head-wise press masks instead of removing
                if found is not None:
                    masks.setdefault(name, [None] * n_layers)[module.layer_idx] = (found[-2].clone(), found[-1].clone())
                    module.masked_key_indices = None
                rng[name] = torch.get_rng_state()
        finally:
            torch.set_rng_state(outer)
        return output

    handles = []
    try:
        for layer in lm.layers:
            layer.self_attn.rotary_emb = lm.rotary_emb  # as BasePress.__call__ does
            handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        cache = DynamicCache()
        with torch.no_grad(), attention(model, attn):
            out = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], logits_to_keep=1, **{cache_kw(model): cache})
    finally:
        for h in handles:
            h.remove()
    full = [(layer.keys, layer.values) for layer in cache.layers]
    return Prefill(len(ids), out.logits[0, -1], full, kept, masks)


def own_path_prefill(model, ids, press, seed: int, attn: str | None = None):
    """kvpress's own path for one press, as its pipeline runs it: ``torch.manual_seed(seed)``,
    then ``with press(model): model.model(ids, past_key_values=cache)`` (the decoder
    without the head; ``KVzipPress`` reads those keywords), and the head on the last
    position. Returns (last logits, cache); a head-wise press's masks stay on the
    attention modules (``take_masks``)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    torch.manual_seed(seed)
    # no_grad outermost: a press's work after the prefill (KVzip's reconstruction passes)
    # runs when its context exits, and kvpress's pipeline runs it all without gradients
    with torch.no_grad(), kvpress_applied(press, model), attention(model, attn):
        out = language_model(model)(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], past_key_values=cache)
    with torch.no_grad():
        last = model.lm_head(out.last_hidden_state[:, -1:])[0, -1]
    return last, cache


def own_cells(model, ids, presses: dict, seed: int, prefill: Prefill) -> None:
    """Add to ``prefill`` the cells of presses that cannot share its prefill
    (``press_kind`` ``"own"`` or ``"kvzip"``): each its own prefill with kvpress's
    hooks, the cache it leaves (compressed, or full with its head-wise masks) as the
    cell. A ``"kvzip"`` press scores once for all its ratios: its prefill and its
    reconstruction passes run at the spec's highest ratio, and its selection
    (``compress_post``) is then applied to a copy of the same scores at each ratio."""
    groups: dict = {}
    for name, press in presses.items():
        spec = name.rsplit("@", 1)[0]
        groups.setdefault((spec, press_kind(press)), {})[name] = press
    for (spec, kind), cells in groups.items():
        if kind == "own":
            for name, press in cells.items():
                _, cache = own_path_prefill(model, ids, press, seed)
                prefill.cells[name] = [(layer.keys, layer.values) for layer in cache.layers]
                found = take_masks(model)
                if found is not None:
                    prefill.masks[name] = found
            continue
        top = max(cells, key=lambda n: cells[n].compression_ratio)
        press, ratios = cells[top], {n: p.compression_ratio for n, p in cells.items()}
        chosen: dict = {}
        select = type(press).compress_post.__get__(press)

        def each_ratio(model_, press=press, ratios=ratios, chosen=chosen, select=select, top=top):
            scores = press.score_val.clone()
            for name, ratio in ratios.items():
                press.score_val, press.compression_ratio = scores.clone(), ratio
                select(model_)
                chosen[name] = take_masks(model_)
            press.compression_ratio = ratios[top]

        press.compress_post = each_ratio
        try:
            _, cache = own_path_prefill(model, ids, press, seed)
        finally:
            del press.compress_post
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        for name in cells:
            prefill.cells[name] = kv
            if chosen.get(name) is not None:
                prefill.masks[name] = chosen[name]


# --------------------------------------------------------------------------- continuation on a cache
def _grow_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowLayer(DynamicLayer):
        """A DynamicLayer whose keys/values live in a preallocated buffer: ``update``
        writes the new tokens in place and exposes a view, instead of concatenating a
        copy of the whole cache at every step (the same keys/values, bit for bit)."""

        def __init__(self, keys, values):
            super().__init__()
            self.device = keys.device
            self._k, self._v = keys, values
            self.is_initialized = True
            self.resize(0)

        def resize(self, n: int) -> None:
            self._n = n
            self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

        def update(self, key_states, value_states, *args, **kwargs):
            n, k = self._n, key_states.shape[-2]
            if n + k > self._k.shape[2]:  # out of room: grow (not expected: capacity is planned)
                pad = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], n + k - t.shape[2], t.shape[3])], dim=2)
                self._k, self._v = pad(self._k), pad(self._v)
            self._k[:, :, n : n + k] = key_states
            self._v[:, :, n : n + k] = value_states
            self.resize(n + k)
            return self.keys, self.values

        def select(self, rows) -> None:
            self._k, self._v = self._k[rows], self._v[rows]
            self.resize(self._n)

    import torch

    return GrowLayer


class Rows:
    """A batch of compressed caches (one row per cell) continued together.

    Row ``r``'s kept keys/values fill slots ``[0, n_r)`` of every layer; rows shorter
    than the longest (other ratios) are padded and the padding is masked out
    (``attention_mask``), so each row attends to exactly its own cache. New tokens go
    to the slots after the padding, at the position ids given (kvpress's: continuing
    from the uncompressed length).

    Head-wise presses (``masks``: per row, per layer ``(heads, positions)`` or None)
    keep their full cache and mask keys per head the way kvpress does, through its
    attention patch (``module.masked_key_indices``, the row as the batch index), set
    on the attention modules for each forward and cleared after it. A row whose layers
    keep different counts (``PyramidKVPress``) fills layer ``l``'s slots
    ``[0, n_rl)`` and masks the rest of its row's slots in that layer the same way."""

    def __init__(
        self,
        model,
        rows: Sequence[list],
        extra: int,
        consume: bool = False,
        masks: Sequence | None = None,
        shift: Sequence[int] | None = None,
    ):
        import torch
        from transformers import DynamicCache

        self.shift = torch.as_tensor(shift if shift is not None else [0] * len(rows), dtype=torch.long)

        grow = _grow_layer_class()
        n_layers = len(rows[0])
        lengths = [[row[layer][0].shape[2] for layer in range(n_layers)] for row in rows]
        row_len = [max(ls) for ls in lengths]
        width = max(row_len)
        self.model, self.kw = model, cache_kw(model)
        self.modules = [layer.self_attn for layer in language_model(model).layers]
        self.cache = DynamicCache()
        layers, self.masked = [], []
        heads = rows[0][0][0].shape[1]
        for layer in range(n_layers):
            k0, v0 = rows[0][layer]
            k = k0.new_zeros(len(rows), k0.shape[1], width + extra, k0.shape[3])
            v = v0.new_zeros(len(rows), v0.shape[1], width + extra, v0.shape[3])
            parts = []
            for r, row in enumerate(rows):
                n = lengths[r][layer]
                k[r, :, :n] = row[layer][0][0]
                v[r, :, :n] = row[layer][1][0]
                if consume:  # the caller's per-layer lists: free each layer once copied
                    row[layer] = None
                found = masks[r][layer] if masks is not None and masks[r] is not None else None
                if found is not None:
                    parts.append((torch.full_like(found[0], r), found[0], found[1]))
                if n < row_len[r]:  # this layer keeps fewer than the row's longest: mask the gap
                    gap = torch.arange(n, row_len[r])
                    parts.append(
                        (torch.full((heads * gap.numel(),), r), torch.arange(heads).repeat_interleave(gap.numel()), gap.repeat(heads))
                    )
            self.masked.append(tuple(torch.cat(x) for x in zip(*parts)) if parts else None)
            layers.append(grow(k, v))
            layers[-1].resize(width)
        self.cache.layers = layers
        self.valid = torch.zeros(len(rows), width + extra, dtype=torch.long)
        for r, n in enumerate(row_len):
            self.valid[r, :n] = 1
        self.padded = min(row_len) < width

    @property
    def length(self) -> int:
        return self.cache.layers[0]._n

    def feed(self, ids, start: int, logits_to_keep: int = 0):
        """Feed ``ids`` (B, q) at positions ``start ...``; returns the logits."""
        import torch

        n, q = self.length, ids.shape[1]
        if n + q > self.valid.shape[1]:
            self.valid = torch.cat([self.valid, self.valid.new_ones(self.valid.shape[0], n + q - self.valid.shape[1])], 1)
        self.valid[:, n : n + q] = 1
        mask = self.valid[:, : n + q] if self.padded else None
        for module, masked in zip(self.modules, self.masked):
            module.masked_key_indices = masked
        try:
            positions = torch.arange(start, start + q)[None] - self.shift[:, None]  # a re-rotated row continues at its length
            return self.model(
                input_ids=ids, position_ids=positions, attention_mask=mask, logits_to_keep=logits_to_keep, **{self.kw: self.cache}
            ).logits
        finally:
            for module in self.modules:
                module.masked_key_indices = None

    def truncate(self, n: int) -> None:
        for layer in self.cache.layers:
            layer.resize(n)

    def select(self, rows) -> None:
        import torch

        new_of = torch.full((self.valid.shape[0],), -1, dtype=torch.long)  # old row -> new row, -1: gone
        new_of[torch.as_tensor(rows, dtype=torch.long)] = torch.arange(len(rows))
        for layer in self.cache.layers:
            layer.select(rows)
        self.valid = self.valid[rows]
        self.shift = self.shift[rows]
        for layer, masked in enumerate(self.masked):
            if masked is not None:
                b = new_of[masked[0]]
                keep = b >= 0
                self.masked[layer] = (b[keep], masked[1][keep], masked[2][keep]) if keep.any() else None


def kept_of(layers: list, masks: list | None) -> float | int:
    """The KV a cell keeps per layer and KV head, averaged (an int when every layer
    and head keeps the same count): the cache's length less the masked keys."""
    heads = layers[0][0].shape[1]
    per_layer = [
        k.shape[2] * heads - (0 if masks is None or masks[l] is None else int(masks[l][1].numel())) for l, (k, _) in enumerate(layers)
    ]
    mean = sum(per_layer) / (len(per_layer) * heads)
    return int(mean) if mean == int(mean) else round(mean, 2)


@dataclasses.dataclass
class Continuation:
    answer_logits: Any = None  # (B, len(answer), V): the logits predicting each answer token
    generated: list | None = None  # per row, the greedy token ids (up to and including a stop id)


def continue_rows(
    model,
    rows: Sequence[list],
    start: int,
    rest,
    answer,
    prefill_last,
    *,
    stops=(),
    teacher_force=True,
    greedy=True,
    max_new_tokens: int = MAX_NEW_TOKENS,
    consume: bool = False,
    skip_agreeing: bool = False,
    masks: Sequence | None = None,
    shift: Sequence[int] | None = None,
) -> Continuation:
    """Feed ``rest`` then (teacher-forced) ``answer`` after each row's compressed cache
    (``rows``: per row, per layer (keys, values)) at positions ``start, start + 1, ...``;
    then greedy generation after ``rest``, rows dropping out of the batch as they stop.
    ``prefill_last``: the prefill's last logits, which predict the first answer token
    when ``rest`` is empty. ``consume``: empty ``rows``' per-layer lists while copying
    them into the batch (bounds the memory: the cells' caches are held once).
    ``skip_agreeing`` (with teacher forcing): a row whose every answer token is its
    teacher-forced argmax is not decoded; greedy decoding would emit the answer
    itself (by induction), so its ``generated`` is the answer (no stop id), as
    ``eval.quality.real_model`` does on jaxkv's side. ``masks``: per row, a head-wise
    press's masked keys; ``shift``: per row, how far its positions move back (``Rows``)."""
    import torch

    batch = Rows(model, rows, extra=len(rest) + len(answer) + max_new_tokens, consume=consume, masks=masks, shift=shift)
    b = len(rows)
    rest_t = torch.as_tensor(np.asarray(rest), dtype=torch.long)[None].expand(b, -1)
    ans_t = torch.as_tensor(np.asarray(answer), dtype=torch.long)[None].expand(b, -1)
    pos = start
    res = Continuation()
    with torch.no_grad():
        if rest_t.shape[1]:
            last = batch.feed(rest_t, pos, logits_to_keep=1)[:, -1]
            pos += rest_t.shape[1]
        else:
            last = prefill_last[None].expand(b, -1)
        base = batch.length
        if teacher_force and ans_t.shape[1]:
            logits = last[:, None]
            if ans_t.shape[1] > 1:
                logits = torch.cat([logits, batch.feed(ans_t[:, :-1], pos)], dim=1)
            res.answer_logits = logits
            batch.truncate(base)
        if greedy:
            stop = set(int(t) for t in stops)
            tok = last.argmax(-1)
            gen = [[int(t)] for t in tok]
            agreeing = set()
            if skip_agreeing and res.answer_logits is not None:
                agreeing = set(np.flatnonzero((res.answer_logits.argmax(-1) == ans_t).all(-1).numpy()).tolist())
                for r in agreeing:
                    gen[r] = [int(t) for t in np.asarray(answer)]
            active = [r for r in range(b) if r not in agreeing and gen[r][-1] not in stop]
            if len(active) < b:
                batch.select(active)
                tok = tok[active]
            for step in range(max_new_tokens - 1):
                if not active:
                    break
                tok = batch.feed(tok[:, None], pos + step, logits_to_keep=1)[:, -1].argmax(-1)
                for i, r in enumerate(active):
                    gen[r].append(int(tok[i]))
                keep = [i for i, r in enumerate(active) if gen[r][-1] not in stop]
                if len(keep) < len(active):
                    active = [active[i] for i in keep]
                    if active:
                        batch.select(keep)
                        tok = tok[keep]
            res.generated = gen
    return res


def continue_questions(
    model,
    rows: Sequence[list],
    start: int,
    plans,
    prefill_last,
    *,
    stops=(),
    max_new_tokens: int = MAX_NEW_TOKENS,
    consume: bool = False,
    masks: Sequence | None = None,
    shift: Sequence[int] | None = None,
) -> list:
    """Several questions after each row's compressed cache (``jaxkv.tasks.multiq``):
    per question, the conversation since the last answer (``multiq.new_rest``) and
    the answer teacher forced, then a greedy reply for every row whose answer tokens
    are not all their rows' argmax (as ``continue_rows`` with ``skip_agreeing``:
    decoded from the question's turn, up to ``haystack.reply_budget`` tokens), then the
    reference answer back in place of the reply, so the next question sees the
    reference history. No row leaves the batch (a finished row is fed and ignored).
    Returns, per row, one ``(answer_logits [A, V], generated ids)`` per question."""
    import torch
    from jaxkv.tasks import multiq
    from jaxkv.tasks.haystack import reply_budget

    last_plan = plans[-1]
    extra = len(last_plan.rest) + len(last_plan.answer) + max_new_tokens
    batch = Rows(model, rows, extra=extra, consume=consume, masks=masks, shift=shift)
    b = len(rows)
    stop = set(int(t) for t in stops)
    out = [[] for _ in range(b)]
    pos, last = start, prefill_last[None].expand(b, -1)
    with torch.no_grad():
        for q, plan in enumerate(plans):
            fed = multiq.new_rest(plans, q)
            if fed.size:
                last = batch.feed(torch.as_tensor(fed, dtype=torch.long)[None].expand(b, -1), pos, logits_to_keep=1)[:, -1]
                pos += fed.size
            base, base_pos = batch.length, pos
            ans = torch.as_tensor(np.asarray(plan.answer), dtype=torch.long)[None].expand(b, -1)
            logits = batch.feed(ans, pos)  # row i predicts answer token i + 1
            answer_logits = torch.cat([last[:, None], logits[:, :-1]], dim=1)
            after = logits[:, -1]
            agree = (answer_logits.argmax(-1) == ans).all(-1).tolist()
            gen = [[int(t) for t in plan.answer] if agree[r] else None for r in range(b)]
            todo = [r for r in range(b) if not agree[r]]
            if todo:
                batch.truncate(base)
                tok = last.argmax(-1)
                for r in todo:
                    gen[r] = [int(tok[r])]
                live = {r for r in todo if gen[r][-1] not in stop}
                for step in range(reply_budget(plan, max_new_tokens) - 1):
                    if not live:
                        break
                    tok = batch.feed(tok[:, None], base_pos + step, logits_to_keep=1)[:, -1].argmax(-1)
                    for r in list(live):
                        gen[r].append(int(tok[r]))
                        if gen[r][-1] in stop:
                            live.discard(r)
                batch.truncate(base)
                batch.feed(ans, base_pos, logits_to_keep=1)  # the reference answer back: the next question's history
            for r in range(b):
                out[r].append((answer_logits[r], gen[r]))
            pos, last = base_pos + plan.answer.size, after
    return out


def plain_continue(model, cache, start: int, rest, answer, prefill_last):
    """kvpress's way, for ``verify``: ``rest + answer[:-1]`` fed in one call on the
    DynamicCache the press left, at positions from ``start``. Returns (len(answer), V) logits."""
    import torch

    ids = np.concatenate([np.asarray(rest), np.asarray(answer)[:-1]])
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(ids, dtype=torch.long)[None],
            position_ids=torch.arange(start, start + ids.size)[None],
            **{cache_kw(model): cache},
        ).logits[0]
    first = out[len(rest) - 1 : len(rest)] if len(rest) else prefill_last[None]
    return torch.cat([first, out[len(rest) :]], dim=0)


def stepwise_continue(model, cache, start: int, rest, answer, prefill_last):
    """``plain_continue`` one token per forward: for a cache whose layers keep different
    counts (``PyramidKVPress``, ``KVComposePress``), on which transformers 5 cannot
    feed several tokens at once (its causal mask is sized for layer 0's keys)."""
    import torch

    ids = np.concatenate([np.asarray(rest), np.asarray(answer)[:-1]])
    rows = []
    with torch.no_grad():
        for i, t in enumerate(ids.tolist()):
            rows.append(
                model(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[start + i]]), **{cache_kw(model): cache}).logits[0, -1]
            )
    out = torch.stack(rows) if rows else prefill_last.new_zeros(0, prefill_last.shape[-1])
    first = out[len(rest) - 1 : len(rest)] if len(rest) else prefill_last[None]
    return torch.cat([first, out[len(rest) :]], dim=0)


def truncate(cache, n: int) -> None:
    """Keep every layer's first ``n`` entries (kvpress's ``_remove_answer_from_cache``)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


def plain_greedy(
    model, cache, start: int, rest, prefill_last, stops, max_new_tokens: int = MAX_NEW_TOKENS, stepwise: bool = False
) -> list[int]:
    """kvpress's ``generate_answer`` on one cache: ``rest`` at positions from ``start``,
    then one token at a time until a stop id (included) or ``max_new_tokens``.
    ``stepwise``: ``rest`` one token per forward too (``stepwise_continue``)."""
    import torch

    kw = cache_kw(model)
    with torch.no_grad():
        pos = start
        if len(rest):
            chunks = [[t] for t in np.asarray(rest).tolist()] if stepwise else [np.asarray(rest).tolist()]
            for chunk in chunks:
                last = model(
                    input_ids=torch.as_tensor(chunk, dtype=torch.long)[None],
                    position_ids=torch.arange(pos, pos + len(chunk))[None],
                    logits_to_keep=1,
                    **{kw: cache},
                ).logits[0, -1]
                pos += len(chunk)
        else:
            last = prefill_last
        gen = [int(last.argmax())]
        for i in range(max_new_tokens - 1):
            if gen[-1] in stops:
                break
            out = model(input_ids=torch.tensor([[gen[-1]]]), position_ids=torch.tensor([[pos + i]]), **{kw: cache})
            gen.append(int(out.logits[0, -1].argmax()))
    return gen


# --------------------------------------------------------------------------- one example
def score_qa(example, tokenizer, plan, answer_logits, generated, digit_pos) -> dict:
    import torch
    from jaxkv import tasks

    answer = torch.as_tensor(np.asarray(plan.answer), dtype=torch.long)
    logp = torch.log_softmax(answer_logits.float(), dim=-1)
    nll = -logp.gather(-1, answer[:, None])[:, 0]
    argmax = answer_logits.argmax(-1)
    pos = torch.as_tensor(digit_pos, dtype=torch.long)
    reply = None if generated is None else tokenizer.decode(generated, skip_special_tokens=True)
    return {
        "tf_correct": bool((argmax[pos] == answer[pos]).all()) if len(pos) else None,
        "tf_digit_hits": int((argmax[pos] == answer[pos]).sum()),  # of n_digits digit-bearing tokens
        "answer_nll": float(nll[pos].mean()) if len(pos) else None,
        "gen_correct": None if reply is None else bool(tasks.reply_correct(example, reply)),
        "reply": reply,
    }


def run_setting(model, tokenizer, example, setting: str, presses: dict, *, stops, max_new_tokens=MAX_NEW_TOKENS) -> dict:
    """Every cell (full + each press) of one example in one setting: one shared prefill
    for every press it can serve (two when an eager press meets a head-wise one, which
    kvpress never runs eager; the full cell is the first's), a prefill of its own for
    the others (``own_cells``), every cell continued in batches and scored:
    ``{"n_compressed", "n_rest", "n_answer", "cells"}``."""
    from jaxkv.tasks import real

    plans = real.plans(example, tokenizer, setting)
    plan = plans[0]
    prefill = cells_prefill(model, plan.compressed, presses, example.seed)
    if len(plans) > 1:
        return score_question_cells(model, tokenizer, example, plans, prefill, stops=stops, max_new_tokens=max_new_tokens)
    return score_cells(model, tokenizer, example, plan, prefill, stops=stops, max_new_tokens=max_new_tokens)


def cells_prefill(model, ids, presses: dict, seed: int) -> Prefill:
    """The full cache and every press's cell of one request: one shared prefill for
    every press it can serve (``press_kind`` ``"shared"``; a second, sdpa, for the
    head-wise ones when an eager press is among them, since kvpress never runs those
    eager: the full cell is the first's), then a prefill of its own for each other
    (``own_cells``). ``prefill.cells`` in the order of ``presses``."""
    shared = {n: p for n, p in presses.items() if press_kind(p) == "shared"}
    eager = {n: p for n, p in shared.items() if prefill_attention([p]) == "eager"}
    plain = {n: p for n, p in shared.items() if n not in eager and not (eager and masks_keys(p))}
    prefill = shared_prefill(model, ids, {**eager, **plain}, seed, prefill_attention(eager.values()))
    rest = {n: p for n, p in shared.items() if n not in eager and n not in plain}
    if rest:  # head-wise presses beside an eager one: their own sdpa prefill, its full cache dropped
        more = shared_prefill(model, ids, rest, seed)
        prefill.cells.update(more.cells)
        prefill.masks.update(more.masks)
    own_cells(model, ids, {n: p for n, p in presses.items() if n not in shared}, seed, prefill)
    prefill.cells = {n: prefill.cells[n] for n in presses}  # the order asked
    kvpress = import_kvpress()
    for name, press in presses.items():
        if isinstance(press, kvpress.KeyRerotationPress):
            prefill.shift[name] = prefill.length - prefill.cells[name][0][0].shape[2]
    return prefill


@contextlib.contextmanager
def masks_on(model, masks):
    """A cache's head-wise masks (``take_masks``) on the attention modules, batch row 0,
    for kvpress's own continuation (``plain_continue``, ``plain_greedy``); cleared after."""
    import torch

    modules = [layer.self_attn for layer in language_model(model).layers]
    for module, found in zip(modules, masks or [None] * len(modules)):
        module.masked_key_indices = None if found is None else (torch.zeros_like(found[0]), found[0], found[1])
    try:
        yield
    finally:
        for module in modules:
            module.masked_key_indices = None


def same_masks(a, b) -> bool:
    """Whether two cells' head-wise masks name the same (head, position) pairs in every layer."""
    if a is None or b is None:
        return a is None and b is None
    as_set = lambda found: None if found is None else set(zip(found[0].tolist(), found[1].tolist()))
    return all(as_set(x) == as_set(y) for x, y in zip(a, b))


BATCH_BYTES = 2.5e9  # the cells' caches continued at once are padded to the longest: at most this many bytes


def _batches(kv: list, by_length: bool) -> list[list[int]]:
    """Row groups continued together: every row at once while their padded caches fit
    ``BATCH_BYTES`` (issue #32's 25 cells at 2k are one batch, as they always were);
    ``by_length``: one group per kept length (the lm task, bounding its logits)."""
    if by_length:
        groups: dict[int, list[int]] = {}
        for b, layers in enumerate(kv):
            groups.setdefault(layers[0][0].shape[2], []).append(b)
        return list(groups.values())
    longest = max(sum(k.numel() + v.numel() for k, v in layers) * 4 for layers in kv)
    per = max(1, int(BATCH_BYTES // max(longest, 1)))
    return [list(range(i, min(i + per, len(kv)))) for i in range(0, len(kv), per)]


def _cell_row(name: str, layers: list, masks) -> dict:
    press, ratio = (FULL, 0.0) if name == FULL else (name.rsplit("@", 1)[0], float(name.rsplit("@", 1)[1]))
    return {"press": press, "ratio": ratio, "kept": kept_of(layers, masks)}


def score_cells(model, tokenizer, example, plan, prefill: Prefill, *, stops, max_new_tokens=MAX_NEW_TOKENS, greedy: bool = True) -> dict:
    """``run_setting``'s second half: continue every cell of ``prefill`` (the full cache
    and each compressed one) with ``plan.rest`` and ``plan.answer`` in batches
    (``_batches``), and score it (teacher forced only, ``gen_correct`` None, without
    ``greedy``). ``prefill.cells`` may come from any selection of the full keys/values
    (``eval.quality.token_sets`` builds its own); a cell's name is ``PRESS@RATIO``."""
    import torch
    from jaxkv import tasks

    from jaxkv.tasks.haystack import reply_budget

    lm_task = example.task == "lm"
    names = [FULL, *prefill.cells]
    kv = [prefill.full, *prefill.cells.values()]
    masks = [None, *(prefill.masks.get(n) for n in prefill.cells)]
    shift = [0, *(prefill.shift.get(n, 0) for n in prefill.cells)]
    rows_of = [_cell_row(n, layers, m) for n, layers, m in zip(names, kv, masks)]
    del prefill.full, prefill.cells
    logits_of, generated_of = {}, {}
    for batch in _batches(kv, by_length=lm_task):
        cont = continue_rows(
            model,
            [kv[b] for b in batch],
            prefill.length,
            plan.rest,
            plan.answer,
            prefill.last_logits,
            stops=stops,
            greedy=greedy and not lm_task,
            max_new_tokens=reply_budget(plan, max_new_tokens),
            consume=True,
            skip_agreeing=True,
            masks=[masks[b] for b in batch],
            shift=[shift[b] for b in batch],
        )
        for i, b in enumerate(batch):
            logits_of[b] = cont.answer_logits[i]
            generated_of[b] = cont.generated[i] if cont.generated is not None else None
    digit_pos = None if lm_task else np.asarray(tasks.answer_digit_positions(example, tokenizer, plan.answer))
    answer = torch.as_tensor(np.asarray(plan.answer), dtype=torch.long)
    cells, full_logp = {}, None
    for b, name in enumerate(names):  # the full cache first (the lm task's KL reference)
        row = rows_of[b]
        if lm_task:
            logp = torch.log_softmax(logits_of[b].float(), dim=-1)
            if name == FULL:
                full_logp = logp
            row["nll"] = float(-logp.gather(-1, answer[:, None]).mean())
            row["kl"] = float((full_logp.exp() * (full_logp - logp)).sum(-1).mean())
        else:
            row.update(score_qa(example, tokenizer, plan, logits_of[b], generated_of[b], digit_pos))
        cells[name] = row
    return {
        "n_compressed": int(plan.compressed.size),
        "n_rest": int(plan.rest.size),
        "n_answer": int(plan.answer.size),
        "n_digits": None if lm_task else int(digit_pos.size),
        "cells": cells,
    }


def score_question_cells(model, tokenizer, example, plans, prefill: Prefill, *, stops, max_new_tokens=MAX_NEW_TOKENS) -> dict:
    """``score_cells`` for a multiq example: every question of every cell from its one
    compressed cache (``continue_questions``), each scored as a one-question answer and
    the cell recorded as jaxkv's side records it (``multiq.cell_record``)."""
    from jaxkv import tasks
    from jaxkv.tasks import multiq

    names = [FULL, *prefill.cells]
    kv = [prefill.full, *prefill.cells.values()]
    masks = [None, *(prefill.masks.get(n) for n in prefill.cells)]
    shift = [0, *(prefill.shift.get(n, 0) for n in prefill.cells)]
    rows_of = [_cell_row(n, layers, m) for n, layers, m in zip(names, kv, masks)]
    del prefill.full, prefill.cells
    views = example.views()
    digits = [np.asarray(tasks.answer_digit_positions(v, tokenizer, p.answer)) for v, p in zip(views, plans)]
    cells = {}
    for batch in _batches(kv, by_length=False):
        per_row = continue_questions(
            model,
            [kv[b] for b in batch],
            prefill.length,
            plans,
            prefill.last_logits,
            stops=stops,
            max_new_tokens=max_new_tokens,
            consume=True,
            masks=[masks[b] for b in batch],
            shift=[shift[b] for b in batch],
        )
        for b, answers in zip(batch, per_row):
            scored = [score_qa(v, tokenizer, p, logits, gen, d) for v, p, d, (logits, gen) in zip(views, plans, digits, answers)]
            cells[names[b]] = {**rows_of[b], **multiq.cell_record(scored, example.labels["kinds"])}
    last = plans[-1]
    return {
        "n_compressed": int(last.compressed.size),
        "n_rest": int(last.rest.size),
        "n_answer": [int(p.answer.size) for p in plans],
        "n_questions": len(plans),
        "cells": {n: cells[n] for n in names},
    }


# --------------------------------------------------------------------------- verification
def verify(
    model,
    tokenizer,
    example,
    setting: str,
    press_names: Sequence[str],
    ratios: Sequence[float],
    *,
    atol: float = 1e-4,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> dict:
    """The shared path (``cells_prefill``, every cell continued in one padded batch, as
    ``run_setting`` runs) against kvpress's own path, press by press (``with
    press(model)``, then the cache it leaves continued alone, its head-wise masks on,
    ``plain_continue`` and ``plain_greedy``): the compressed caches (max abs
    difference, exact equality), the masked keys (the same set), the answer logits
    (max abs difference, same argmax) and the greedy tokens. A multiq example: its
    first question."""
    import torch
    from jaxkv.tasks import real

    plan = real.plans(example, tokenizer, setting)[0]
    presses = {cell_name(p, r): make_press(p, r) for p in press_names for r in ratios}
    attn = prefill_attention(presses.values())
    prefill = cells_prefill(model, plan.compressed, presses, example.seed)
    stops = stop_ids(tokenizer, model)
    names = [FULL, *prefill.cells]
    masks = {n: prefill.masks.get(n) for n in prefill.cells}
    shared = continue_rows(
        model,
        [prefill.full, *prefill.cells.values()],
        prefill.length,
        plan.rest,
        plan.answer,
        prefill.last_logits,
        stops=stops,
        max_new_tokens=max_new_tokens,
        masks=[None, *masks.values()],
        shift=[0, *(prefill.shift.get(n, 0) for n in prefill.cells)],
    )
    report = {
        "setting": setting,
        "task": example.task,
        "seed": example.seed,
        "atol": atol,
        "prefill_attention": attn or model.config._attn_implementation,
        "cells": {},
    }
    ok = True
    for name in presses:
        b = names.index(name)
        spec, ratio = name.rsplit("@", 1)
        own = make_press(spec, float(ratio))
        own_last, own_cache = own_path_prefill(model, plan.compressed, own, example.seed, None if masks_keys(own) else attn)
        own_masks = take_masks(model)
        kv_diff, kv_equal = 0.0, True
        for layer, (k, v) in enumerate(prefill.cells[name]):
            own_layer = own_cache.layers[layer]
            if own_layer.keys.shape != k.shape:
                kv_equal, kv_diff = False, math.inf
                break
            kv_equal &= bool(torch.equal(own_layer.keys, k) and torch.equal(own_layer.values, v))
            kv_diff = max(kv_diff, float((own_layer.keys - k).abs().max()), float((own_layer.values - v).abs().max()))
        masks_equal = same_masks(own_masks, masks[name])
        lengths = [layer.keys.shape[2] for layer in own_cache.layers]  # PyramidKV: a count per layer
        start = len(plan.compressed) - prefill.shift.get(name, 0)  # kvpress: a re-rotated cache continues at its length
        feed = plain_continue if len(set(lengths)) == 1 else stepwise_continue
        with masks_on(model, own_masks):
            own_logits = feed(model, own_cache, start, plan.rest, plan.answer, own_last)
            for layer, n in zip(own_cache.layers, lengths):
                layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
            own_gen = plain_greedy(model, own_cache, start, plan.rest, own_last, stops, max_new_tokens, stepwise=feed is stepwise_continue)
        diff = float((own_logits - shared.answer_logits[b]).abs().max())
        same_argmax = bool(torch.equal(own_logits.argmax(-1), shared.answer_logits[b].argmax(-1)))
        same_greedy = own_gen == shared.generated[b]
        cell_ok = kv_diff <= atol and masks_equal and diff <= atol and same_argmax and same_greedy
        ok &= cell_ok
        report["cells"][name] = {
            "cache_equal": kv_equal,
            "cache_max_abs_diff": kv_diff,
            "masks_equal": masks_equal,
            "answer_logits_max_abs_diff": diff,
            "same_argmax": same_argmax,
            "same_greedy": same_greedy,
            "greedy": tokenizer.decode(own_gen),
            "ok": cell_ok,
        }
    report["ok"] = ok
    return report


def eager_sdpa_check(model, plan) -> dict:
    """Full-cache logits of ``compressed + rest + answer`` under eager and sdpa attention."""
    import torch

    ids = torch.as_tensor(np.concatenate([plan.compressed, plan.rest, plan.answer]), dtype=torch.long)[None]
    keep = plan.rest.size + plan.answer.size + 1  # from the request's last token on
    logits = {}
    with torch.no_grad():
        for attn in ("eager", "sdpa"):
            with attention(model, attn):
                logits[attn] = model(input_ids=ids, logits_to_keep=keep).logits[0]
    return {
        "tokens": int(ids.shape[1]),
        "compared": keep,
        "max_abs_diff": float((logits["eager"] - logits["sdpa"]).abs().max()),
        "argmax_agree_tail": bool(torch.equal(logits["eager"].argmax(-1), logits["sdpa"].argmax(-1))),
    }


# --------------------------------------------------------------------------- examples and the run
def eval_examples(task: str, n: int, length: int, tokenizer, seed: int | None = None) -> list:
    """The evaluation examples both sides run: ``jaxkv.tasks.real.examples`` (seed
    default the task module's ``EVAL_SEED``)."""
    from jaxkv.tasks import real

    return real.examples(task, n, length=length, tokenizer=tokenizer, seed=seed)


def done_keys(path: Path) -> set[tuple]:
    """(task, length, seed) of the examples already in ``path``."""
    keys = set()
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                keys.add((rec["example_task"], rec["length"], rec["seed"]))
    return keys


def summary(path: Path) -> str:
    """A plain-text table of ``path`` (``examples.jsonl``): per task (niah: per variant), context, setting and
    cell, the examples, teacher-forced and greedy accuracy (%) and the mean answer NLL
    (lm: the mean NLL, its increase over the full cache and the KL)."""
    rows: dict[tuple, list] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        for setting, res in rec["settings"].items():
            for name, cell in res["cells"].items():
                full = res["cells"][FULL]
                rows.setdefault((rec["example_task"], rec["context"], setting, name), []).append((cell, full))
    out = []
    for (task, context, setting, name), cells in sorted(rows.items(), key=lambda kv: (kv[0][:3], kv[0][3] != FULL, kv[0][3])):
        n = len(cells)
        if "nll" in cells[0][0]:
            nll = np.mean([c["nll"] for c, _ in cells])
            delta = np.mean([c["nll"] - f["nll"] for c, f in cells])
            kl = np.mean([c["kl"] for c, _ in cells])
            out.append(f"{task:15s} {context:5d} {setting:8s} {name:28s} n={n:3d}  nll {nll:.3f}  {delta:+.3f}  kl {kl:.3f}")
        else:
            tf = 100 * np.mean([float(c["tf_correct"]) for c, _ in cells])  # multiq: the share of questions
            gens = [c["gen_correct"] for c, _ in cells if c["gen_correct"] is not None]
            gen = 100 * np.mean(gens) if gens else float("nan")
            nll = np.mean([c["answer_nll"] for c, _ in cells if c["answer_nll"] is not None])
            out.append(f"{task:15s} {context:5d} {setting:8s} {name:28s} n={n:3d}  tf {tf:5.1f}  greedy {gen:5.1f}  nll {nll:.3f}")
    return "\n".join(out)


def _versions() -> dict:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("kvpress", "transformers", "torch")} | {"python": platform.python_version()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.quality.kvpress_side", description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=TASK_CHOICES, default="passkey")
    ap.add_argument("--context", type=int, default=2048, help="target length in tokens")
    ap.add_argument("--n", type=int, default=50, help="examples")
    ap.add_argument("--first", type=int, default=0, help="skip the first examples (split a run)")
    ap.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS), help="kvpress compression ratios (fraction removed)")
    ap.add_argument(
        "--presses",
        default=",".join(PRESSES),
        help="press specs (a wrapper as Wrapper(Scorer)); issue32 (the default: PRESSES), issue75 (PRESSES_75) and all name groups",
    )
    ap.add_argument("--settings", default=None, help="aware,agnostic (lm: agnostic only; its ids do not depend on it)")
    ap.add_argument("--seed", type=int, default=None, help="the evaluation seed base (default: the task module's EVAL_SEED)")
    ap.add_argument("--model", default=MODEL, help="reference model name or a float32 HF folder")
    ap.add_argument("--out", type=Path, default=Path("eval/results/real_smollm2/kvpress"))
    ap.add_argument("--resume", action="store_true", help="skip (task, length, seed) entries already in the journal")
    ap.add_argument(
        "--journal",
        default="examples.jsonl",
        help="the journal in --out; another examples*.jsonl adds presses to the same examples (the report "
        "merges every examples*.jsonl by example)",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument(
        "--verify",
        action="store_true",
        help="check the shared prefill against kvpress's own path on the first example, write OUT/verify.json and exit (1 if it fails)",
    )
    ap.add_argument(
        "--verify-presses",
        default=",".join(VERIFY_PRESSES),
        help="presses --verify checks (plus ObservedAttentionPress when attention is eager)",
    )
    ap.add_argument("--summary", action="store_true", help="print the accuracy table of the journal and exit")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(args.out / args.journal))
        return 0

    import torch

    import jaxkv.tasks.real  # noqa: F401  (tasks.real below)
    from jaxkv import tasks

    torch.set_num_threads(args.threads)
    import_kvpress()
    groups = {"issue32": PRESSES, "issue75": PRESSES_75, "all": KNOWN_PRESSES}
    press_names = list(dict.fromkeys(q for p in split_specs(args.presses) for q in groups.get(p, (p,))))
    ratios = [float(r) for r in args.ratios.split(",") if r]
    for spec in press_names:
        try:
            make_press(spec, 0.0)
        except Exception as error:  # an unknown name, a wrapper that wraps nothing, a press without a ratio
            ap.error(f"press {spec!r} cannot run at a ratio: {error}; known: {', '.join(KNOWN_PRESSES)}")
    settings = ["agnostic"] if args.task == "lm" else (args.settings.split(",") if args.settings else list(SETTINGS))
    verify_names = [p for p in args.verify_presses.split(",") if p]
    eager = bool(EAGER_PRESSES & set(verify_names if args.verify else press_names))
    if args.verify and EAGER_PRESSES & set(press_names):
        verify_names += sorted(EAGER_PRESSES - set(verify_names))
        eager = True
    folder = model_folder(args.model)
    tokenizer = load_tokenizer(folder)
    model = load_hf(folder, "sdpa")
    stops = stop_ids(tokenizer, model)
    args.out.mkdir(parents=True, exist_ok=True)
    examples = eval_examples(args.task, args.first + args.n, args.context, tokenizer, args.seed)[args.first :]
    seed = args.seed if args.seed is not None else (tasks.multiq.EVAL_SEED if args.task == "multiq" else tasks.haystack.EVAL_SEED)

    if args.verify:
        reports = []
        for setting in settings:
            t0 = time.perf_counter()
            rep = verify(model, tokenizer, examples[0], setting, verify_names, ratios)
            rep["seconds"] = round(time.perf_counter() - t0, 1)
            reports.append(rep)
            for name, cell in rep["cells"].items():
                print(
                    f"verify {setting:8s} {name:28s} cache equal {cell['cache_equal']!s:5s} "
                    f"(max |d| {cell['cache_max_abs_diff']:.1e})  answer logits max |d| "
                    f"{cell['answer_logits_max_abs_diff']:.1e}  same argmax {cell['same_argmax']!s:5s} "
                    f"same greedy {cell['same_greedy']!s:5s} {cell['greedy']!r}"
                )
        if eager:
            check = eager_sdpa_check(model, tasks.real.plans(examples[0], tokenizer, settings[-1])[0])
            print(
                f"eager vs sdpa (full cache, {check['tokens']} tokens): max |d logits| {check['max_abs_diff']:.1e}, "
                f"argmax agrees from the last request token on: {check['argmax_agree_tail']}"
            )
            reports.append({"eager_vs_sdpa": check})
        (args.out / "verify.json").write_text(json.dumps({"versions": _versions(), "reports": reports}, indent=2) + "\n")
        ok = all(r.get("ok", True) for r in reports)
        print("verify:", "OK" if ok else "FAILED", "->", args.out / "verify.json")
        return 0 if ok else 1

    setup = {
        "model": args.model,
        "folder": str(folder),
        "dtype": "float32",
        "device": "cpu",
        "attn_implementation": {"prefill": "eager" if eager else "sdpa", "rest_answer_generation": "sdpa"},
        "threads": args.threads,
        "cpus": len(os.sched_getaffinity(0)),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "ratios": ratios,
        "presses": {p: press_defaults(p) for p in press_names},
        "settings": settings,
        "max_new_tokens": args.max_new_tokens,
        "seed_base": seed,
        "protocol": "one shared prefill of plan.compressed per example and setting, each press's compress() per "
        "layer (a press with its own hooks or context manager: its own prefill, kvpress's path); "
        "rest + answer fed on each cell's cache at the original positions (head-wise presses: "
        "their masked keys masked by kvpress's attention patch); multiq: every question from the one cache",
        "versions": _versions(),
    }
    path = args.out / args.journal
    done = done_keys(path) if args.resume else set()
    todo = [ex for ex in examples if (ex.task, ex.length, ex.seed) not in done]
    print(
        f"kvpress side: {args.task} @ {args.context}: {len(todo)} to run ({len(examples) - len(todo)} done), "
        f"{len(press_names)} presses x {len(ratios)} ratios x {len(settings)} settings, prefill attention {'eager' if eager else 'sdpa'}, "
        f"{args.threads} threads -> {path}",
        flush=True,
    )
    if eager and todo:
        setup["eager_vs_sdpa"] = eager_sdpa_check(model, tasks.real.plans(todo[0], tokenizer, settings[-1])[0])

    def run(ex, setting):
        presses = {cell_name(p, r): make_press(p, r) for p in press_names for r in ratios}
        return run_setting(model, tokenizer, ex, setting, presses, stops=stops, max_new_tokens=args.max_new_tokens)

    journal_examples(todo, settings, run, path, setup, task=args.task, context=args.context, desc="kvpress")
    return 0


def journal_examples(todo, settings, run, path: Path, setup: dict, *, task: str, context: int, desc: str) -> None:
    """Run ``run(example, setting)`` for every example of ``todo`` and setting, appending
    one line per example to ``path`` (the journal format ``done_keys`` and ``summary``
    read: ``settings``, per-setting and total ``seconds``, ``setup``)."""
    from tqdm import tqdm

    bar = tqdm(todo, desc=f"{desc} {task} {context}", unit="ex")
    for ex in bar:
        t0 = time.perf_counter()
        rec = {
            "task": task,
            "example_task": ex.task,
            "context": context,
            "length": ex.length,
            "seed": ex.seed,
            "settings": {},
            "seconds": {},
            "load": round(os.getloadavg()[0], 2),
        }
        for setting in settings:
            ts = time.perf_counter()
            rec["settings"][setting] = run(ex, setting)
            rec["seconds"][setting] = round(time.perf_counter() - ts, 2)
        rec["seconds"]["total"] = round(time.perf_counter() - t0, 2)
        rec["setup"] = setup
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        bar.write(
            f"{ex.task} seed {ex.seed}: {rec['seconds']['total']:.1f}s "
            f"({', '.join(f'{k} {v:.1f}s' for k, v in rec['seconds'].items() if k != 'total')})"
        )


if __name__ == "__main__":
    sys.exit(main())
