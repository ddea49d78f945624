"""Shared fixtures: tiny random HF checkpoints saved once per test session."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

import hf_models  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``hf_checkpoint(family, **overrides) -> (folder, torch_model)``, cached."""
    cache = {}

    def make(family, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"hf_{family}")
            cache[key] = (folder, hf_models.build(family, folder, **overrides))
        return cache[key]

    return make
