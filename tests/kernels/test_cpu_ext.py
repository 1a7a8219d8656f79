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
    """Measured once per process: both rates are real, and packed means clearly faster."""
    if not cpu_ext.available():
        import pytest

        pytest.skip("the CPU kernels are not built here")
    monkeypatch.delenv("KVOPS_LARGE_MATMULS", raising=False)
    choice = cpu_ext.matmul_choice()
    assert choice.source == "measured"
    assert choice.packed_gflops > 1 and choice.mkl_gflops > 1
    assert choice.packed == (choice.packed_gflops > cpu_ext.PACKED_MARGIN * choice.mkl_gflops)
    assert cpu_ext.matmul_choice() is choice
    print(f"many-row float32 matmuls here: packed {choice.packed_gflops:.0f}, "
          f"MKL {choice.mkl_gflops:.0f} GFLOP/s")


def test_the_environment_decides_the_large_matmuls(monkeypatch):
    import pytest

    monkeypatch.setenv("KVOPS_LARGE_MATMULS", "packed")
    assert cpu_ext.matmul_choice().packed
    monkeypatch.setenv("KVOPS_LARGE_MATMULS", "MKL")
    assert not cpu_ext.matmul_choice().packed
    monkeypatch.setenv("KVOPS_LARGE_MATMULS", "openblas")
    with pytest.raises(ValueError, match="KVOPS_LARGE_MATMULS='openblas'"):
        cpu_ext.matmul_choice()


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
