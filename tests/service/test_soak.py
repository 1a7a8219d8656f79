"""Two minutes of the soak (benchmarks/soak.py): mixed traffic, operator actions, a move
and a what-if against two simulated engines at GPU pace. Nothing accepted is lost, no
answer is cut short, and no block is left used or pinned once the engines are idle."""
import pytest

from benchmarks import soak


@pytest.mark.slow
def test_two_minutes_of_mixed_traffic_lose_and_leak_nothing():
    r = soak.run(minutes=2, clients=16, step_ms=10)
    print("\n" + soak.report(r))
    assert r["jobs"] > 0 and r["by_status"]["finished"] > 0
    assert r["lost"] == [], r["lost"][:10]
    assert r["cut_short"] == 0
    assert all(n == 0 for n in r["leaked"].values()), r["pools"]
    assert sum(r["calls"].values()) > r["client_errors"].total()
