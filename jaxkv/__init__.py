"""jaxkv: a JAX/Pallas serving stack for multi-turn LLM agents with a managed KV cache.

Public entry points (stable names):

* ``load_model(path_or_repo_id, dtype="float32" | "bfloat16", mesh=None) -> Model``
  (``mesh``: a ``jax.sharding.Mesh``, see ``jaxkv.models.sharding``)
* ``score_logits(model, token_ids) -> logits [batch, time, vocab]`` (no cache)
* ``generate(model, prompts, max_new_tokens, temperature=0.0, top_k=None,
  top_p=None, seed=0, stop_token_ids=None) -> list[list[int]]``
* ``Server(model, rows=...)`` / ``Session(model, server=None, ...)``: multi-turn
  agent sessions with a managed KV cache (retention policies, RepairKV,
  cross-query segment reuse: ``Session(model, reuse="segment", tenant=...)``),
  served many at once by one scheduler (continuous batching).
* ``policies``: the retention methods (``policies.REGISTRY``).
* ``Engine``: the paged-cache engine the above are built on.

Shape letters used across the code: B batch, T chunk tokens, N live-list length,
P positions, S pool slots, R cache rows, L layers, Hq / Hkv (K) heads, G group,
D head dim, M model width, F MLP width, V vocab.
"""

from jaxkv import policies
from jaxkv.engine import Engine, generate, score_logits
from jaxkv.errors import (
    BackendUnavailableError,
    CapacityError,
    ChatError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    ContextLengthError,
    JaxKVError,
    OptionError,
    OutOfSlotsError,
    QueueFullError,
    RadixError,
    RepairError,
    SchedulerError,
    SessionBusyError,
    SlotError,
    TurnCancelledError,
    UnsupportedModelError,
)
from jaxkv.models.loading import Model, load_model, model_from_config, save_pretrained
from jaxkv.serving import ChatTurn, Server, Session, TurnResult

__all__ = [
    "ChatTurn",
    "Engine",
    "Server",
    "Session",
    "TurnResult",
    "policies",
    "Model",
    "generate",
    "load_model",
    "model_from_config",
    "save_pretrained",
    "score_logits",
    "JaxKVError",
    "ConfigError",
    "UnsupportedModelError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "OutOfSlotsError",
    "SlotError",
    "ContextLengthError",
    "OptionError",
    "ChatError",
    "RadixError",
    "RepairError",
    "SchedulerError",
    "QueueFullError",
    "CapacityError",
    "SessionBusyError",
    "TurnCancelledError",
    "BackendUnavailableError",
]
