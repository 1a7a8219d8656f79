"""GroupCommit: calls that wait while a batch is written go in the next one, one
call's items are written in the same batch (all or none), a batch that fails is written
again a call at a time (the call at fault fails alone), and callers on an event loop
join the same batches as threads."""
import asyncio
import threading

from kvops.jobs.group_commit import GroupCommit
from tests.support.wait import wait_until, wait_until_async


def test_one_calls_items_share_a_batch_and_an_error_fails_that_call_only():
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
    wait_until(lambda: sum(len(queued.items) for queued in group._waiting),
               "the three calls' 6 items queued behind the first", 10,
               until=lambda n: n == 6)
    release.set()
    for t in [first, *others]:
        t.join(10)
    # The pair and the triple do not fit in one batch of 4: the triple goes with the
    # single; its bad item fails that batch, which is written again a call at a time:
    # the triple fails whole, never half of it, and the single is stored.
    assert batches == [["a"], ["b", "c"], ["d", "bad", "e", "f"], ["d", "bad", "e"], ["f"]]
    assert results == {"first": ["ok a"], "pair": ["ok b", "ok c"],
                       "triple": "bad item", "single": ["ok f"]}
    assert group.many([]) == []


def test_a_call_larger_than_a_batch_is_written_alone():
    group = GroupCommit(lambda items: [len(items)] * len(items), max_batch=2)
    assert group.many([1, 2, 3]) == [3, 3, 3]
    assert group(7) == 1


def test_an_item_whose_result_is_an_error_fails_its_call_alone():
    group = GroupCommit(lambda items: [ValueError(i) if i < 0 else i * 2 for i in items])
    assert group.many([1, 2]) == [2, 4]
    try:
        group.many([3, -1])
    except ValueError as e:
        assert str(e) == "-1"
    else:
        raise AssertionError("the call with an error result did not raise")


def test_event_loop_callers_share_batches_with_threads():
    release, batches = threading.Event(), []

    def write(items):
        batches.append(list(items))
        if len(batches) == 1:
            release.wait(10)
        return [f"ok {i}" for i in items]

    group = GroupCommit(write)
    first = threading.Thread(target=group.many, args=(["thread"],))
    first.start()
    wait_until(lambda: batches, "the thread to write its batch", 10)

    async def callers():
        tasks = [asyncio.ensure_future(group.one(i)) for i in range(5)]
        await wait_until_async(lambda: len(group._waiting),
                               "all five to wait behind the thread's batch", 10,
                               until=lambda n: n == 5)
        release.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(callers()) == [f"ok {i}" for i in range(5)]
    first.join(10)
    assert batches == [["thread"], [0, 1, 2, 3, 4]]
