from kvasir.recent import Recent


def test_recent_keys_are_bounded_and_taken_once():
    ids = Recent[int](3)
    for rid in range(5):
        ids.add(rid)
    assert len(ids) == 3 and 0 not in ids and 2 in ids
    assert not ids.take(0) and not ids.take(1)
    assert ids.take(4) and not ids.take(4)
    assert 4 not in ids and len(ids) == 2
