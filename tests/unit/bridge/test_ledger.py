from kvasir.bridge.ledger import Ledger, Peer, Pending


def record(peer: Peer) -> Pending:
    return Pending(peer, key=1, prompt_tokens=3, submitted_ns=0, detokenizer=None)


def test_ledger_counts_per_client_and_forgets_ended_requests():
    a, b = Peer("ipc", b"a"), Peer("tcp", b"a")  # same identity on two sockets: two clients
    book = Ledger()
    for rid, peer in ((1, a), (2, a), (3, b)):
        book.add(rid, record(peer))
    assert len(book) == 3 and book.held_by(a) == 2 and book.held_by(b) == 1
    assert sorted(book.of(a)) == [1, 2] and book.of(Peer("ipc", b"z")) == []
    assert book.end(1).peer == a and book.end(1) is None  # ends once
    assert book.held_by(a) == 1
    book.end(2)
    assert book.held_by(a) == 0 and book.of(a) == []
    assert [rid for rid, _ in book.end_all()] == [3] and len(book) == 0 and book.held_by(b) == 0


def test_finished_timings():
    r = record(Peer("ipc", b"a"))
    r.token_ids, r.first_ns, r.last_ns = [4, 5, 6], 2_000_000_000, 4_000_000_000
    # handed to the head 0.25 s after submission (the bridge's clock), then 0.75 s waiting
    # there: a duration the head measured on its own clock, which may be another host's
    r.enqueued_ns, r.queued_ns = 250_000_000, 750_000_000
    done = r.finished(9, "length")
    assert done.usage.completion_tokens == 3 and done.timings.per_token_s == 1.0
    assert done.timings.queued_s == 1.0 and done.timings.first_token_s == 2.0 and done.timings.total_s == 4.0
