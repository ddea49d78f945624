"""The policy interface: features in, one score per live position out.

A retention policy is a set of pure functions over pytrees (ALGORITHMS.md §1):

* ``init_state(cfg, model_cfg) -> state``: per-session policy state (rings,
  QueryMemory, accumulated mass...); lives in the session store.
* ``observe(cfg, state, obs) -> state``: fold in what new tokens showed (their
  post-RoPE query rows and phases, the turn's actionable-query mean, attention
  mass). Called after every prefill and decode chunk. Optional.
* ``keep(cfg, feats) -> forced_N``: the method's own always-keep set (sinks,
  recent window, observation window). Optional (default: nothing).
* ``score(cfg, state, feats, candidates_N) -> (scores_N, state)``: one float32
  score per live position; only entries where ``candidates_N`` is true matter.

``select(scores, forced, candidates, budget)`` (shared by all) keeps
``F ∪ topk_C(scores, max(B − |F|, 0))`` with ties broken by lower position, and
the engine applies the kept set with a layout. Scores aggregate to one number per
position (mean over layers and expanded heads unless a policy says otherwise).

Per-layer keep sets (``keep_sets="layer"``, ALGORITHMS.md §1): layer ``l`` keeps
``F ∪ topk_C(score^l, B_l − |F|)`` over its own live positions, where ``score^l``
is the same ``score`` applied to a one-layer view of the features (every ``L``
axis cut to layer ``l``, the live positions those the layer still reads), so the
mean over layers is never taken. A policy whose state has a layer axis gives
``layer_state(state, l)``, the state of that view; one whose rule has no
per-layer meaning says why in ``one_set_only`` (``ConfigError`` when asked).
``layer_budgets`` splits ``L x B`` over the layers (equal, or PyramidKV's pyramid).

Shape letters: L layers, N live positions at the event, W window rows, X query
rows observed, Hq / Hkv query / KV heads, D head dim.

Invariants: every function is pure and jit-able for fixed shapes; ``score`` never
depends on entries outside ``candidates`` except through softmax normalisation
the method defines; nothing here touches the engine or the pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.attention import group_heads, gqa_scores, masked_softmax
from jaxkv.errors import ConfigError, OptionError


@struct.dataclass
class EventFeatures:
    """What a scorer sees at a compression event of one request.

    Attributes:
      keys_LNKD: post-RoPE keys of the live positions ``[L, N, Hkv, D]`` float32,
        in position order.
      positions_N: their positions, int32 ``[N]``.
      phase_N: their ``jaxkv.chat.Phase`` tags, int32 ``[N]``.
      window_q_LWHD: post-RoPE queries of the observation window ``[L, W, Hq, D]``
        (after prefill: the last W prompt rows; at a decode event: the last W
        decoded rows).
      window_pos_W: positions of those rows (int32 ``[W]``).
      window_valid_W: which window rows are real (bool ``[W]``).
      acc_mass_N: attention mass each position received so far, averaged over
        layers and query heads, summed over every query row seen (H2O).
      query_mean_LHD: mean post-RoPE query over the current turn's actionable query
        span ``[L, Hq, D]`` (IntentKV's q̄_t).
      seq_len: the request's length (next position), int32 scalar.
      valid_N: which of the N entries are real (bool ``[N]``). The engine pads N
        to a bucket so scoring compiles once per bucket; padding entries sit at
        positions past ``seq_len`` (so causal masks exclude them), have zero
        keys and mass, and are neither forced nor candidates. ``None`` = all real.
      query_span_N: which live positions lie inside the current turn's actionable
        query span (bool ``[N]``; false on padding). IntentKV's residual head reads
        its keys (K̄_Q). ``None`` = not computed (the head then sees no span keys).
      pass_scores_LNK: scores of the live positions per layer and KV head
        ``[L, N, Hkv]`` float32 that passes the engine ran over the request just
        before the event computed (``Needs.reconstruction``: KVzip's
        reconstruction passes, ``jaxkv.serving.stages.reconstruction``); 0 on
        padding. ``None`` = no pass ran.
    """

    keys_LNKD: jax.Array
    positions_N: jax.Array
    phase_N: jax.Array
    window_q_LWHD: jax.Array
    window_pos_W: jax.Array
    window_valid_W: jax.Array
    acc_mass_N: jax.Array
    query_mean_LHD: jax.Array
    seq_len: jax.Array
    valid_N: jax.Array | None = None
    query_span_N: jax.Array | None = None
    pass_scores_LNK: jax.Array | None = None

    def valid(self) -> jax.Array:
        """``valid_N``, or all-true when it was not given."""
        if self.valid_N is None:
            return jnp.ones(self.positions_N.shape, bool)
        return jnp.asarray(self.valid_N, bool)


@struct.dataclass
class Observation:
    """New tokens a policy may fold into its state (``observe``).

    Attributes:
      q_LXHD: post-RoPE query rows of observed tokens ``[L, X, Hq, D]``.
      phase_X: their phases (int32 ``[X]``); ``valid_X`` which rows are real.
      query_mean_LHD: the turn's actionable-query mean (valid when ``new_turn``).
      new_turn: true at the first observation of a new turn.
    """

    q_LXHD: jax.Array
    phase_X: jax.Array
    valid_X: jax.Array
    query_mean_LHD: jax.Array
    new_turn: jax.Array


@dataclasses.dataclass(frozen=True)
class Needs:
    """Which features a policy needs; the engine computes only those.

    Attributes:
      window: observation-window rows W (0: none).
      attn_mass: accumulate attention mass over every query (H2O; slower decode).
      query_mean: the actionable-query mean q̄_t.
      query_span: the live positions of the actionable query span
        (``EventFeatures.query_span_N``).
      observe_rows: query rows to feed ``observe`` (AgentKV rings).
      decode_interval: compress every Δ decoded tokens (None: after prefill only).
      reconstruction: before each event the engine runs KVzip's reconstruction
        passes over the request (the policy's config gives ``chunk_size`` and
        ``n_sink``) and hands their scores in ``EventFeatures.pass_scores_LNK``.
    """

    window: int = 0
    attn_mass: bool = False
    query_mean: bool = False
    query_span: bool = False
    observe_rows: bool = False
    decode_interval: int | None = None
    reconstruction: bool = False


@dataclasses.dataclass(frozen=True)
class Policy:
    """A registered retention method (see the module docstring)."""

    name: str
    config: type
    score: Callable[..., tuple[jax.Array, Any]]
    needs: Callable[[Any], Needs]
    init_state: Callable[..., Any] = lambda cfg, model_cfg: ()
    observe: Callable[..., Any] | None = None
    keep: Callable[..., jax.Array] | None = None
    doc: str = ""
    layer_state: Callable[[Any, Any], Any] | None = None  # (state, l) -> the state of a one-layer view (None: no layer axis)
    one_set_only: str = ""  # why the policy cannot keep per-layer sets ("" : it can)

    def make_config(self, **options):
        """The policy's typed config; unknown options raise ``OptionError`` (a ``ConfigError``) naming them."""
        fields = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise OptionError(
                f"policy {self.name!r} has no option(s) {', '.join(unknown)}; its options are {', '.join(sorted(fields)) or '(none)'}"
            )
        return self.config(**options)


def select(scores_N, forced_N, candidates_N, budget):
    """Kept mask ``F ∪ topk_{C}(scores, max(B − |F|, 0))``; ties: lower position first.

    ``forced_N`` and ``candidates_N`` are bool masks over the same live positions
    (in position order); entries in neither are dropped. Pure and jit-able.
    """
    forced = jnp.asarray(forced_N, bool)
    cand = jnp.asarray(candidates_N, bool) & ~forced
    n = scores_N.shape[0]
    k = jnp.maximum(jnp.asarray(budget, jnp.int32) - forced.sum(dtype=jnp.int32), 0)
    s = jnp.where(cand, jnp.asarray(scores_N, jnp.float32), -jnp.inf)
    # Stable sort on -score keeps lower positions first among equal scores.
    order = jnp.argsort(-s, stable=True)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return forced | (cand & (rank < k))


def select_across_layers(scores_LN, forced_LN, candidates_LN, budget):
    """Per-layer kept masks ``[L, N]`` under one budget for all the layers:
    ``F ∪ topk_C(scores, max(B − |F|, 0))`` over every layer's entries at once
    (``select`` on the flattened arrays), so layer ``l`` keeps its forced entries
    and those of its candidates that rank among the model's top. Ties: the lower
    layer, then the lower position. Pure and jit-able. KVzip ranks every layer's
    and KV head's entries under one budget; this is that budget over layers, with
    one set per layer (a slot's list is per row and layer, not per KV head)."""
    L, N = scores_LN.shape
    kept = select(jnp.reshape(scores_LN, (L * N,)), jnp.reshape(forced_LN, (L * N,)), jnp.reshape(candidates_LN, (L * N,)), budget)
    return kept.reshape(L, N)


KEEP_SETS = ("model", "layer")
LAYER_BUDGETS = ("equal", "pyramid", "shared")
PYRAMID_BETA = 20  # PyramidKV's beta: the top layer keeps B / beta (Cai et al., 2024; its code's default)


def layer_budgets(budget: int, num_layers: int, shape: str = "equal", beta: float = PYRAMID_BETA):
    """Per-layer budgets ``B_l`` (int ``[L]``) summing to ``L x budget``.

    ``"equal"``: every layer ``B``. ``"shared"``: every layer ``B`` too, as the
    layers' share of the pool ``L x B`` that an event divides by score across the
    layers (``select_across_layers``), so a layer's own set may end larger or smaller. ``"pyramid"`` (PyramidKV): an arithmetic
    sequence, largest in the lowest layer, from ``2B − B/β`` at layer 0 down to
    ``B/β`` at layer ``L − 1`` (mean ``B``); rounded by largest remainder, at
    least 1 per layer.
    """
    B, L = int(budget), int(num_layers)
    if shape not in LAYER_BUDGETS:
        raise ConfigError(f"unknown layer_budgets {shape!r}; known: {', '.join(LAYER_BUDGETS)}")
    if shape in ("equal", "shared") or L == 1:
        return np.full(L, B, np.int64)
    lo = B / beta
    hi = 2 * B - lo
    exact = hi - np.arange(L) * (hi - lo) / (L - 1)
    out = np.maximum(np.floor(exact + 1e-9).astype(np.int64), 1)  # (1e-9: an exact integer computed as x.99999...)
    rest = L * B - int(out.sum())
    if rest > 0:  # largest remainders first (ties: the lower layer)
        out[np.argsort(-(exact - np.floor(exact + 1e-9)), kind="stable")[:rest]] += 1
    for l in range(L - 1, -1, -1):  # a floor of 1 lifted some: take it back from the top layers that can give
        while rest < 0 and out[l] > 1:
            out[l] -= 1
            rest += 1
    return out


def attention_probs(q_LWHD, keys_LNKD, *, causal_q_pos=None, k_pos_N=None, valid_N=None):
    """Softmax attention of query rows to keys ``[L, Hq, W, N]`` (float32).

    GQA: each KV head serves ``G = Hq / Hkv`` query heads. With ``causal_q_pos``
    a row at position p sees only keys at positions <= p. ``valid_N`` masks keys.
    Built on ``jaxkv.attention.gqa_scores`` / ``masked_softmax``.
    """
    L, W, Hq, D = q_LWHD.shape
    s = gqa_scores(group_heads(q_LWHD, keys_LNKD.shape[2]), keys_LNKD)  # [L, Hkv, G, W, N]
    mask = jnp.ones((W, keys_LNKD.shape[1]), bool)
    if causal_q_pos is not None:
        mask = mask & (k_pos_N[None, :] <= causal_q_pos[:, None])
    if valid_N is not None:
        mask = mask & valid_N[None, :]
    return masked_softmax(s, mask).reshape(L, Hq, W, -1)


REGISTRY: dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
    if policy.name in REGISTRY:
        raise ConfigError(f"policy {policy.name!r} registered twice")
    REGISTRY[policy.name] = policy
    return policy


def get_policy(name: str) -> Policy:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))}") from None
