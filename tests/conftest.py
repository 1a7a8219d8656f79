"""The suite's split for the inner loop: `make test-fast` runs everything but the tests
that start a stack (a web server and engine workers: tests.support.stack.Stack), drive a
browser or load the service; `make test` (CI) runs everything, and the tests marked
`postgres` once more on PostgreSQL. A test is marked `stack`
when it uses one of these fixtures or lives in one of these modules."""
import pytest

# The tiny model folders (tests/models/fixtures.py), for the model tests in tests/models
# and tests/engine: one build per session, shared by every module that asks for them.
from tests.models.fixtures import tiny_model, tiny_root  # noqa: F401 (fixtures)

STACK_FIXTURES = {"stack", "fuzz_stack", "tiny_stack", "default_stack", "hermes_stack",
                  "process_stack", "capped", "two_engines", "gpu_paced", "login"}
STACK_MODULES = {"test_faults", "test_move_faults", "test_load", "test_make_run",
                 "test_bench_serve", "test_redis_restart", "test_browser",
                 "test_what_if_browser", "test_two_stacks", "test_soak", "test_faults_more"}


# Run a second time on PostgreSQL (`make test`: KVOPS_TEST_DATABASE=postgres pytest -m
# postgres): what production's database does differently is in these. Jobs stored,
# claimed, capped and written as they run; the outbox; moves and their hand-over; the
# what-if runs; the operator log's chain; the KV story; faults (a worker killed, a
# database connection lost, an engine killed during a move); text the model writes (NUL).
POSTGRES_MODULES = {f"tests.service.{name}" for name in (
    "test_stored_text", "test_store_jobs", "test_group_commit", "test_claims", "test_caps",
    "test_outbox", "test_job_stream", "test_run_job", "test_jobs_api", "test_operator_api",
    "test_audit_chain", "test_what_if_runs", "test_migration", "test_kv_story", "test_faults",
    "test_move_faults", "test_usage_api")}


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if STACK_FIXTURES & set(getattr(item, "fixturenames", ())) or module in STACK_MODULES:
            item.add_marker(pytest.mark.stack)
        if item.module is not None and item.module.__name__ in POSTGRES_MODULES:
            item.add_marker(pytest.mark.postgres)
