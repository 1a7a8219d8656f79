"""tests/support/wait.py: wait_until and its async twin return the value awaited, and
past the timeout fail saying what was awaited and the last value seen."""
import asyncio
import itertools

import pytest

from tests.support.wait import WaitTimeout, wait_until, wait_until_async


def test_returns_the_first_value_that_meets_the_condition():
    counter = itertools.count()
    assert wait_until(lambda: next(counter), "the count to reach 3", 5, poll_s=0,
                      until=lambda n: n >= 3) == 3
    values = iter([None, 0, "", "ready"])
    assert wait_until(lambda: next(values), "a value", 5, poll_s=0) == "ready"


def test_a_timeout_says_what_was_awaited_and_the_last_value_seen():
    with pytest.raises(WaitTimeout, match=r"waiting for the queue to drain; last seen: \[7\]"):
        wait_until(lambda: [7], "the queue to drain", 0.05, until=lambda q: not q)
    with pytest.raises(AssertionError, match="log tail here"):  # (a test failure)
        wait_until(lambda: False, "never", 0.05, detail=lambda: "log tail here")


def test_listed_errors_mean_not_yet_and_others_end_the_wait():
    answers = iter([ConnectionError("refused"), ConnectionError("refused"), "up"])

    def probe():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_until(probe, "the server", 5, poll_s=0, errors=(ConnectionError,)) == "up"
    with pytest.raises(WaitTimeout, match=r"last seen: ConnectionError\('refused'\)"):
        wait_until(lambda: probe_refused(), "the server", 0.05, errors=(ConnectionError,))
    with pytest.raises(KeyError):
        wait_until(lambda: {}["missing"], "a key", 5, errors=(ConnectionError,))


def probe_refused():
    raise ConnectionError("refused")


def test_the_check_ends_the_wait_early():
    tries = []

    def check():
        if len(tries) == 2:
            raise RuntimeError("the server exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(lambda: tries.append(1), "the server", 60, poll_s=0, check=check)
    assert len(tries) == 2


@pytest.mark.parametrize("timeout_s, poll_s", [(0, 0.01), (-1, 0.01), (1, -0.5)])
def test_a_timeout_or_poll_out_of_range_is_refused(timeout_s, poll_s):
    with pytest.raises(ValueError, match="timeout_s must be > 0 and poll_s >= 0"):
        wait_until(lambda: True, "x", timeout_s, poll_s=poll_s)


def test_the_async_twin_awaits_its_probe_and_lets_the_loop_run():
    async def main():
        done = []

        async def finisher():
            await asyncio.sleep(0)
            done.append("finished")

        task = asyncio.ensure_future(finisher())

        async def probe():
            return list(done)

        value = await wait_until_async(probe, "the other task", 5, poll_s=0)
        await task
        sync_probe = await wait_until_async(lambda: len(done), "a plain probe", 5)
        with pytest.raises(WaitTimeout, match=r"waiting for nothing; last seen: 1"):
            await wait_until_async(lambda: len(done), "nothing", 0.05,
                                   until=lambda n: n == 0)
        return value, sync_probe

    assert asyncio.run(main()) == (["finished"], 1)
