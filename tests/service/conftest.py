from pathlib import Path

import pytest

from tests.support.stack import Stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """Web server + one simulated engine worker ("sim"), shared by the service tests."""
    s = Stack(Path(tmp_path_factory.mktemp("stack")))
    try:
        s.start_web()
        s.start_engine("sim", simulate=1, vocab_size=32000, num_gpu_blocks=512,
                       num_cpu_blocks=256, block_size=16, max_num_seqs=16,
                       simulate_step_ms=20)
        yield s
    finally:
        s.stop()
