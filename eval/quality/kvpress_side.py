"""kvpress on jaxkv's real-model tasks: the peer side of issue #32.

What it is for
--------------
Issue #32 compares jaxkv's KV retention methods with NVIDIA's kvpress on
SmolLM2-135M-Instruct, on the very same examples. This module runs kvpress's
presses (``SnapKVPress``, ``StreamingLLMPress``, ``TOVAPress``,
``ObservedAttentionPress``, ``RandomPress``, ``KnormPress``,
``ExpectedAttentionPress``, ``KeyDiffPress``; each with kvpress's own defaults,
recorded in every output line) at kvpress compression ratios (the fraction of
the KV removed), in transformers, float32, on the CPU, on the examples of
``jaxkv.tasks`` (``passkey``, ``niah``, ``lm``), both settings (``aware``,
``agnostic``). The token ids come from ``jaxkv.tasks.token_plan``, i.e. from
jaxkv's own renderer, so both sides consume identical ids.

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

Compatibility (kvpress 0.5.5 with transformers 5.24 and torch 2.13)
---------------------------------------------------------------------
kvpress 0.5.5 pins ``transformers<5.3``; it is installed with ``--no-deps``
(``eval/quality/requirements-kvpress.txt``). Two shims, both here, nothing patched in
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

Seeds
-----
The examples are ``jaxkv.tasks.haystack.examples(task, n, length=, tokenizer=)``, the one
example source of both sides, drawn from ``haystack.EVAL_SEED = 2**30 + 11,000,000``
(above every training seed, < 2**30, and apart from the repository's other held-out
bases: +3e6 held-out, +7e6 calibration, +9e6 agent evaluation). Example ``i`` has the
seed ``example_seed(EVAL_SEED, i)`` (recorded per line), so a run of 8 is the first 8
of a run of 50, and jaxkv's driver (``eval/quality/real_model.py``) runs the same examples.

Threads: ``--threads`` (torch.set_num_threads, default 2), with
``OMP_WAIT_POLICY=PASSIVE`` unless set: on 2 shared cores, spinning OpenMP
threads made a run 3x slower than one thread.

Run (one JSON line per example in ``OUT/examples.jsonl``, with the run's setup;
``--resume`` skips the (task, length, seed) entries already there; ``--first``
splits a run)::

    python -m eval.quality.kvpress_side --task passkey --context 2048 --n 50 \\
        --out eval/results/real_smollm2/kvpress --resume
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
TASK_CHOICES = ("passkey", "niah", "niah_single", "niah_multikey", "niah_multivalue", "lm")

PRESSES = (
    "SnapKVPress", "StreamingLLMPress", "TOVAPress", "ObservedAttentionPress",
    "RandomPress", "KnormPress", "ExpectedAttentionPress", "KeyDiffPress",
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
    return kvpress


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
    attention module), each hook called through ``kvpress_hook_kwargs``."""
    with press(model):
        for layer in language_model(model).layers:
            hooks = layer.self_attn._forward_hooks
            for hid, fn in list(hooks.items()):
                if getattr(fn, "__self__", None) is press:
                    hooks[hid] = _adapted(fn)
        yield


def make_press(name: str, ratio: float):
    kvpress = import_kvpress()
    return getattr(kvpress, name)(compression_ratio=ratio)


def press_defaults(name: str) -> dict:
    """A press's settings other than the ratio (kvpress's defaults: windows, sinks, ...)."""
    press = make_press(name, 0.0)
    return {f.name: getattr(press, f.name) for f in dataclasses.fields(press) if f.name != "compression_ratio"}


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
    length: int                      # uncompressed length (positions continue from here)
    last_logits: Any                 # (V,) the prefill's last position
    full: list                       # per layer (keys, values), (1, kv_heads, length, head_dim)
    cells: dict                      # cell name -> per layer (keys, values), compressed


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

    def hook(module, args, kwargs, output):
        kw = kvpress_hook_kwargs(module, kwargs)
        if not is_prefilling(kw["cache_position"], kw["hidden_states"].shape[1]):
            return output
        keys, values = extract_keys_and_values(kw["past_key_values"], module.layer_idx)
        outer = torch.get_rng_state()
        try:
            for name, press in presses.items():
                torch.set_rng_state(rng[name])
                kept[name][module.layer_idx] = press.compress(module, kw["hidden_states"], keys, values, output[1], kw)
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
    return Prefill(len(ids), out.logits[0, -1], full, kept)


def own_path_prefill(model, ids, press, seed: int, attn: str | None = None):
    """kvpress's own path for one press: ``torch.manual_seed(seed)``, then ``with
    press(model): model(ids, past_key_values=cache)``. Returns (last logits, cache)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    torch.manual_seed(seed)
    with kvpress_applied(press, model), torch.no_grad(), attention(model, attn):
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], logits_to_keep=1, **{cache_kw(model): cache})
    return out.logits[0, -1], cache


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
    from the uncompressed length)."""

    def __init__(self, model, rows: Sequence[list], extra: int, consume: bool = False):
        import torch
        from transformers import DynamicCache

        grow = _grow_layer_class()
        lengths = [row[0][0].shape[2] for row in rows]
        width = max(lengths)
        self.model, self.kw = model, cache_kw(model)
        self.cache = DynamicCache()
        layers = []
        for layer in range(len(rows[0])):
            k0, v0 = rows[0][layer]
            k = k0.new_zeros(len(rows), k0.shape[1], width + extra, k0.shape[3])
            v = v0.new_zeros(len(rows), v0.shape[1], width + extra, v0.shape[3])
            for r, row in enumerate(rows):
                k[r, :, : lengths[r]] = row[layer][0][0]
                v[r, :, : lengths[r]] = row[layer][1][0]
                if consume:  # the caller's per-layer lists: free each layer once copied
                    row[layer] = None
            layers.append(grow(k, v))
            layers[-1].resize(width)
        self.cache.layers = layers
        self.valid = torch.zeros(len(rows), width + extra, dtype=torch.long)
        for r, n in enumerate(lengths):
            self.valid[r, :n] = 1
        self.padded = min(lengths) < width

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
        return self.model(input_ids=ids, position_ids=torch.arange(start, start + q)[None], attention_mask=mask,
                          logits_to_keep=logits_to_keep, **{self.kw: self.cache}).logits

    def truncate(self, n: int) -> None:
        for layer in self.cache.layers:
            layer.resize(n)

    def select(self, rows) -> None:
        for layer in self.cache.layers:
            layer.select(rows)
        self.valid = self.valid[rows]


@dataclasses.dataclass
class Continuation:
    answer_logits: Any = None      # (B, len(answer), V): the logits predicting each answer token
    generated: list | None = None  # per row, the greedy token ids (up to and including a stop id)


def continue_rows(model, rows: Sequence[list], start: int, rest, answer, prefill_last, *, stops=(),
                  teacher_force=True, greedy=True, max_new_tokens: int = MAX_NEW_TOKENS,
                  consume: bool = False, skip_agreeing: bool = False) -> Continuation:
    """Feed ``rest`` then (teacher-forced) ``answer`` after each row's compressed cache
    (``rows``: per row, per layer (keys, values)) at positions ``start, start + 1, ...``;
    then greedy generation after ``rest``, rows dropping out of the batch as they stop.
    ``prefill_last``: the prefill's last logits, which predict the first answer token
    when ``rest`` is empty. ``consume``: empty ``rows``' per-layer lists while copying
    them into the batch (bounds the memory: the cells' caches are held once).
    ``skip_agreeing`` (with teacher forcing): a row whose every answer token is its
    teacher-forced argmax is not decoded; greedy decoding would emit the answer
    itself (by induction), so its ``generated`` is the answer (no stop id), as
    ``eval.quality.real_model`` does on jaxkv's side."""
    import torch

    batch = Rows(model, rows, extra=len(rest) + len(answer) + max_new_tokens, consume=consume)
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


def plain_continue(model, cache, start: int, rest, answer, prefill_last):
    """kvpress's way, for ``verify``: ``rest + answer[:-1]`` fed in one call on the
    DynamicCache the press left, at positions from ``start``. Returns (len(answer), V) logits."""
    import torch

    ids = np.concatenate([np.asarray(rest), np.asarray(answer)[:-1]])
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None],
                    position_ids=torch.arange(start, start + ids.size)[None], **{cache_kw(model): cache}).logits[0]
    first = out[len(rest) - 1 : len(rest)] if len(rest) else prefill_last[None]
    return torch.cat([first, out[len(rest) :]], dim=0)


def truncate(cache, n: int) -> None:
    """Keep every layer's first ``n`` entries (kvpress's ``_remove_answer_from_cache``)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


def plain_greedy(model, cache, start: int, rest, prefill_last, stops, max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """kvpress's ``generate_answer`` on one cache: ``rest`` at positions from ``start``,
    then one token at a time until a stop id (included) or ``max_new_tokens``."""
    import torch

    kw = cache_kw(model)
    with torch.no_grad():
        pos = start
        if len(rest):
            last = model(input_ids=torch.as_tensor(np.asarray(rest), dtype=torch.long)[None],
                         position_ids=torch.arange(start, start + len(rest))[None], logits_to_keep=1, **{kw: cache}).logits[0, -1]
            pos += len(rest)
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
    """Every cell (full + each press) of one example in one setting, from one shared
    prefill, continued as one batch: ``{"n_compressed", "n_rest", "n_answer", "cells"}``."""
    from jaxkv import tasks

    plan = tasks.token_plan(example, tokenizer, setting)
    prefill = shared_prefill(model, plan.compressed, presses, example.seed, prefill_attention(presses.values()))
    return score_cells(model, tokenizer, example, plan, prefill, stops=stops, max_new_tokens=max_new_tokens)


def score_cells(model, tokenizer, example, plan, prefill: Prefill, *, stops, max_new_tokens=MAX_NEW_TOKENS,
                greedy: bool = True) -> dict:
    """``run_setting``'s second half: continue every cell of ``prefill`` (the full cache
    and each compressed one) with ``plan.rest`` and ``plan.answer`` as one batch, and
    score it (teacher forced only, ``gen_correct`` None, without ``greedy``).
    ``prefill.cells`` may come from any selection of the full keys/values
    (``eval.quality.token_sets`` builds its own); a cell's name is ``PRESS@RATIO``."""
    import torch
    from jaxkv import tasks

    from jaxkv.tasks.haystack import reply_budget

    lm_task = example.task == "lm"
    names = [FULL, *prefill.cells]
    kv = [prefill.full, *prefill.cells.values()]
    kept = [rows[0][0].shape[2] for rows in kv]
    del prefill.full, prefill.cells
    # One batch; the lm task (256 teacher-forced tokens, no generation) one batch per kept
    # length instead, which bounds the logits held at once (rows x 256 x vocabulary).
    batches = [list(range(len(names)))]
    if lm_task:
        by_length: dict[int, list[int]] = {}
        for b, n in enumerate(kept):
            by_length.setdefault(n, []).append(b)
        batches = list(by_length.values())
    logits_of, generated_of = {}, {}
    for batch in batches:
        cont = continue_rows(model, [kv[b] for b in batch], prefill.length, plan.rest, plan.answer, prefill.last_logits,
                             stops=stops, greedy=greedy and not lm_task, max_new_tokens=reply_budget(plan, max_new_tokens), consume=True,
                             skip_agreeing=True)
        for i, b in enumerate(batch):
            logits_of[b] = cont.answer_logits[i]
            generated_of[b] = cont.generated[i] if cont.generated is not None else None
    digit_pos = None if lm_task else np.asarray(tasks.answer_digit_positions(example, tokenizer, plan.answer))
    answer = torch.as_tensor(np.asarray(plan.answer), dtype=torch.long)
    cells, full_logp = {}, None
    for b, name in enumerate(names):  # the full cache first (the lm task's KL reference)
        press, ratio = (FULL, 0.0) if name == FULL else (name.rsplit("@", 1)[0], float(name.rsplit("@", 1)[1]))
        row = {"press": press, "ratio": ratio, "kept": int(kept[b])}
        if lm_task:
            logp = torch.log_softmax(logits_of[b].float(), dim=-1)
            if name == FULL:
                full_logp = logp
            row["nll"] = float(-logp.gather(-1, answer[:, None]).mean())
            row["kl"] = float((full_logp.exp() * (full_logp - logp)).sum(-1).mean())
        else:
            row.update(score_qa(example, tokenizer, plan, logits_of[b], generated_of[b], digit_pos))
        cells[name] = row
    return {"n_compressed": int(plan.compressed.size), "n_rest": int(plan.rest.size), "n_answer": int(plan.answer.size),
            "n_digits": None if lm_task else int(digit_pos.size), "cells": cells}


# --------------------------------------------------------------------------- verification
def verify(model, tokenizer, example, setting: str, press_names: Sequence[str], ratios: Sequence[float], *,
           atol: float = 1e-4, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """The shared path (one prefill, every cell continued in one padded batch, as
    ``run_setting`` runs) against kvpress's own path, press by press (``with
    press(model)``, then the cache it leaves continued alone, ``plain_continue`` and
    ``plain_greedy``): the compressed caches (max abs difference, exact equality), the
    answer logits (max abs difference, same argmax) and the greedy tokens."""
    import torch
    from jaxkv import tasks

    plan = tasks.token_plan(example, tokenizer, setting)
    presses = {cell_name(p, r): make_press(p, r) for p in press_names for r in ratios}
    attn = prefill_attention(presses.values())
    prefill = shared_prefill(model, plan.compressed, presses, example.seed, attn)
    stops = stop_ids(tokenizer, model)
    names = [FULL, *prefill.cells]
    shared = continue_rows(model, [prefill.full, *prefill.cells.values()], prefill.length, plan.rest, plan.answer,
                           prefill.last_logits, stops=stops, max_new_tokens=max_new_tokens)
    report = {"setting": setting, "task": example.task, "seed": example.seed, "atol": atol,
              "prefill_attention": attn or model.config._attn_implementation, "cells": {}}
    ok = True
    for name in presses:
        b = names.index(name)
        press, ratio = name.split("@")
        own_last, own_cache = own_path_prefill(model, plan.compressed, make_press(press, float(ratio)), example.seed, attn)
        kv_diff, kv_equal = 0.0, True
        for layer, (k, v) in enumerate(prefill.cells[name]):
            own_layer = own_cache.layers[layer]
            if own_layer.keys.shape != k.shape:
                kv_equal, kv_diff = False, math.inf
                break
            kv_equal &= bool(torch.equal(own_layer.keys, k) and torch.equal(own_layer.values, v))
            kv_diff = max(kv_diff, float((own_layer.keys - k).abs().max()), float((own_layer.values - v).abs().max()))
        kept = own_cache.get_seq_length()
        own_logits = plain_continue(model, own_cache, len(plan.compressed), plan.rest, plan.answer, own_last)
        truncate(own_cache, kept)
        own_gen = plain_greedy(model, own_cache, len(plan.compressed), plan.rest, own_last, stops, max_new_tokens)
        diff = float((own_logits - shared.answer_logits[b]).abs().max())
        same_argmax = bool(torch.equal(own_logits.argmax(-1), shared.answer_logits[b].argmax(-1)))
        same_greedy = own_gen == shared.generated[b]
        cell_ok = kv_diff <= atol and diff <= atol and same_argmax and same_greedy
        ok &= cell_ok
        report["cells"][name] = {"cache_equal": kv_equal, "cache_max_abs_diff": kv_diff,
                                 "answer_logits_max_abs_diff": diff, "same_argmax": same_argmax,
                                 "same_greedy": same_greedy, "greedy": tokenizer.decode(own_gen), "ok": cell_ok}
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
    return {"tokens": int(ids.shape[1]), "compared": keep,
            "max_abs_diff": float((logits["eager"] - logits["sdpa"]).abs().max()),
            "argmax_agree_tail": bool(torch.equal(logits["eager"].argmax(-1), logits["sdpa"].argmax(-1)))}


# --------------------------------------------------------------------------- examples and the run
def eval_examples(task: str, n: int, length: int, tokenizer, seed: int | None = None) -> list:
    """The evaluation examples both sides run: ``jaxkv.tasks.haystack.examples`` (seed
    default ``haystack.EVAL_SEED``)."""
    from jaxkv.tasks import haystack

    return haystack.examples(task, n, length=length, tokenizer=tokenizer, seed=seed)


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
            tf = 100 * np.mean([bool(c["tf_correct"]) for c, _ in cells])
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
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--settings", default=None, help="aware,agnostic (lm: agnostic only; its ids do not depend on it)")
    ap.add_argument("--seed", type=int, default=None, help="the evaluation seed base (default: jaxkv.tasks.haystack.EVAL_SEED)")
    ap.add_argument("--model", default=MODEL, help="reference model name or a float32 HF folder")
    ap.add_argument("--out", type=Path, default=Path("eval/results/real_smollm2/kvpress"))
    ap.add_argument("--resume", action="store_true", help="skip (task, length, seed) entries already in OUT/examples.jsonl")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--verify", action="store_true",
                    help="check the shared prefill against kvpress's own path on the first example, "
                         "write OUT/verify.json and exit (1 if it fails)")
    ap.add_argument("--verify-presses", default=",".join(VERIFY_PRESSES),
                    help="presses --verify checks (plus ObservedAttentionPress when attention is eager)")
    ap.add_argument("--summary", action="store_true", help="print the accuracy table of OUT/examples.jsonl and exit")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(args.out / "examples.jsonl"))
        return 0

    import torch

    from jaxkv import tasks

    torch.set_num_threads(args.threads)
    import_kvpress()
    press_names = [p for p in args.presses.split(",") if p]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    unknown = set(press_names) - set(PRESSES)
    if unknown:
        ap.error(f"unknown presses {sorted(unknown)}; choose from {PRESSES}")
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
    seed = tasks.haystack.EVAL_SEED if args.seed is None else args.seed
    examples = eval_examples(args.task, args.first + args.n, args.context, tokenizer, seed)[args.first :]

    if args.verify:
        reports = []
        for setting in settings:
            t0 = time.perf_counter()
            rep = verify(model, tokenizer, examples[0], setting, verify_names, ratios)
            rep["seconds"] = round(time.perf_counter() - t0, 1)
            reports.append(rep)
            for name, cell in rep["cells"].items():
                print(f"verify {setting:8s} {name:28s} cache equal {cell['cache_equal']!s:5s} "
                      f"(max |d| {cell['cache_max_abs_diff']:.1e})  answer logits max |d| "
                      f"{cell['answer_logits_max_abs_diff']:.1e}  same argmax {cell['same_argmax']!s:5s} "
                      f"same greedy {cell['same_greedy']!s:5s} {cell['greedy']!r}")
        if eager:
            check = eager_sdpa_check(model, tasks.token_plan(examples[0], tokenizer, settings[-1]))
            print(f"eager vs sdpa (full cache, {check['tokens']} tokens): max |d logits| {check['max_abs_diff']:.1e}, "
                  f"argmax agrees from the last request token on: {check['argmax_agree_tail']}")
            reports.append({"eager_vs_sdpa": check})
        (args.out / "verify.json").write_text(json.dumps({"versions": _versions(), "reports": reports}, indent=2) + "\n")
        ok = all(r.get("ok", True) for r in reports)
        print("verify:", "OK" if ok else "FAILED", "->", args.out / "verify.json")
        return 0 if ok else 1

    setup = {"model": args.model, "folder": str(folder), "dtype": "float32", "device": "cpu",
             "attn_implementation": {"prefill": "eager" if eager else "sdpa", "rest_answer_generation": "sdpa"},
             "threads": args.threads, "cpus": len(os.sched_getaffinity(0)),
             "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "ratios": ratios, "presses": {p: press_defaults(p) for p in press_names},
             "settings": settings, "max_new_tokens": args.max_new_tokens, "seed_base": seed,
             "protocol": "one shared prefill of plan.compressed per example and setting, each press's compress() per "
                         "layer; rest + answer fed on each cell's cache at the original positions",
             "versions": _versions()}
    path = args.out / "examples.jsonl"
    done = done_keys(path) if args.resume else set()
    todo = [ex for ex in examples if (ex.task, ex.length, ex.seed) not in done]
    print(f"kvpress side: {args.task} @ {args.context}: {len(todo)} to run ({len(examples) - len(todo)} done), "
          f"{len(press_names)} presses x {len(ratios)} ratios x {len(settings)} settings, prefill attention {'eager' if eager else 'sdpa'}, "
          f"{args.threads} threads -> {path}", flush=True)
    if eager and todo:
        setup["eager_vs_sdpa"] = eager_sdpa_check(model, tasks.token_plan(todo[0], tokenizer, settings[-1]))
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
        rec = {"task": task, "example_task": ex.task, "context": context, "length": ex.length, "seed": ex.seed,
               "settings": {}, "seconds": {}, "load": round(os.getloadavg()[0], 2)}
        for setting in settings:
            ts = time.perf_counter()
            rec["settings"][setting] = run(ex, setting)
            rec["seconds"][setting] = round(time.perf_counter() - ts, 2)
        rec["seconds"]["total"] = round(time.perf_counter() - t0, 2)
        rec["setup"] = setup
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        bar.write(f"{ex.task} seed {ex.seed}: {rec['seconds']['total']:.1f}s "
                  f"({', '.join(f'{k} {v:.1f}s' for k, v in rec['seconds'].items() if k != 'total')})")

if __name__ == "__main__":
    sys.exit(main())
