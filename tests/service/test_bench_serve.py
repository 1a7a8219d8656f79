"""`python -m benchmarks.bench_serve` runs from a checkout as the README shows it (a small
concurrency, so it stays short); its figures are not checked here, only that every
stream ended and the table came out."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_serve
from tests.support.wait import wait_until


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
    ttft, slash, _, ttft_alone = columns[5:9]  # TTFT p50 / p99 (the engine alone's p50)
    assert slash == "/" and float(ttft) >= 5.0  # a first token takes a step at least
    assert ttft_alone.startswith("(") and float(ttft_alone.strip("()")) >= 5.0


@pytest.mark.parametrize("bad", ["64", "0-10", "40-20", "a-b"])
def test_bench_serve_refuses_a_bad_token_range(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_serve.main(["--streams", "8", "--sim-tokens", bad])
    assert exit_.value.code == 2 and "--sim-tokens" in capsys.readouterr().err


def _children(pid: int) -> set[int]:
    """The live processes whose parent is pid."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # (a zombie has exited)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_terminated_run_stops_its_stack():
    """`timeout ... python -m benchmarks.bench_serve` sends SIGTERM to the benchmark alone; its
    stack's processes (in sessions of their own) must stop with it, not run on."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_serve", "--streams", "8", "--step-ms", "10",
         "--sim-tokens", "1500-1500", "--deadline", "600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stack: set[int] = set()
    try:
        def still_running() -> None:
            if bench.poll() is not None:
                raise AssertionError("the benchmark exited before an engine worker came up: "
                                     f"{bench.stderr.read().decode()[-2000:]}")

        wait_until(lambda: {p for p in _children(bench.pid)  # (engine_worker execs celery)
                            if "engine_worker" in _cmdline(p) or "celery" in _cmdline(p)},
                   "an engine worker", 300, poll_s=0.2, check=still_running)
        stack = _children(bench.pid)  # the web server and the worker
        stack |= {c for p in stack for c in _children(p)}  # the worker's engine core
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) == 128 + signal.SIGTERM
        # Stack.stop() waits for each process it stops, so nothing may be left by now.
        assert not [p for p in stack if _alive(p)], [_cmdline(p) for p in stack if _alive(p)]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in stack:  # (what a failure here left behind: not for the next tests)
            if _alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
