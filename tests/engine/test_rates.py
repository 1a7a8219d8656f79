"""The engine's token rates: a rate over the steps of a recent window, 0 while the engine
is paused and 0 once no step ran in the window (the engine header's tokens/s reads them)."""
from engine.observe.rate_meter import RateMeter
from tests.engine.sim import greedy, sim_engine


def test_rate_is_over_recent_steps_and_zero_without_one():
    meter = RateMeter(window_s=10.0)
    meter.record(100.0, 0)
    meter.record(101.0, 50)
    assert meter.rate(101.0) == 50.0
    assert meter.rate(105.0) == 10.0  # nothing since: the window's average
    assert meter.rate(111.5) == 0.0  # no step in the last 10 s


def test_rate_is_zero_while_paused():
    meter = RateMeter(window_s=10.0)
    meter.record(100.0, 0)
    meter.record(101.0, 50)
    assert meter.rate(101.0, paused=True) == 0.0


def test_engine_reports_zero_tokens_per_second_while_paused():
    engine = sim_engine()
    engine.add_request("a", list(range(1, 14)), greedy(200))
    for _ in range(10):
        engine.step()
    assert engine.metrics()["generation_tokens_per_s"] > 0
    engine.pause()
    paused = engine.metrics()
    assert paused["state"] == "paused"
    assert (paused["generation_tokens_per_s"], paused["prompt_tokens_per_s"]) == (0.0, 0.0)
    engine.resume()
    engine.step()
    assert engine.metrics()["generation_tokens_per_s"] > 0
