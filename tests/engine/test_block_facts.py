"""What the engine page's tooltip asks of a hovered block beyond the snapshot
(LLMEngine.block_facts): each holder's tokens and their text, seconds since the block was
let go, and its place in the evictor's order among the free cached blocks. A simulated
engine with the byte tokenizer (a prompt's token ids are its UTF-8 bytes) and a clock
the test sets."""
import pytest

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from engine.text.detokenizer import SimTokenizer
from tests.support.clock import Clock

BLOCK = 4
PROMPT = "The quick brown fox jumps over"  # 30 tokens: 7 full blocks and 2 tokens


@pytest.fixture
def engine():
    e = LLMEngine(EngineConfig(simulate=True, simulate_tokenizer="bytes", vocab_size=1000,
                               block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=0,
                               name="facts"))
    e.kv.gpu.clock = Clock(1000.0)
    return e


def text_of(prompt: str, start: int, end: int) -> str:
    return SimTokenizer().decode(list(prompt.encode())[start:end])


def run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_a_shared_block_names_each_holder_with_its_tokens_and_their_text(engine):
    longer = PROMPT + " the lazy dog"
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=8), job_id="1", tenant="t1")
    engine.add_request("b", longer, SamplingParams(max_tokens=8), job_id="2", tenant="t2")
    engine.step()
    shared = engine.kv.block_ids("a")[1]
    facts = engine.block_facts("gpu", shared)
    assert facts["idle_s"] is None and facts["eviction"] is None  # held: never evicted
    assert [(h["request_id"], h["job_id"], h["tenant"], h["tokens"]) for h in facts["holders"]] \
        == [("a", "1", "t1", [4, 8]), ("b", "2", "t2", [4, 8])]
    assert {h["text"] for h in facts["holders"]} == {text_of(PROMPT, 4, 8)}
    own = engine.kv.block_ids("b")[7]  # b's alone: its 8th block, past the shared prefix
    [holder] = engine.block_facts("gpu", own)["holders"]
    assert holder["request_id"] == "b" and holder["tokens"] == [28, 32]
    assert holder["text"] == text_of(longer, 28, 32)


def test_cached_blocks_say_how_long_they_waited_and_their_place_in_the_eviction_order(engine):
    clock = engine.kv.gpu.clock
    engine.add_request("old", PROMPT, SamplingParams(max_tokens=2))
    run_to_end(engine)
    old_blocks = [b for b, h in enumerate(engine.snapshot()["gpu"]["hash32"]) if h]
    clock.now += 10
    engine.add_request("new", "Pack my box with five dozen jugs", SamplingParams(max_tokens=2))
    run_to_end(engine)
    clock.now += 20
    cached = [b for b, h in enumerate(engine.snapshot()["gpu"]["hash32"]) if h]
    assert set(old_blocks) < set(cached)
    facts = {b: engine.block_facts("gpu", b) for b in cached}
    assert all(f["holders"] == [] for f in facts.values())
    assert {facts[b]["idle_s"] for b in old_blocks} == {30.0}
    assert {facts[b]["idle_s"] for b in cached if b not in old_blocks} == {20.0}
    # least recently let go first: every block of "old" before every block of "new"
    places = {b: facts[b]["eviction"]["place"] for b in cached}
    assert {facts[b]["eviction"]["of"] for b in cached} == {len(cached)}
    assert sorted(places.values()) == list(range(1, len(cached) + 1))
    assert max(places[b] for b in old_blocks) < min(
        places[b] for b in cached if b not in old_blocks)
    # the block at place 1 is the one the pool evicts next
    first = min(cached, key=places.get)
    assert engine.evict_cached_blocks(1) == 1
    assert engine.block_facts("gpu", first)["eviction"] is None
    assert engine.snapshot()["gpu"]["hash32"][first] == 0
    assert {engine.block_facts("gpu", b)["eviction"]["place"] for b in cached if b != first} \
        == set(range(1, len(cached)))


def test_a_block_that_is_not_there_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="block_id"):
        engine.block_facts("gpu", 64)
    with pytest.raises(InvalidRequestError, match="pool"):
        engine.block_facts("disk", 0)
