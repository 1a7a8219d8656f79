"""The web's constraint compiles (kvops/intake/grammar_check.py): in worker processes, with the
engine's tokenizer, each within a deadline past which the worker is killed and replaced;
verdicts cached so that a repeat costs nothing."""
import pytest

from engine.model.default_model import default_model_dir
from kvops.intake.grammar_check import GrammarChecker

FOLDER = default_model_dir()
TOKENIZER = (str(FOLDER), 49152)
pytestmark = pytest.mark.skipif(not (FOLDER / "config.json").is_file(),
                                reason="default model not converted (run `make setup`)")

GOOD = {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                 "required": ["a"]}}
# Within the bounds, and slow to compile for a real vocabulary: every length up to
# 10,000 is a state (about 1.5 s with the default model's tokenizer).
SLOW = {"json": {"type": "object", "required": ["a", "b"], "properties": {
    "a": {"type": "string", "maxLength": 10_000}, "b": {"type": "string", "maxLength": 9_999}}}}


@pytest.fixture()
def checker():
    c = GrammarChecker(workers=1, timeout_s=0.25)
    yield c
    c.close()


def test_a_compile_past_the_deadline_is_refused_and_its_worker_replaced(checker):
    assert checker.verdict(GOOD, TOKENIZER) is None
    (worker,) = list(checker._idle.queue)
    first = worker.proc.pid
    verdict = checker.verdict(SLOW, TOKENIZER)
    assert "took longer than 0.25 s (KVOPS_GRAMMAR_TIMEOUT_S)" in verdict
    assert worker.proc is None  # killed
    assert checker.verdict({"regex": "[0-9]+"}, TOKENIZER) is None  # a fresh worker
    assert worker.proc.pid != first
    compiles = checker.num_compiles
    assert checker.verdict(SLOW, TOKENIZER) == verdict  # the repeat: from the cache
    assert checker.verdict(GOOD, TOKENIZER) is None
    assert checker.num_compiles == compiles and checker.num_timeouts == 1


def test_refusals_say_why_without_source_paths(checker):
    verdict = checker.verdict({"json": {"type": "foo"}}, TOKENIZER)
    assert verdict == 'structured json: Unsupported type "foo"'
    assert "Regex parsing error" in checker.verdict({"regex": "(a"}, None)
    # a tokenizer folder that will not load: the grammar alone is checked
    assert checker.verdict(GOOD, ("/nonexistent/model", 100)) is None


def test_the_same_constraint_at_once_is_compiled_once(checker):
    import threading
    checker.timeout_s = 30
    spec = {"json": {"type": "string", "maxLength": 4_000}}  # a few tenths of a second
    verdicts = []
    threads = [threading.Thread(target=lambda: verdicts.append(checker.verdict(spec, TOKENIZER)))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert verdicts == [None] * 6 and checker.num_compiles == 1


def test_checks_past_the_queue_are_refused_as_busy(checker):
    """One worker and its queue are full of slow compiles: the next check is refused at
    once (503), not queued without end on the web's threads."""
    import threading

    from kvops.intake.grammar_check import QUEUE_PER_WORKER, Busy
    outcomes = []

    def check(n: int) -> None:
        spec = {"json": {**SLOW["json"], "description": f"variant {n}"}}
        try:
            outcomes.append(checker.verdict(spec, TOKENIZER))
        except Busy:
            outcomes.append("busy")

    slots = 1 + QUEUE_PER_WORKER
    threads = [threading.Thread(target=check, args=(n,)) for n in range(slots + 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("busy") == 3
    assert all("took longer" in o for o in outcomes if o != "busy")


def test_a_value_the_compiler_cannot_take_is_a_refusal(checker):
    verdict = checker.verdict({"json": {"type": "integer", "maximum": 10**30}}, TOKENIZER)
    assert verdict.startswith("structured json: it holds a value the compiler cannot take")
