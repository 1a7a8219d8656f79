"""`kernels` must import where Triton is not installed; only launching needs it."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_package_imports_and_references_run_without_triton() -> None:
    script = textwrap.dedent("""
        import importlib.abc, sys

        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoTriton())
        import torch
        import kernels
        assert "triton" not in sys.modules
        pool = torch.randn(1, 2, 4, 2, 1, 8)
        dst = torch.zeros(1, 2, 3, 2, 1, 8)
        kernels.swap_blocks(pool, dst, torch.tensor([[3, 0]]))
        assert torch.equal(dst[:, :, 0], pool[:, :, 3])
        try:
            kernels.copy_blocks(pool, torch.tensor([[0, 1]]))
        except RuntimeError as e:
            assert "Triton is not installed" in str(e), e
        else:
            raise AssertionError("copy_blocks ran without triton")
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={"PATH": "", "TRITON_INTERPRET": "1"}, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
