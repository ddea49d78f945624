"""XLA compiles: a process-wide count, and JAX's persistent compilation cache.

* ``count()``: how many XLA programs this process has compiled (or loaded from the
  persistent cache) so far, read from JAX's own monitoring event for backend
  compiles (``jax.monitoring``; the listener is installed once, on import).
  ``cache_hits()``: how many of them came from the persistent cache. A server
  reports both on ``/metrics``; after warm-up a request should add none.
* ``enable_persistent_cache(path=None)``: turn on JAX's persistent compilation
  cache (``jax_compilation_cache_dir``) in the user cache folder, so a restarted
  server loads its programs instead of compiling them: ``$JAXKV_XLA_CACHE`` if
  set, else ``xla/`` in the user cache folder (``jaxkv.models.registry.user_cache_dir``:
  ``$JAXKV_CACHE``, ``$XDG_CACHE_HOME/jaxkv`` or ``~/.cache/jaxkv``);
  ``JAXKV_XLA_CACHE=off`` disables it. Every program is cached, however quick its
  compile (``jax_persistent_cache_min_compile_time_secs = 0``): a serving process
  compiles hundreds of small programs whose sum is what start-up pays. JAX
  decides at its first compile whether a cache is used, so the call resets that
  decision (``compilation_cache.reset_cache``); a process that already chose a
  cache folder keeps it.

* ``release_if_crowded()``: on Linux every compiled XLA:CPU program keeps its own
  memory mappings, one code, read-only and data section per kernel (about 100-400
  per program; no XLA flag merges them), and a process that passes the kernel's
  limit (``vm.max_map_count``, 65,530 by default) aborts inside its next compile
  ("LLVM ERROR: Unable to allocate section memory"). A server's whole shape set
  could be more programs than that limit holds (before steps took a token budget,
  ``jaxkv serve``'s default compiled 519 programs, ~60k mappings at 220 of them;
  today's default warm-up compiles a few tens). So the warm-up and the scheduler call this after
  any step that compiled: past ``CROWDED_FRACTION`` of the limit it drops every
  compiled program from memory (``jax.clear_caches``); the next call of each
  retraces and loads it from the persistent cache (counted by ``count()`` and
  ``cache_hits()``) instead of compiling it. ``releases()`` counts the drops.
  Where the count cannot be read (no procfs) nothing is released; where no
  persistent cache is on (``JAXKV_XLA_CACHE=off``, or a server that never ran
  ``warmup``) a dropped program compiles again when next needed.

The cache folder is trusted code (JAX's warning): keep it private to the user.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax

ENV_CACHE = "JAXKV_XLA_CACHE"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

CROWDED_FRACTION = 0.6  # of vm.max_map_count: release compiled programs past this
DEFAULT_MAP_LIMIT = 65_530  # Linux's default vm.max_map_count, when the setting cannot be read
# Read the mappings once per this many compiles: a read costs ~10-20 ms at 20k
# mappings, and 16 programs (at most ~400 mappings each) stay far inside the 40%
# of the limit left above CROWDED_FRACTION.
CHECK_EVERY = 16

_lock = threading.Lock()
_counts = {"compiles": 0, "cache_hits": 0, "releases": 0}
_checked_at = [-CHECK_EVERY]  # count() when release_if_crowded last read the mappings


def _on_duration(event: str, duration: float, **_) -> None:
    if event == _BACKEND_COMPILE:
        with _lock:
            _counts["compiles"] += 1


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counts["cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def count() -> int:
    """XLA programs compiled (or loaded from the persistent cache) by this process."""
    return _counts["compiles"]


def cache_hits() -> int:
    """Programs the persistent compilation cache supplied."""
    return _counts["cache_hits"]


def releases() -> int:
    """How many times ``release_if_crowded`` dropped the compiled programs."""
    return _counts["releases"]


def mappings() -> int | None:
    """Memory mappings this process holds (``/proc/self/maps``), None without procfs."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int:
    """The kernel's per-process mapping limit (``vm.max_map_count``)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return DEFAULT_MAP_LIMIT


def release_if_crowded(fraction: float = CROWDED_FRACTION, *, limit: int | None = None) -> bool:
    """Drop every compiled program from memory if the process holds more than
    ``fraction`` of ``limit`` (default ``map_limit()``) mappings (module
    docstring). Reads the mappings only once ``CHECK_EVERY`` programs were
    compiled or loaded since it last did, so calling it after every engine step
    costs nothing in steady state. Returns whether it released."""
    seen = count()
    if seen - _checked_at[0] < CHECK_EVERY:
        return False
    _checked_at[0] = seen
    held = mappings()
    if held is None or held <= fraction * (limit if limit is not None else map_limit()):
        return False
    import gc

    gc.collect()
    jax.clear_caches()
    with _lock:
        _counts["releases"] += 1
    return True


def default_cache_dir() -> Path | None:
    """The persistent cache folder (module docstring), or None when disabled."""
    from jaxkv.models.registry import user_cache_dir

    env = os.environ.get(ENV_CACHE)
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "none") else Path(env).expanduser()
    return user_cache_dir() / "xla"


def enable_persistent_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at ``path`` (default
    ``default_cache_dir()``); returns the folder in use (the process's own if it
    already chose one), or None when disabled."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    folder = Path(path).expanduser() if path is not None else default_cache_dir()
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # re-read the settings at the next compile
    return folder
