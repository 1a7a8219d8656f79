"""`python -m kvops.bench_serve` runs from a checkout as the README shows it (a small
concurrency, so it stays short); its figures are not checked here, only that every
stream ended and the table came out."""
import pytest

from kvops import bench_serve


def test_bench_serve_runs_and_loses_no_stream(capsys):
    assert bench_serve.main(["--streams", "8", "--step-ms", "5", "--deadline", "120",
                             "--repeat", "2", "--sim-tokens", "20-60"]) == 0
    out = capsys.readouterr().out
    assert "delivered tok/s" in out and "engine alone tok/s" in out
    row = next(line for line in out.splitlines() if line.startswith("simulator"))
    columns = row.split("core)", 1)[1].split()  # after "simulator, 5 ms step (process core)"
    assert columns[0] == "8"  # streams
    assert columns[-5:-3] == ["0", "0"]  # lost, hung (over both runs)
    alone, slash, service = columns[-8:-5]  # the mean step, alone / in the service
    assert slash == "/" and float(alone) >= 5.0 and float(service) >= 5.0  # paced at 5 ms
    low, high = map(float, columns[4].strip("()").split("-"))  # the ratio's range
    assert low <= float(columns[3]) <= high


@pytest.mark.parametrize("bad", ["64", "0-10", "40-20", "a-b"])
def test_bench_serve_refuses_a_bad_token_range(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_serve.main(["--streams", "8", "--sim-tokens", bad])
    assert exit_.value.code == 2 and "--sim-tokens" in capsys.readouterr().err
