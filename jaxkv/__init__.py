"""jaxkv: a JAX/Pallas serving stack for multi-turn LLM agents with a managed KV cache.

Public entry points (stable names):

* ``load_model(path_or_repo_id, dtype="float32" | "bfloat16", mesh=None) -> Model``
  (a folder, a ``.gguf`` file, a HF repo id, ``"embedded"`` or a reference model
  name such as ``"smollm2-135m-instruct"``, fetched once by ``jaxkv fetch``)
  (``mesh``: a ``jax.sharding.Mesh`` with axes ``tp`` / ``dp``, e.g. from
  ``jax.make_mesh``; see ``jaxkv.models.sharding``)
* ``score_logits(model, token_ids) -> logits [batch, time, vocab]`` (no cache)
* ``generate(model, prompts, max_new_tokens, temperature=0.0, top_k=None,
  top_p=None, seed=0, stop_token_ids=None) -> list[list[int]]``
* ``Server(model, rows=...)`` / ``Session(model, server=None, ...)``: multi-turn
  agent sessions with a managed KV cache (retention policies, RepairKV,
  cross-query segment reuse: ``Session(model, reuse="segment", tenant=...)``),
  served many at once by one scheduler (continuous batching).
* ``policies``: the retention methods (``policies.REGISTRY``).
* ``Engine``: the paged-cache engine the above are built on.
* ``tasks``: the synthetic agent tasks (agent traces, MQ-NIAH, shared docs);
  ``server``: the OpenAI-compatible HTTP layer (needs the ``serve`` extra). Both
  are imported on first use, so ``import jaxkv`` stays light.

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
    ModelFetchError,
    ModelNotFetchedError,
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
    UnsupportedTensorTypeError,
)
from jaxkv.models.loading import Model, load_model, model_from_config, save_pretrained
from jaxkv.serving import ChatTurn, Server, Session, TurnResult

_LAZY_SUBMODULES = ("tasks", "server")


def __getattr__(name: str):
    """``jaxkv.tasks`` / ``jaxkv.server`` on first use (the server pulls in FastAPI)."""
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"jaxkv.{name}")
    raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


__all__ = [
    "ChatTurn",
    "Engine",
    "Server",
    "Session",
    "TurnResult",
    "policies",
    "tasks",
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
    "ModelFetchError",
    "ModelNotFetchedError",
    "UnsupportedTensorTypeError",
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
