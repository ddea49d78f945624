"""Sampling: greedy, temperature / top-k / top-p from an explicit key, stop tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.sampling import SamplingError, make_sampler, sample


def test_top_k_and_top_p_restrict_support():
    logits = jnp.asarray([[5.0, 4.0, 3.0, -1.0, -2.0]] * 4000)
    keys = jax.random.split(jax.random.key(0), 1)[0]
    spec, t, p = make_sampler(1.0, top_k=2)
    got = np.asarray(sample(logits, keys, spec, t, p))
    assert set(got.tolist()) == {0, 1}
    spec, t, p = make_sampler(1.0, top_p=0.5)  # token 0 alone holds ~0.66 of the mass
    assert set(np.asarray(sample(logits, keys, spec, t, p)).tolist()) == {0}
    spec, t, p = make_sampler(1.0)
    assert len(set(np.asarray(sample(logits, keys, spec, t, p)).tolist())) == 5


def test_bad_sampling_parameters():
    for kwargs in ({"temperature": -1}, {"temperature": 1, "top_k": 0}, {"temperature": 1, "top_p": 1.5}):
        with pytest.raises(SamplingError):
            make_sampler(**kwargs)


def test_generate_seeded_sampling_and_stop(hf_checkpoint):
    model = jaxkv.load_model(hf_checkpoint("qwen2")[0])
    prompts = [[5, 6, 7, 8], [9, 10]]
    a = jaxkv.generate(model, prompts, 12, temperature=1.0, top_k=50, seed=3)
    b = jaxkv.generate(model, prompts, 12, temperature=1.0, top_k=50, seed=3)
    c = jaxkv.generate(model, prompts, 12, temperature=1.0, top_k=50, seed=4)
    assert a == b and a != c
    greedy = jaxkv.generate(model, prompts, 12)
    stop = greedy[0][4]
    stopped = jaxkv.generate(model, prompts, 12, stop_token_ids=[stop])
    first = greedy[0].index(stop)
    assert stopped[0] == greedy[0][: first + 1]
    # The other row keeps going unless it meets the same token.
    if stop not in greedy[1]:
        assert stopped[1] == greedy[1]


def test_generate_bad_input(hf_checkpoint):
    model = jaxkv.load_model(hf_checkpoint("qwen2")[0])
    with pytest.raises(ValueError):
        jaxkv.generate(model, [], 4)
    with pytest.raises(ValueError):
        jaxkv.generate(model, [[]], 4)
    with pytest.raises(ValueError, match="out of range"):
        jaxkv.generate(model, [[1, 5000]], 4)
    with pytest.raises(ValueError):
        jaxkv.score_logits(model, [1, 2, 3])
    assert jaxkv.generate(model, [[1, 2]], 0) == [[]]
