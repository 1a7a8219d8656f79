"""GroupCommit: calls that wait while a batch is written go in the next one, and one
call's items are written in the same batch (all or none)."""
import threading

from kvops.group_commit import GroupCommit


def test_one_calls_items_share_a_batch_and_an_error_fails_that_batch_only():
    writing, release, batches = threading.Event(), threading.Event(), []

    def write(items):
        batches.append(list(items))
        if len(batches) == 1:  # hold the first batch while the others queue up
            writing.set()
            release.wait(10)
        if "bad" in items:
            raise ValueError("bad item")
        return [f"ok {i}" for i in items]

    group = GroupCommit(write, max_batch=4)
    results = {}

    def call(name, items):
        try:
            results[name] = group.many(items)
        except ValueError as e:
            results[name] = str(e)

    first = threading.Thread(target=call, args=("first", ["a"]))
    first.start()
    assert writing.wait(10)
    others = [threading.Thread(target=call, args=args) for args in (
        ("pair", ["b", "c"]), ("triple", ["d", "bad", "e"]), ("single", ["f"]))]
    for t in others:
        t.start()
    for _ in range(1000):  # until the three calls are queued behind the first
        if sum(len(call_slots) for call_slots in group._waiting) == 6:
            break
        threading.Event().wait(0.01)
    release.set()
    for t in [first, *others]:
        t.join(10)
    # The pair and the triple do not fit in one batch of 4: the triple goes with the
    # single, and its bad item fails both of them, never half of a call.
    assert batches == [["a"], ["b", "c"], ["d", "bad", "e", "f"]]
    assert results == {"first": ["ok a"], "pair": ["ok b", "ok c"],
                       "triple": "bad item", "single": "bad item"}
    assert group.many([]) == []


def test_a_call_larger_than_a_batch_is_written_alone():
    group = GroupCommit(lambda items: [len(items)] * len(items), max_batch=2)
    assert group.many([1, 2, 3]) == [3, 3, 3]
    assert group(7) == 1
