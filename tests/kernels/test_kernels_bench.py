"""benchmarks.bench_kernels runs: a clear message without CUDA, a smoke run in the interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_kernels as bench

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.slow
def test_cpu_interpret_smoke_run_prints_both_tables() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "benchmarks.bench_kernels", "--cpu-interpret"], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "decode" in lines and "prefill" in lines
    assert sum(line.startswith(("decode ", "prefill ", "chunk ")) for line in lines) == 3
