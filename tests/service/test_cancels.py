"""Which jobs a cancel on the control stream applies to: those with its id submitted
before it, for as long as it is remembered."""

from service.cancels import CancelRegistry


def cancel(entry_id: str, request_id: str) -> tuple[bytes, dict]:
    return entry_id.encode(), {b"type": b"cancel", b"id": request_id.encode()}


def test_a_cancel_applies_to_jobs_submitted_before_it_only():
    registry = CancelRegistry(ttl_s=3600)
    assert registry.add_entries([cancel("1000-0", "job")]) == ["job"]
    assert registry.cancels("job", "999-5")
    assert registry.cancels("job", "1000-3")  # the same millisecond: on two streams, order is unknown
    assert not registry.cancels("job", "1001-0")  # submitted after the cancel: runs
    assert not registry.cancels("other", "999-0")


def test_unknown_entries_are_skipped_and_the_newest_id_is_tracked():
    registry = CancelRegistry(ttl_s=3600)
    registry.add_entries([(b"5-0", {b"type": b"pause", b"id": b"job"}), cancel("7-0", "job"), (b"9-0", {})])
    assert registry.last_id == "9-0"
    assert registry.cancels("job", "6-0") and not registry.cancels("job", "8-0")


def test_cancels_are_forgotten_after_their_ttl():
    registry = CancelRegistry(ttl_s=60)
    registry.add_entries([cancel("1000000-0", "old"), cancel("1100000-0", "new")])
    registry.forget_expired(now_s=1150)  # remembers entries from 1,090,000 ms on
    assert not registry.cancels("old", "1-0")
    assert registry.cancels("new", "1-0")
