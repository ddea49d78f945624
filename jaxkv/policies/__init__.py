"""Retention policies (scorers, selection, layouts) as pure functions.

The home of the eviction methods (StreamingLLM, SnapKV, H2O, TOVA, AgentKV,
IntentKV, controls) described in ALGORITHMS.md §1-5; see DESIGN.md "Policies are
functions". The engine already returns the features they need (post-RoPE query
rows, per-key attention mass) through ``jaxkv.models.transformer.Features``.
"""
