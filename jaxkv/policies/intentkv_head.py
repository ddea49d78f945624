"""IntentKV Phase 2: the learned residual head (ALGORITHMS.md §4, papers/intentkv.txt §3.3).

The head corrects the Phase-1 rule score ``s_i`` of every candidate ``i``:

    z_i = s_i + α·r_i,        r_i = MLP([f_i ; c_i])
    f_i = [k̄_i ; m̄ ; k̄_i ⊙ m̄]                     (3D)
    c_i = MHA(query = W_q f_i, keys/values = W_k K̄_Q, W_v K̄_Q)   (A = d_a)

* ``k̄_i``: the post-RoPE key of position ``i`` averaged over layers and
  GQA-expanded heads (``mean_keys``; every KV head is repeated G times, so this is
  the mean over KV heads), ``m̄`` the same mean of the scoring memory ``m [L, Hq,
  D]`` (``mean_query``). Both are ``[D]`` whatever the depth, head count or group,
  so one head runs on any model with the same head dim ``D``.
* ``K̄_Q``: ``k̄`` at the live positions of the current actionable query span,
  at most ``span_keys`` of them (the last ones: ``span_keys_of``). An empty span
  gives ``c_i = 0`` (the masked softmax never sees an all ``-inf`` row: its
  readout is multiplied by "any key valid").
* ``MLP``: ``Linear(3D + A, hidden) -> GELU -> Linear(hidden, 1)``; the output layer
  is zero-initialised (weight and bias) and ``α`` starts at 1.0, so at init
  ``z == s`` exactly while the gradient reaches ``α`` (through nothing: ``r = 0``)
  and the output layer (through ``α``), hence the MLP after one step.
* ``α`` is learned unclipped and clipped to ``[0, alpha_max]`` at inference
  (``combine(..., clip=True)``).

Defaults (``HeadConfig``): ``n_h = 4`` cross-attention heads over a total width
``d_a = 64`` (16 per head, the Flax ``qkv_features`` convention), hidden 256,
``alpha_max = 2``, ``span_keys = 512``. Everything is float32.

The module is split once (``nnx.split``); ``residual_scores(graphdef, params, ...)``
is a pure function of the parameters and the features, vectorised over the N
candidates (``jax.vmap`` it over rows for training). Shape letters: N live
positions / candidates, D head dim, F = 3D token features, Q span-key capacity,
A cross-attention width, X cross-attention heads, Hd hidden width.

Files (``save_head`` / ``load_head``): ``head.safetensors`` (float32 parameters,
named by their path in the module, e.g. ``fc1.kernel``) and ``head.json`` (the
``HeadConfig``, ``head_dim`` included, plus free-form ``base_model`` and
``training`` records). ``base_model`` holds the model's ``signature``
(``model_signature``: layer, head and width counts, vocabulary), written by the
trainer from its data. A head runs only on the model it was trained for: a
session with another ``head_dim`` or another signature raises
``jaxkv.ConfigError`` (``check_head_model``); a head whose ``base_model`` records
no signature is checked by ``head_dim`` alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.errors import CheckpointError, CheckpointNotFoundError, ConfigError

HEAD_FORMAT = "jaxkv-intentkv-head"
HEAD_VERSION = 1
WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "head.json"
# A model's trained head lives in its folder under this name (``train.intentkv_head
# --export``); the embedded model's ships there.
HEAD_FOLDER = "intentkv-head"
DEFAULT_HEAD_DIR = Path(__file__).resolve().parents[1] / "assets" / "embedded-agent" / HEAD_FOLDER


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Shape of a residual head (saved in ``head.json``).

    Attributes:
      head_dim: D, the base model's head dim; the head runs only on such models.
      xattn_heads: n_h, cross-attention heads (default 4).
      xattn_width: d_a, total cross-attention width, split over the heads (64).
      hidden: width of the MLP's hidden layer (256).
      alpha_init: initial α (1.0; never 0, that would freeze the gradient path).
      alpha_max: α is clipped to ``[0, alpha_max]`` at inference (2.0).
      span_keys: capacity of K̄_Q: the last ``span_keys`` live positions of the
        query span are read (512); bounds the event's cost on long spans.
    """

    head_dim: int
    xattn_heads: int = 4
    xattn_width: int = 64
    hidden: int = 256
    alpha_init: float = 1.0
    alpha_max: float = 2.0
    span_keys: int = 512

    def __post_init__(self):
        if self.head_dim < 1 or self.hidden < 1 or self.span_keys < 1:
            raise ConfigError(f"bad IntentKV head shape: {self}")
        if self.xattn_heads < 1 or self.xattn_width % self.xattn_heads:
            raise ConfigError(f"xattn_width {self.xattn_width} must split evenly over {self.xattn_heads} heads")


class ResidualHead(nnx.Module):
    """The residual ``r_i = MLP([f_i ; c_i])`` and the learned ``α`` (fp32)."""

    def __init__(self, cfg: HeadConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, A = cfg.head_dim, cfg.xattn_width
        lin = functools.partial(nnx.Linear, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
        self.xq = lin(3 * D, A)
        self.xk = lin(D, A)
        self.xv = lin(D, A)
        self.xo = lin(A, A)
        self.fc1 = lin(3 * D + A, cfg.hidden)
        self.fc2 = lin(cfg.hidden, 1, kernel_init=nnx.initializers.zeros, bias_init=nnx.initializers.zeros)
        self.alpha = nnx.Param(jnp.asarray(cfg.alpha_init, jnp.float32))

    def readout(self, f_NF, kq_QD, kq_valid_Q):
        """``c [N, A]``: multi-head attention of the token features over K̄_Q."""
        X = self.cfg.xattn_heads
        N, Q = f_NF.shape[0], kq_QD.shape[0]
        q_NXd = self.xq(f_NF).reshape(N, X, -1)
        k_QXd = self.xk(kq_QD).reshape(Q, X, -1)
        v_QXd = self.xv(kq_QD).reshape(Q, X, -1)
        logits_XNQ = jnp.einsum("nxd,qxd->xnq", q_NXd, k_QXd) / jnp.sqrt(jnp.float32(q_NXd.shape[-1]))
        logits_XNQ = jnp.where(kq_valid_Q[None, None, :], logits_XNQ, -1e30)
        probs_XNQ = jax.nn.softmax(logits_XNQ, axis=-1)
        o_NA = jnp.einsum("xnq,qxd->nxd", probs_XNQ, v_QXd).reshape(N, -1)
        return self.xo(o_NA) * kq_valid_Q.any().astype(jnp.float32)

    def __call__(self, f_NF, kq_QD, kq_valid_Q, *, xattn: bool = True):
        """``r [N]`` for token features ``f [N, 3D]`` and span keys ``K̄_Q [Q, D]``."""
        if xattn:
            c_NA = self.readout(f_NF, kq_QD, kq_valid_Q)
        else:
            c_NA = jnp.zeros((f_NF.shape[0], self.cfg.xattn_width), jnp.float32)
        h = jax.nn.gelu(self.fc1(jnp.concatenate([f_NF, c_NA], axis=-1)))
        return self.fc2(h)[:, 0]


# -- features (shared by the policy and the training script) -------------------------
def mean_keys(keys_LNKD) -> jax.Array:
    """``k̄ [N, D]``: mean over layers and GQA-expanded heads (= over KV heads)."""
    return jnp.asarray(keys_LNKD, jnp.float32).mean(axis=(0, 2))


def mean_query(m_LHD) -> jax.Array:
    """``m̄ [D]``: mean of a per-layer, per-query-head vector over layers and heads."""
    return jnp.asarray(m_LHD, jnp.float32).mean(axis=(0, 1))


def token_features(kbar_ND, mbar_D) -> jax.Array:
    """``f [N, 3D] = [k̄_i ; m̄ ; k̄_i ⊙ m̄]``."""
    m_ND = jnp.broadcast_to(mbar_D, kbar_ND.shape)
    return jnp.concatenate([kbar_ND, m_ND, kbar_ND * m_ND], axis=-1)


def span_keys_of(kbar_ND, span_N, capacity: int):
    """``(K̄_Q [Q, D], valid [Q])``: ``k̄`` at the last ``capacity`` true entries of
    ``span_N`` (in position order), zero-padded. ``span_N=None`` gives no key."""
    Q = capacity
    if span_N is None:
        return jnp.zeros((Q, kbar_ND.shape[-1]), jnp.float32), jnp.zeros((Q,), bool)
    span = jnp.asarray(span_N, bool)
    from_end_N = jnp.cumsum(span[::-1].astype(jnp.int32))[::-1]  # span entries at or after i
    chosen = span & (from_end_N <= Q)
    idx_Q = jnp.nonzero(chosen, size=Q, fill_value=0)[0]
    valid_Q = jnp.arange(Q) < chosen.sum()
    return jnp.where(valid_Q[:, None], kbar_ND[idx_Q], 0.0), valid_Q


def residual_scores(graphdef, params, kbar_ND, mbar_D, span_N, *, xattn: bool = True):
    """``r [N]`` of one event: a pure function of ``params`` and the features.

    ``span_N=None`` skips the readout (``c = 0``, what an all-masked readout gives)
    rather than tracing an attention over constant padding."""
    head = nnx.merge(graphdef, params)
    kq_QD, kq_valid_Q = span_keys_of(kbar_ND, span_N, head.cfg.span_keys)
    return head(token_features(kbar_ND, mbar_D), kq_QD, kq_valid_Q, xattn=xattn and span_N is not None)


def alpha_of(params, alpha_max: float | None = None) -> jax.Array:
    """The learned ``α``; clipped to ``[0, alpha_max]`` when ``alpha_max`` is given."""
    alpha = jnp.asarray(params["alpha"][...], jnp.float32)
    return alpha if alpha_max is None else jnp.clip(alpha, 0.0, alpha_max)


def combine(s_N, r_N, alpha) -> jax.Array:
    """``z = s + α·r`` (float32)."""
    return jnp.asarray(s_N, jnp.float32) + alpha * r_N


# -- building, saving, loading -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Head:
    """A split head: ``graphdef`` (static) and ``params`` (an ``nnx.State`` pytree).

    Attributes:
      cfg: its ``HeadConfig``.
      graphdef: the module's structure (hashable; static under jit).
      params: its float32 parameters.
      meta: the free-form records of ``head.json`` (``base_model``, ``training``).
    """

    cfg: HeadConfig
    graphdef: Any
    params: Any
    meta: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)


def init_head(cfg: HeadConfig, seed: int = 0) -> Head:
    """A freshly initialised head (``z == s`` until trained), split once."""
    graphdef, params = nnx.split(ResidualHead(cfg, rngs=nnx.Rngs(seed)), nnx.Param)
    return Head(cfg, graphdef, params)


def flat_params(params) -> dict[str, np.ndarray]:
    """``{"fc1.kernel": array, ...}``: parameter arrays named by their module path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path if not _is_value_key(k))
        out[name] = np.asarray(leaf, np.float32)
    return out


def _is_value_key(k) -> bool:
    return getattr(k, "name", None) == "value"


def _unflat_params(template, tensors: dict[str, np.ndarray], where: Path):
    names = list(flat_params(template))
    missing = sorted(set(names) - set(tensors))
    extra = sorted(set(tensors) - set(names))
    if missing or extra:
        raise CheckpointError(f"{where} does not match the head's shape: missing {missing}, unexpected {extra}")
    leaves, treedef = jax.tree_util.tree_flatten(template)
    arrays = []
    for name, leaf in zip(names, leaves):
        arr = np.asarray(tensors[name], np.float32)
        if arr.shape != tuple(leaf.shape):
            raise CheckpointError(f"{where}: tensor {name!r} has shape {arr.shape}, expected {tuple(leaf.shape)}")
        arrays.append(jnp.asarray(arr))
    return jax.tree_util.tree_unflatten(treedef, arrays)


def save_head(head: Head, folder, **meta) -> Path:
    """Write ``head.safetensors`` + ``head.json`` into ``folder``; ``meta`` entries
    (e.g. ``base_model``, ``training``) are stored in ``head.json`` beside the config."""
    from jaxkv.tensorfile import write_safetensors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / WEIGHTS_FILE, flat_params(head.params))
    record = {"format": HEAD_FORMAT, "version": HEAD_VERSION, "config": dataclasses.asdict(head.cfg), **{**head.meta, **meta}}
    (folder / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return folder


_TRAIN_ONE = (
    f"Train one for this model with `python -m train.intentkv_data --model M` and "
    f"`python -m train.intentkv_head --export MODEL_FOLDER/{HEAD_FOLDER}` (sessions find it there), "
    f"or pass head=PATH."
)


def load_head(folder=None) -> Head:
    """Read a head saved by ``save_head`` (default: the one shipped for the embedded model).

    Raises ``CheckpointNotFoundError`` when a file is missing, ``CheckpointError``
    when ``head.json`` or the weights are malformed or do not match each other."""
    folder = DEFAULT_HEAD_DIR if folder is None else Path(folder)
    return _load_head_cached(str(folder.resolve()))


@functools.lru_cache(maxsize=8)
def _load_head_cached(folder: str) -> Head:
    from jaxkv.tensorfile import read_safetensors

    path = Path(folder)
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise CheckpointNotFoundError(f"{path} is not an IntentKV head folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        record = json.loads(cfg_path.read_text())
        if record.get("format") != HEAD_FORMAT:
            raise CheckpointError(f"{cfg_path} is not an IntentKV head config (format {record.get('format')!r})")
        cfg = HeadConfig(**record["config"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{cfg_path} is malformed: {err}") from err
    template = init_head(cfg)
    params = _unflat_params(template.params, dict(read_safetensors(path)), path)
    meta = {k: v for k, v in record.items() if k not in ("format", "version", "config")}
    return Head(cfg, template.graphdef, params, meta)


SIGNATURE_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")


def model_signature(model_cfg) -> dict:
    """What identifies the model a head's features came from: its layer, head and
    width counts and vocabulary size (two checkpoints of one architecture share it)."""
    return {name: int(getattr(model_cfg, name)) for name in SIGNATURE_FIELDS}


def check_head_model(head: Head, model_cfg, where="") -> None:
    """``ConfigError`` unless the head was trained for this model: its ``head_dim``
    (``check_head_dim``), then the ``base_model`` signature it records, if any."""
    check_head_dim(head, model_cfg.head_dim, where)
    recorded = head.meta.get("base_model", {}).get("signature")
    if recorded is None:
        return
    mine = model_signature(model_cfg)
    differ = {k: (recorded.get(k), mine[k]) for k in mine if recorded.get(k) != mine[k]}
    if differ:
        base = head.meta.get("base_model", {}).get("name", "another model")
        fields = ", ".join(f"{k} {a} (head) vs {b} (model)" for k, (a, b) in differ.items())
        raise ConfigError(f"IntentKV head{(' ' + where) if where else ''} was trained for {base}, not this model: {fields}. {_TRAIN_ONE}")


def check_head_dim(head: Head, head_dim: int, where="") -> None:
    """``ConfigError`` unless the head was trained for keys of ``head_dim``."""
    if head.cfg.head_dim != head_dim:
        base = head.meta.get("base_model", {}).get("name", "another model")
        raise ConfigError(
            f"IntentKV head{(' ' + where) if where else ''} was trained for head_dim {head.cfg.head_dim} "
            f"({base}); this model has head_dim {head_dim}. {_TRAIN_ONE}"
        )
