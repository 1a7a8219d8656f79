"""The pages' pure JavaScript logic, unit-tested with node's own test runner
(tests/dashboard/js/*.test.mjs): no browser needed."""
import subprocess
from pathlib import Path

JS_TESTS = Path(__file__).parent / "js"


def test_node_unit_tests_pass():
    files = sorted(str(p) for p in JS_TESTS.glob("*.test.mjs"))
    assert files
    run = subprocess.run(["node", "--test", *files], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "# fail 0" in run.stdout and "# pass 0" not in run.stdout
