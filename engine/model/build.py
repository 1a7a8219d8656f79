"""Building what computes an engine's tokens from its EngineConfig: the model runner (a
real model, or the simulator's stand-in with its tokenizer), and the disk tier, whose
blocks are the runner's pools' bytes."""
from __future__ import annotations

import functools
import logging
from collections.abc import Set as AbstractSet

from engine.config import EngineConfig
from engine.kv.block_pool import BlockPool
from engine.kv.events import EventLog
from engine.kv.tiers.base import PrefixTier
from engine.model.runner import Runner
from engine.text.detokenizer import SimTokenizer

log = logging.getLogger(__name__)
SIMULATED_MAX_MODEL_LEN = 4096
SIMULATED_NUM_GPU_BLOCKS = 4096


def simulated_tokenizer_path(config: EngineConfig) -> str | None:
    """The HF folder the simulator reads its tokenizer from (config.simulate_tokenizer),
    or None for the byte tokenizer."""
    choice = config.simulate_tokenizer
    if choice == "bytes":
        return None
    if choice == "default":
        from engine.model.default_model import default_model_dir
        folder = default_model_dir()
        if not (folder / "tokenizer.json").is_file():
            log.warning("simulate_tokenizer=default: %s is not converted (make setup); "
                        "the simulator counts UTF-8 bytes as tokens", folder)
            return None
        return str(folder)
    return choice


def simulated_tokenizer(path: str | None):
    """The simulator's tokenizer at simulated_tokenizer_path(): SimTokenizer for None,
    else the HF folder's. The worker reads it too, to detokenise."""
    if path is None:
        return SimTokenizer()
    from engine.text.tokenizer import HFTokenizer
    return HFTokenizer.from_folder(path)


def build_runner(config: EngineConfig) -> Runner:
    if config.simulate:
        from engine.model.simulated_runner import SimulatedRunner
        num_gpu = config.num_gpu_blocks or SIMULATED_NUM_GPU_BLOCKS
        num_cpu = num_gpu // 2 if config.num_cpu_blocks is None else config.num_cpu_blocks
        path = simulated_tokenizer_path(config)
        tokenizer = simulated_tokenizer(path)
        # with a real tokenizer, its vocabulary (every id it encodes is a valid prompt)
        vocab = tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else config.vocab_size
        runner = SimulatedRunner(num_gpu, num_cpu, config.block_size, vocab,
                                 config.max_model_len or SIMULATED_MAX_MODEL_LEN,
                                 step_ms=config.simulate_step_ms,
                                 token_us=config.simulate_token_us,
                                 sliding_window=config.simulate_sliding_window,
                                 hybrid=config.simulate_hybrid,
                                 avoid=frozenset(tokenizer.eos_token_ids),
                                 kv_bytes_per_token=config.simulate_kv_bytes_per_token)
        runner.tokenizer = tokenizer
        runner.tokenizer_path = path
        return runner
    from engine.model.model_runner import ModelRunner  # imports torch: only for real models
    return ModelRunner(config)


def build_disk_tier(config: EngineConfig, runner: Runner, events: EventLog, above: BlockPool,
                    unwritten: AbstractSet[int]) -> PrefixTier:
    """The disk tier of config.disk_cache_dir below the pool `above` (the KV core builds
    its chain with it), its blocks marked with what they mean here (a block of another
    model, K/V format or block size is never read); `unwritten`: that pool's blocks whose
    data the coming step writes."""
    from engine.kv.tiers.disk import DiskStore, DiskTier
    identity = {"model": runner.model_id, "kv_format": runner.kv_format,
                "block_size": config.block_size, "block_bytes": runner.block_bytes}
    secret = config.secret.encode() if config.secret is not None else None
    store = DiskStore(config.disk_cache_dir, config.disk_cache_bytes, identity, secret)
    return DiskTier(store, above, events,
                    functools.partial(runner.read_pool_block, above.pool),
                    functools.partial(runner.write_pool_block, above.pool),
                    config.disk_cache_min_hits, unwritten)
