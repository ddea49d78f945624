"""Compiled programs are bounded and compiled at start-up (jaxkv.buckets, Server(warmup=...)).

After ``Server(..., warmup=...)`` a randomized mix of 30 turns (prompt lengths,
reply lengths, 1-2 concurrent sessions, greedy and sampled replies, the full
cache and retention policies at random budgets; a float pool, then an INT4 pool
with greedy turns and fewer policies; head_dim 32, as quantized pools ask)
compiles no XLA program (``jaxkv.compiles.count``). The policies warmed (and
drawn) cover every kind of program a policy adds: observation-window and
query-span captures (SnapKV, IntentKV), attention mass in prefill and decode
(H2O), ``observe`` and decode captures (AgentKV), and their events at every
live bucket. Sizes are tiny (2 rows, 64 positions, 16-token prefill chunks) so the whole shape set
compiles in seconds; the full set of a default server is a bench figure
(README).
"""

from __future__ import annotations

import random
import threading

import pytest

from jaxkv import buckets, compiles
from jaxkv.engine.warmup import shape_set
from jaxkv.serving import Server
from conftest import TINY_WORDS, tiny_chat_model

WORDS = TINY_WORDS
SAMPLERS = ("greedy", "sample")
POLICIES = ("snapkv", "h2o", "agentkv", "intentkv_query")


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_chat_model(head_dim=32, max_positions=256)


def test_shape_set_is_bounded_by_buckets_not_lengths():
    """The shapes are the token buckets and the decode (rows, window) pairs: tens of
    programs, the same number for 4,096 and 8,192 positions but for one more
    window width, and no more with a longer chunk than its bucket."""
    s = buckets.shape_set(4, 4096, buckets.token_budget(512, 4), 32)
    assert s.steps == (16, 32, 64, 128, 256, 512, 528)
    assert {B for B, _ in s.decode} == {1, 2, 4}
    assert {W for _, W in s.decode} == {512, 1024, 2048, 4096}
    assert s.size == 7 + 3 * 4 <= 40
    assert buckets.shape_set(4, 8192, buckets.token_budget(512, 4), 32).size == s.size + 3
    assert buckets.shape_set(16, 8192, buckets.token_budget(512, 16), 32, windows=False).decode == tuple(
        (B, 0) for B in (1, 2, 4, 8, 12, 16)
    )
    assert buckets.step_tokens(17, 528) == 32 and buckets.step_tokens(513, 528) == 528


# The float pool runs every sampler and policy above; the INT4 pool (whose steps
# are the same programs with another KV format) greedy turns and one policy per
# feature variant, to keep the suite's time.
CASES = [(None, SAMPLERS, POLICIES), ("int4", ("greedy",), ("snapkv", "h2o"))]


@pytest.mark.parametrize("kv_quant,samplers,policies", CASES, ids=["float", "int4"])
def test_no_compile_after_warmup(tiny_model, monkeypatch, kv_quant, samplers, policies):
    monkeypatch.setenv(compiles.ENV_CACHE, "off")  # keep the user's cache folder out of the test
    server = Server(
        tiny_model, rows=2, max_positions=64, prefill_chunk=16, decode_chunk=8, kv_quant=kv_quant, warmup=samplers, warmup_policies=policies
    )
    try:
        assert server.warmup_seconds is not None
        before = compiles.count()
        rng = random.Random(7 if kv_quant else 3)
        errors: list = []
        events: list = []

        def turn(seed):
            r = random.Random(seed)
            try:
                message = " ".join(r.choice(WORDS) for _ in range(r.randint(1, 14)))
                sampling = r.choice([{}, {"temperature": 0.8, "seed": seed}][: len(samplers)])
                policy = r.choice((None,) + policies)
                session = server.session(**({} if policy is None else {"policy": policy, "budget": r.choice((6, 10, 14))}))
                # ignore_eos: no stop tokens, a count the warm-up's turns never have (it must not be a shape)
                session.chat(
                    [{"role": "user", "content": message}], max_new_tokens=r.randint(1, 20), ignore_eos=r.random() < 0.3, **sampling
                )
                events.extend(session.compressions)
            except Exception as err:  # surfaced below
                errors.append(err)

        done = 0
        while done < 15:  # 15 turns per pool, 30 in all
            k = min(rng.randint(1, 2), 15 - done)
            threads = [threading.Thread(target=turn, args=(rng.randrange(1 << 30),)) for _ in range(k)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(timeout=120)
            done += k
        assert not errors, errors
        assert server.scheduler.stats["turns_done"] >= 15
        assert events, "no turn compressed: the policies' event programs were never exercised"
        assert compiles.count() == before, f"{compiles.count() - before} XLA compiles after warm-up"
        assert server.snapshot()["xla_compiles"] == compiles.count()
    finally:
        server.close()


def test_a_shape_set_larger_than_the_mapping_limit_warms_and_serves_without_compiling(tiny_model, monkeypatch, tmp_path):
    """On Linux each compiled XLA:CPU program holds hundreds of memory mappings and a
    process past ``vm.max_map_count`` aborts in its next compile, so a default
    server's whole shape set cannot stay in memory (``jaxkv.compiles``). With the
    limit lowered to a few programs above what the process holds, the warm-up drops
    its compiled programs as it fills, and the turns that follow give the replies of
    a server that never dropped one, loading what they need from the persistent
    cache without compiling anything."""
    if compiles.mappings() is None:
        pytest.skip("no /proc/self/maps on this platform")
    compiles.enable_persistent_cache(tmp_path / "xla")  # the process's own folder if it already has one
    conversations = [[{"role": "user", "content": " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(3 + 4 * i))}] for i in range(4)]
    options = dict(rows=2, max_positions=64, prefill_chunk=16, decode_chunk=8)  # test_no_compile_after_warmup's

    reference = Server(tiny_model, **options)
    try:
        expected = [reference.session().chat(c, max_new_tokens=12) for c in conversations]
    finally:
        reference.close()

    import jax

    jax.clear_caches()  # the warm-up below must bring its programs back (an earlier test may hold them)
    releases = compiles.releases()
    crowded = int((compiles.mappings() + 300) / compiles.CROWDED_FRACTION)  # room for a program or two
    monkeypatch.setattr(compiles, "map_limit", lambda: crowded)
    monkeypatch.setattr(compiles, "CHECK_EVERY", 1)  # the bounded set is a few programs: look after each
    server = Server(tiny_model, **options, warmup=("greedy",), warmup_policies=())  # plain turns: no policy programs
    try:
        assert compiles.releases() > releases, "the warm-up never reached the lowered limit"
        compiled, loaded = compiles.count(), compiles.cache_hits()
        replies = [server.session().chat(c, max_new_tokens=12) for c in conversations]
        assert replies == expected
        print(f"after warm-up: {compiles.count() - compiled} programs loaded, {compiles.releases() - releases} releases")
        assert compiles.count() > compiled, "no program was dropped and reloaded: the limit was never reached in the turns"
        assert compiles.count() - compiled == compiles.cache_hits() - loaded, "a turn compiled a program instead of loading it"
        assert server.snapshot()["xla_releases"] == compiles.releases()
    finally:
        server.close()


def test_a_reconstruction_policys_wide_steps_are_warmed(tiny_model, monkeypatch):
    """KVzip's reconstruction passes return every flat token's query
    (``PrefillJob.wide_capture``). Where a step holds more tokens than the capture
    cap (lowered here to 8, so both tiny buckets have such steps) that is a program
    of its own; the warm-up compiles it when a reconstruction policy is warmed, so
    a pass's step of every bucket compiles nothing afterwards."""
    import numpy as np

    from jaxkv.engine import Engine, runner
    from jaxkv.engine.jobs import PrefillJob
    from jaxkv.serving.stages.retention import policy_warmup

    monkeypatch.setenv(compiles.ENV_CACHE, "off")
    monkeypatch.setattr(runner, "CAPTURE_ROWS", 8)
    _, variants = policy_warmup(["kvzip"])
    assert variants["capture_wide"] and variants["capture_q"]
    # A 16-token chunk: steps of 16 and 32 tokens (the budget's bucket: two rows' pieces).
    # Its own pool size (an Engine's default), so no other test's programs stand in for the warm-up's.
    engine = Engine(tiny_model, rows=2, max_positions=64, prefill_chunk=16)
    shapes = shape_set(engine, 8)
    wide_steps = [T for T in shapes.steps if engine.runner.capture_rows(T, wide=True) > engine.runner.capture_rows(T)]
    assert wide_steps == list(shapes.steps) == [16, 32]  # the lowered cap leaves every step's wide capture a program of its own
    engine.warmup(8, **variants)
    before = compiles.count()
    for lengths in ((17,), (17, 40)):  # one row's pieces: steps of 16; two rows': steps of 32 too
        rows = [engine.open_row() for _ in lengths]
        jobs = [
            engine.start(PrefillJob(row, np.arange(5, 5 + n), logits=None, q_idx_X=np.arange(n), wide_capture=True))
            for row, n in zip(rows, lengths)
        ]
        while not all(job.finished for job in jobs):
            engine.step(prefill_jobs=[job for job in jobs if not job.finished])
        for job, n in zip(jobs, lengths):
            assert np.asarray(job.q_rows).shape[1] == n  # every token's query came back, in one piece
        for row in rows:
            engine.close_row(row)
    assert compiles.count() == before, f"{compiles.count() - before} XLA compiles after warm-up"
