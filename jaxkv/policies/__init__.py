"""Retention policies (scorers, selection, layouts) as pure functions.

Each method is one module and one ``REGISTRY`` entry (ALGORITHMS.md §1-5; KeyDiff
and Expected Attention, kvpress's rules, are stated in their modules); see
``base.py`` for the interface and ``select``. The engine computes the features a
policy's ``Needs`` ask for and applies the kept set with a layout.
"""

from jaxkv.policies.base import REGISTRY, EventFeatures, Needs, Observation, Policy, attention_probs, get_policy, register, select

__all__ = ["REGISTRY", "EventFeatures", "Needs", "Observation", "Policy", "attention_probs", "get_policy", "register", "select"]

# Importing a method's module registers it in REGISTRY.
from jaxkv.policies import (  # noqa: E402,F401
    agentkv,
    controls,
    expected_attention,
    h2o,
    intentkv,
    intentkv_residual,
    keydiff,
    kvzip,
    snapkv,
    streaming,
    tova,
)
