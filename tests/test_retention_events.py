"""Once-per-session compression (``events="once"``, ``jaxkv.serving.stages.retention``).

A session with ``events="once"`` compresses the first time its history exceeds the
budget and never again: later turns and decode chunks only append, with one kept
set, per-layer sets and a budget shared over the layers alike, where the default
(``"always"``) fires an event at every turn over the budget. RepairKV still
promotes at each later turn boundary, from the rows the one event shelved. A value
it does not know is refused before anything is built. Three-turn conversations on
the small random agent model (``test_repair``'s, budget 40).
"""

from __future__ import annotations

import itertools

import pytest
from test_repair import _conversation, _replay
from test_session import agent_model  # noqa: F401  (fixture)

import jaxkv.serving.session as session_module
from jaxkv.errors import ConfigError
from jaxkv.serving import Server, Session
from jaxkv.serving.stages.retention import RetentionSpec

SETS = {"model": {}, "layer": {"keep_sets": "layer"}, "shared": {"keep_sets": "layer", "layer_budgets": "shared"}}


def _events_per_turn(model, **options):
    """The session's events so far after each turn of a three-turn replay."""
    session = Session(model, keep_reasoning=True, max_positions=512, policy="snapkv", budget=40, w=8, protect_query=False, **options)
    try:
        return [t.compressions for t in session.replay(_conversation(0), None)]
    finally:
        session.close()


@pytest.mark.parametrize("sets", list(SETS))
def test_once_compresses_at_the_first_turn_only(agent_model, sets):
    every = _events_per_turn(agent_model, **SETS[sets])
    assert every[0] == 1 and all(b > a for a, b in itertools.pairwise(every)), every  # by default each turn fires its own event
    assert _events_per_turn(agent_model, events="once", **SETS[sets]) == [1, 1, 1]


def _decode_events(model, policy, **options) -> int:
    """Events of a session with a decode interval of 2 over one 8-token reply."""
    session = Session(model, max_positions=512, policy=policy, budget=40, decode_interval=2, **options)
    try:
        session.chat(_conversation(0)[:2], max_new_tokens=8, ignore_eos=True)
        return len(session.compressions)
    finally:
        session.close()


def test_once_holds_for_decode_chunk_events(agent_model):
    assert _decode_events(agent_model, "tova") > 2  # the prompt's event, then one per decode chunk
    assert _decode_events(agent_model, "tova", events="once") == 1


def test_decode_chunk_events_fire_for_a_policy_that_captures_nothing(agent_model):
    """``oldest`` asks no query rows and no attention mass of a decode chunk: its
    decode interval alone must bring the chunk's event (``tova``, which captures its
    window, does above)."""
    assert _decode_events(agent_model, "oldest") > 2  # the prompt's event, then the decode chunks'


def test_repair_promotes_at_every_later_turn_from_the_one_event(agent_model):
    K = 8
    server = Server(agent_model, max_positions=512)
    session = _replay(agent_model, server, repair=K, events="once", protect_query=False)  # the question evictable, as in multiq
    assert len(session.compressions) == 1
    first, *later = session.repairs
    assert first.skipped == "no evicted rows" and len(later) == 2
    for r in later:
        assert r.skipped is None and 0 < r.promoted_positions.size == min(K, r.candidates)
        assert r.live_after - r.live_before == r.promoted_positions.size
    assert later[1].live_before > later[0].live_after  # turn 3 appends to what turn 2 left: no event cut it back
    session.close()


def test_an_unknown_events_value_is_refused_before_anything_is_built(agent_model, monkeypatch):
    with pytest.raises(ConfigError, match="unknown events 'twice'; known: always, once"):
        RetentionSpec.make("snapkv", 40, "dead_slot", {}, events="twice")
    built = []
    monkeypatch.setattr(session_module, "Server", lambda *a, **k: built.append(a) or pytest.fail("a server was built"))
    with pytest.raises(ConfigError, match="unknown events 'twice'; known: always, once"):
        Session(agent_model, policy="snapkv", budget=40, events="twice")
    with pytest.raises(ConfigError, match="events needs a retention policy"):
        Session(agent_model, events="once")
    assert built == []
    monkeypatch.undo()
    server = Server(agent_model, max_positions=256)
    with pytest.raises(ConfigError, match="unknown events"):
        Session(agent_model, server=server, policy="snapkv", budget=40, events="every_turn")
    assert len(server.store) == 0 and server.engine.allocator.num_used == 0
    server.close()
