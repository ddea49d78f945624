"""Retention policies (scorers, selection, layouts) as pure functions.

Each method is one module and one ``REGISTRY`` entry (ALGORITHMS.md §1-5); see
``base.py`` for the interface and ``select``. The engine computes the features a
policy's ``Needs`` ask for and applies the kept set with a layout.
"""

from jaxkv.policies.base import (
    REGISTRY,
    EventFeatures,
    Needs,
    Observation,
    Policy,
    attention_probs,
    get_policy,
    register,
    select,
)

__all__ = [
    "REGISTRY",
    "EventFeatures",
    "Needs",
    "Observation",
    "Policy",
    "attention_probs",
    "get_policy",
    "register",
    "select",
]

# Importing a method's module registers it in REGISTRY.
from jaxkv.policies import agentkv, controls, h2o, intentkv, intentkv_residual, snapkv, streaming, tova  # noqa: E402,F401
