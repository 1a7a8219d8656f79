"""Where kernels/cpu_ext.py builds the CPU kernels, and when it builds them again."""
from __future__ import annotations

import shutil

from kernels import cpu_ext


def test_build_dir_ignores_the_data_dir(monkeypatch, tmp_path):
    """A service stack runs with its own KVOPS_DATA_DIR: it must reuse the build that
    make setup made, not compile again for every stack."""
    before = cpu_ext.build_dir()
    monkeypatch.setenv("KVOPS_DATA_DIR", str(tmp_path))
    assert cpu_ext.build_dir() == before
    monkeypatch.setenv("KVOPS_KERNEL_DIR", str(tmp_path / "k"))
    assert cpu_ext.build_dir() == tmp_path / "k" / before.name


def test_build_key_follows_the_sources(monkeypatch, tmp_path):
    key = cpu_ext._build_key()
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_ext.CSRC, csrc)
    monkeypatch.setattr(cpu_ext, "CSRC", csrc)
    assert cpu_ext._build_key() == key
    with open(csrc / cpu_ext.HEADERS[0], "a") as f:
        f.write("\n// edited\n")
    assert cpu_ext._build_key() != key


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVOPS_CPU_KERNELS", "0")
    assert not cpu_ext.available()


def test_the_large_matmul_choice(monkeypatch):
    """Deterministic unless asked to measure: "auto" by the CPU's maker, "mkl" and
    "packed" as said; "measure" once per process, both rates real, packed meaning
    clearly faster."""
    import pytest

    if not cpu_ext.available():
        pytest.skip("the CPU kernels are not built here")
    auto = cpu_ext.matmul_choice("auto")
    assert auto.packed == (cpu_ext.cpu_vendor() == "AuthenticAMD")
    assert auto.source.startswith("auto") and cpu_ext.matmul_choice("auto") == auto
    assert cpu_ext.matmul_choice("packed").packed and not cpu_ext.matmul_choice("mkl").packed
    with pytest.raises(ValueError, match="large_matmuls"):
        cpu_ext.matmul_choice("fastest")
    choice = cpu_ext.matmul_choice("measure")
    assert choice.source == "measured"
    assert choice.packed_gflops > 1 and choice.mkl_gflops > 1
    assert choice.packed == (choice.packed_gflops > cpu_ext.PACKED_MARGIN * choice.mkl_gflops)
    assert cpu_ext.matmul_choice("measure") is choice
    print(f"many-row float32 matmuls here: packed {choice.packed_gflops:.0f}, "
          f"MKL {choice.mkl_gflops:.0f} GFLOP/s")


def test_the_engine_config_carries_the_switches():
    """EngineConfig.cpu_kernels and .large_matmuls (KVOPS_ENGINE_CPU_KERNELS and
    KVOPS_ENGINE_LARGE_MATMULS, like every engine setting); a bad choice is refused."""
    import pytest

    from engine.config import EngineConfig
    from engine.errors import EngineError
    assert EngineConfig().large_matmuls == "auto" and EngineConfig().cpu_kernels == "auto"
    with pytest.raises(EngineError, match="large_matmuls"):
        EngineConfig(large_matmuls="openblas")
    # booleans and the environment's spellings mean on and off
    for value, meant in [(True, "on"), (False, "off"), ("1", "on"), ("no", "off"), ("ON", "on"),
                         ("auto", "auto")]:
        assert EngineConfig(cpu_kernels=value).cpu_kernels == meant
    with pytest.raises(EngineError, match="cpu_kernels must be auto, on or off"):
        EngineConfig(cpu_kernels="fast")


def test_auto_wants_the_kernels_only_with_avx512(monkeypatch):
    import platform

    from kernels import cpu_ext

    if platform.machine() == "x86_64":  # read from /proc/cpuinfo
        assert "sse2" in cpu_ext.cpu_flags() and cpu_ext.cpu_vendor()

    assert cpu_ext.wanted("on") and not cpu_ext.wanted("off")
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: {"avx2", "fma"})
    assert not cpu_ext.wanted("auto")
    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert cpu_ext.wanted("auto")


def test_a_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path):
    """torch's build lock is a plain file: a build killed midway leaves it, and torch
    would wait on it for ever. A new process (under the builders' own lock) removes it
    and loads the kernels."""
    import subprocess
    import sys

    directory = cpu_ext.build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "lock").touch()
    loaded = subprocess.run(
        [sys.executable, "-c", "from kernels import cpu_ext; cpu_ext.ops(); print('loaded')"],
        capture_output=True, text=True, timeout=600)
    assert "loaded" in loaded.stdout, loaded.stderr[-2000:]
    assert not (directory / "lock").exists()
