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
