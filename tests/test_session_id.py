"""derive_session_id: the four sources in priority order."""

import numpy as np

from jaxkv.chat import derive_session_id


def test_priority_order():
    ids = np.arange(1000, dtype=np.int32)
    assert derive_session_id(ids, (10, 20), explicit="abc") == "explicit:abc"
    span_key = derive_session_id(ids, (10, 20))
    assert span_key.startswith("span:")
    assert derive_session_id(ids, (0, 0)).startswith("prefix:")  # empty span: absent
    assert derive_session_id(ids, None).startswith("prefix:")
    assert derive_session_id(None).startswith("local:")
    assert derive_session_id(np.zeros(0, np.int32), (0, 0), explicit="").startswith("local:")


def test_span_key_depends_only_on_the_span_tokens():
    a = np.array([1, 2, 3, 7, 8, 9, 4], np.int32)
    b = np.array([5, 5, 7, 8, 9, 6, 6, 6], np.int64)  # other prefix, dtype and position
    assert derive_session_id(a, (3, 6)) == derive_session_id(b, (2, 5))
    assert derive_session_id(a, (3, 6)) != derive_session_id(a, (3, 5))


def test_prefix_key_hashes_the_first_n_tokens():
    a = np.arange(300)
    b = np.concatenate([np.arange(256), np.full(50, 9)])
    assert derive_session_id(a) == derive_session_id(b)
    assert derive_session_id(a, n_prefix=257) != derive_session_id(b, n_prefix=257)
    assert derive_session_id(a) != derive_session_id(a + 1)


def test_request_local_keys_never_match():
    assert derive_session_id(None) != derive_session_id(None)
