"""How often an engine's publisher stores the snapshot GET /api/engines/<name>/ reads
(kvops/worker/publisher.py, next_store_due), on a clock the test moves: each store starts
when the one before allows, and takes the seconds the test says.

It fails on the rule the publisher had before (the next store took/STORE_SHARE after the
last, uncapped): one store of 0.48 s then put the next 24 s off, and the stored snapshot
kept listing a request that had ended as running all that while."""
from kvops.worker.publisher import MAX_STORE_GAP_S, STORE_SHARE, next_store_due
from tests.support.clock import Clock

INTERVAL_S = 1.0  # the publisher's store_interval_s


def store_starts(clock: Clock, durations: list[float]) -> list[float]:
    """Stores one after the other, each as soon as the one before allows and taking the
    given seconds: when each began."""
    starts = []
    for took in durations:
        started = clock()
        starts.append(started)
        clock.now = next_store_due(started, took, INTERVAL_S)  # (never before it ended)
    return starts


def gaps(starts: list[float]) -> list[float]:
    return [round(b - a, 6) for a, b in zip(starts, starts[1:])]


def test_quick_stores_come_once_an_interval():
    assert gaps(store_starts(Clock(), [0.01] * 4)) == [INTERVAL_S] * 3


def test_steadily_slow_stores_take_at_most_their_share_of_the_time():
    took = 0.05  # every store: the next one took / STORE_SHARE = 2.5 s later
    assert gaps(store_starts(Clock(), [took] * 4)) == [took / STORE_SHARE] * 3


def test_one_slow_store_does_not_leave_the_stored_snapshot_stale_for_long():
    """A store of 0.48 s (during a 1 GiB move): the next comes at most MAX_STORE_GAP_S
    after it ended, not 24 s after it began; then quick stores come each interval again."""
    clock = Clock()
    starts = store_starts(clock, [0.01, 0.48, 0.01, 0.01])
    assert gaps(starts) == [INTERVAL_S, 0.48 + MAX_STORE_GAP_S, INTERVAL_S]
    assert 0.48 / STORE_SHARE > 0.48 + MAX_STORE_GAP_S  # (what the old rule waited)


def test_a_store_slower_than_the_cap_is_followed_after_the_cap():
    """However long the last store took, the next starts MAX_STORE_GAP_S after it ended."""
    assert gaps(store_starts(Clock(), [30.0, 0.01])) == [30.0 + MAX_STORE_GAP_S]


def test_the_interval_is_the_shortest_gap_whatever_the_cap():
    assert next_store_due(100.0, 0.0, 10.0) == 110.0
    assert next_store_due(100.0, 0.2, 10.0) == 110.0  # (0.2 / STORE_SHARE is 10 s)
