"""Stages: KV-cache mechanisms that plug into the turn pipeline.

``base.py`` documents the interface and holds the registry (``STAGES``,
``register``, ``build_stages``). Each mechanism is one module that registers
itself when imported: ``retention`` (compression events, order 20),
``repair`` (RepairKV, order 30) and ``quantization`` (KV precision, TriAxialKV,
order 40); ``reuse`` (cross-query segment reuse and CacheBlend, order 10: it
takes the prompt prefill over).
"""

from jaxkv.serving.stages.base import STAGES, Capture, Stage, build_stages, register
from jaxkv.serving.stages import quantization, repair, retention, reuse  # noqa: E402,F401  (registers them)

__all__ = ["STAGES", "Capture", "Stage", "build_stages", "register"]
