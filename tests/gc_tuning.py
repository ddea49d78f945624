"""Python's cyclic garbage collector, tuned for a process that traces and lowers
thousands of programs (the pytest workers, ``tests/conftest.py``; the 8-device
subprocess, ``tests/multidevice.py``). Not a test module (pytest never collects it).

Once every module is loaded (jax, torch, transformers, the tests), those objects
live until the process ends, yet every full collection walked them all again:
gen-2 passes were 4.0 of 5.0 s of collector time in 126 s of tests/test_engine.py,
test_isolation.py and test_layer_sets.py (2026-12-08). ``gc.freeze`` moves them out
of the collector's sight; a larger first threshold makes young collections rarer.
Cyclic garbage is still collected, only less often.
"""

from __future__ import annotations

import gc

THRESHOLDS = (50_000, 20, 20)  # Python's defaults: (700, 10, 10)


def freeze_loaded() -> None:
    """Collect once, freeze what is alive, and set ``THRESHOLDS``."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)


def thaw() -> None:
    """Hand the frozen objects back, so the process ends as it would have (frozen
    objects are never finalized: nanobind reports them as leaks at exit)."""
    gc.unfreeze()
