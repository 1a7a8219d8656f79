"""The command-line tools run end to end on a tiny model (their output, not their speed)."""
from __future__ import annotations

import re

from benchmarks import bench_engine as bench
from engine import generate
from kernels import cpu_ext
from tests.models.tiny import SPECS, hf_greedy


def test_generate_streams_the_greedy_text(tiny_model, capsys):
    folder = tiny_model("gqa16")
    assert generate.main(["--model", str(folder), "--prompt", "w5 w6 w7", "--raw",
                          "--max-tokens", "6", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    expected = hf_greedy(folder, [[5, 6, 7]], 6)[0]
    if 2 in expected:  # the tiny model may well sample its EOS
        expected = expected[:expected.index(2)]
    # special tokens (<unk>, <s>: ids 0, 1) are not shown
    assert out.out.strip() == " ".join(f"w{t}" for t in expected if t > 2)
    assert "tok/s" in out.err


def test_generate_reports_a_bad_model(tmp_path, capsys):
    assert generate.main(["--model", str(tmp_path / "none"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bench_prints_both_tables(tiny_model, capsys):
    assert bench.main(["--model", str(tiny_model("gqa16")), "--num-requests", "3",
                       "--hf-batch-sizes", "2", "--system-prompt-len", "40",
                       "--matmul-size", "256"]) == 0
    out = capsys.readouterr().out
    assert out.count("kvops / best transformers (transformers (batch 2))") == 2
    assert "prefill skipped by the prefix cache" in out
    assert SPECS["gqa16"].name in out
    # % mm is taken of the faster of torch.mm and the packed kernel, both timed
    header = re.search(r"float32 matmul 256\^3: (.*) GFLOP/s \(% mm below: of the best, "
                       r"(\d+)\)", out)
    assert header, out
    rates = dict(re.findall(r"(torch\.mm|kvops packed) (\d+)", header.group(1)))
    assert set(rates) == ({"torch.mm", "kvops packed"} if cpu_ext.available() else {"torch.mm"})
    assert int(header.group(2)) == max(int(r) for r in rates.values())


def test_bench_torch_paths_and_bfloat16(tiny_model, capsys):
    assert bench.main(["--model", str(tiny_model("gqa16")), "--num-requests", "2",
                       "--hf-batch-sizes", "2", "--system-prompt-len", "20", "--torch-paths",
                       "--dtype", "bfloat16", "--matmul-size", "256"]) == 0
    out = capsys.readouterr().out
    assert out.count("kvops (torch paths)") == 2
    assert "bfloat16 matmul 256^3: torch.mm " in out and "kvops packed" not in out
    assert "C++ CPU kernels off" in out  # none for bfloat16
