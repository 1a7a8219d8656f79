"""2,000 jobs through the REST API to two simulated engines: all end, no block leaks."""
import pytest

from benchmarks import loadtest


@pytest.mark.slow
def test_two_thousand_jobs():
    r = loadtest.run(jobs=2000, clients=16, deadline_s=600)
    assert r["ended"] == 2000 and r["finished"] == 2000, r["failed"][:5]
    for name, pool in r["pools"].items():
        assert pool["used"] == 0 and pool["pinned"] == 0, (name, pool)
    assert all(n > 0 for n in r["per_engine"].values())  # both engines took work
    print(f"\naccepted {r['accepted_per_s']:.0f} jobs/s; all ended after {r['total_s']:.0f} s; "
          f"queue wait p50 {r['wait_p50']:.2f} s, p99 {r['wait_p99']:.2f} s")
