"""Engine configuration (the public contract in docs/design.md)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import EngineError

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
FAIRNESS_POLICIES = ("share", "vtc")  # (engine/sched/fairness.py)
LARGE_MATMULS = ("auto", "mkl", "packed", "measure")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
ROLES = ("both", "prefill", "decode")
EVICTION_POLICIES = ("lru", "slru", "lfu", "priority")  # (engine/kv/block_pool.py ranks them)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # (kernels/fp8.py)
KV_CACHE_SCALES = ("tensor", "head", "unit")


class ConfigError(EngineError, ValueError):
    """An EngineConfig field has a value the engine cannot use."""


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF folder; None: the converted default model (unless simulate)
    block_size: int = 16  # tokens per KV block
    num_gpu_blocks: int | None = None  # None: sized from memory (real model) or 4096 (simulate)
    num_cpu_blocks: int | None = None  # swap pool; None: half the GPU pool
    max_num_seqs: int = 256  # most requests in one batch
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int | None = None  # None: the model's own limit (simulate: 4096)
    enable_prefix_caching: bool = True
    # The CPU pool is also a second-level prefix cache: a cached GPU block that is about
    # to be reused is copied to a free CPU block first and stays findable by hash, and a
    # later hit on it is copied back instead of recomputed (swapped requests come first)
    cpu_prefix_cache: bool = False
    # A level below the CPU tier, or below the GPU pool without one (engine/kv/tiers/disk.py):
    # cached blocks that disk_cache_min_hits prompts asked for beyond the first are
    # written behind to files in this folder as the pool above lets them go, and read
    # back when a prompt's prefix reaches them; up to disk_cache_bytes, least recently
    # used first out. It outlives the engine: one started again with the same model and
    # folder finds its blocks. None: no disk tier
    # The most of the GPU pool that pinned prefixes may hold (a share, 0-1): a pin past it
    # is refused, naming it; an operator changes it live (LLMEngine.set_retention)
    pin_budget: float = 0.5
    # What the GPU pool's prefix cache evicts first when blocks run out (engine/kv/block_pool.py):
    # "lru" (least recently freed), "slru" (blocks never taken again before those hit),
    # "lfu" (the least hit), "priority" (the prefixes of the least important requests,
    # by scheduling priority); changed live with the pin budget
    eviction_policy: str = "lru"
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 10 * 2**30
    disk_cache_min_hits: int = 1
    # The deployment's secret (engine/keys.py): the disk tier seals its files with a key
    # derived from it (engine/kv/tiers/disk_seal.py), so that engines sharing it share the disk's
    # blocks; the migration port's keys and the tickets that allow each move come from
    # it too. The service gives every engine the same one, derived from its secret key
    # (kvops/engines/engine_config.py); None: the disk tier keeps a random key in its folder
    # (disk.key) and the migration port takes a random one (it then admits no one).
    # Never shown: not in repr, describe_config or a core's command line.
    secret: str | None = field(default=None, repr=False)
    # A model mixing sliding-window and global layers (Gemma 2, 3) keeps a block table
    # per layer group, so that its sliding layers give back what their window passed
    # (engine/kv/layout.py); off, or with cpu_prefix_cache: one table for every layer
    hybrid_kv_cache: bool = True
    preemption_mode: str = "recompute"  # what the scheduler does when blocks run out
    scheduling_policy: str = "fcfs"  # "priority": lower value runs first
    # The most of max_num_seqs one tenant (Request.tenant: a service's user) may hold
    # while others wait: their requests are admitted first, and under fcfs its requests
    # are preempted first. 1.0: no limit. Requests without a tenant (staff) are exempt.
    max_batch_share: float = 1.0
    # Each tenant's share of the GPU pool's cached blocks (engine/kv/tenant_cache.py):
    # a tenant holding more has its least recently used cached blocks evicted first, so
    # one tenant's flood does not evict another's prefix. 1.0: no quota. An operator sets
    # a tenant's own live (LLMEngine.set_tenant)
    tenant_cache_quota: float = 1.0
    # Who of the waiting goes first among requests of equal priority: "share" (arrival
    # order, with max_batch_share), or "vtc": the tenant served the fewest weighted
    # tokens so far (the virtual token counter, engine/sched/fairness.py)
    fairness: str = "share"
    # Tenants named in the metrics' kv_by_tenant (engine/observe/tenants.py) and in
    # /metrics' tenant label; the rest are added up as "other"
    metrics_top_tenants: int = 10
    device: str = "auto"
    dtype: str = "auto"
    # How K/V is stored: "auto" (the model's dtype) or fp8 ("fp8_e4m3", "fp8_e5m2": one
    # byte a value, twice the blocks in the same memory; kernels/fp8.py), with scales
    # calibrated at start-up per layer ("tensor") or per KV head ("head"), or 1 ("unit")
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "tensor"
    attention_backend: str = "auto"
    seed: int = 0
    simulate: bool = False  # run the real scheduler/KV manager with a stand-in model
    vocab_size: int = 32000  # simulate with simulate_tokenizer="bytes": the stand-in's vocabulary
    # simulate only: the stand-in's tokenizer. "default": the converted default model's
    # (token counts agree with a client's; bytes if it has not been converted), "bytes":
    # UTF-8 bytes in, syllables out (engine/detokenizer.SimTokenizer), or an HF folder.
    # With a real tokenizer the stand-in's vocabulary is the tokenizer's.
    simulate_tokenizer: str = "default"
    simulate_step_ms: float = 0.0  # simulate only: wall time a step takes (GPU-like pacing)
    simulate_token_us: float = 0.0  # simulate only: and this much more per computed token
    # simulate only: the K/V bytes per token of the model it stands for, carried by a
    # request that moves to another engine (0: only the stand-in's 8)
    simulate_kv_bytes_per_token: int = 0
    # simulate only: the stand-in model attends to this many last tokens on every layer
    # (its requests give back the blocks out of reach, as a sliding-window model's do)
    simulate_sliding_window: int | None = None
    # simulate only, with simulate_sliding_window: the stand-in has global layers too, in
    # a block table of their own beside the sliding layers' (a Gemma-like model: layer
    # groups, engine/kv/layout.py)
    simulate_hybrid: bool = False
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory the engine may use
    kv_cache_memory_bytes: int | None = None  # CPU: bytes for the KV pool (None: 512 MiB)
    name: str = "default"  # engine name, shown in snapshots
    max_pending_events: int = 100_000  # KV events kept for take_events(); oldest dropped
    # The KV history behind requests' KV stories (engine/observe/story.py): what happened to
    # this many of the newest block hashes (about 200 bytes each); 0: no history, no
    # stories
    kv_history_blocks: int = 100_000
    # with the history: the share of block hashes whose residency (lifetime, idle time
    # before eviction, gaps between hits) the metrics sample, as vLLM's
    # --kv-cache-metrics-sample
    kv_metrics_sample: float = 0.01
    # CPU, float32: the C++ kernels of kernels/cpu_ext.py: "on", "off" (torch's paths),
    # or "auto": on where the CPU has AVX-512, which they are written for (their tiles
    # assume 32 vector registers; with AVX2's 16 they spill, and torch's paths are 1.2-5x
    # faster there); True and False mean on and off. And who
    # does prefill's many-row matmuls: "auto" decides by the CPU's maker (the packed
    # kernel on AMD, where MKL takes a slow path; MKL elsewhere), "mkl" or "packed" say
    # so, "measure" times both at start-up. All but "measure" run the same code on the
    # same machine every time.
    cpu_kernels: str = "auto"
    large_matmuls: str = "auto"
    # Decode steps run eagerly, op by op, instead of as CUDA graphs captured at start-up
    # per padded batch size (engine/model/cuda_graphs.py; vLLM's name). Graphs need the
    # Triton backend on one GPU; models split over ranks, with a table per layer group or
    # with experts run eagerly whatever this says
    enforce_eager: bool = False
    # Schedule and issue the next step before a step's sampled tokens are read back to the
    # host (they feed the next step on the device), so that the host's work overlaps the
    # device's (engine/llm_engine.py, _step_ahead). None: on where the device is CUDA. The
    # tokens are the same either way; a request that stops computes one step more,
    # dropped. A model split over ranks, and the simulator, run a step at a time
    async_scheduling: bool | None = None
    # Split the model's heads and MLP across this many ranks (engine/model/parallel.py):
    # processes the engine starts, gloo on CPU, NCCL and one GPU each on CUDA
    tensor_parallel_size: int = 1
    # Publish prefix-cache events over ZMQ in vLLM's format (engine/observe/vllm_events.py):
    # e.g. "tcp://*:5557"; and a ROUTER for replay requests, e.g. "tcp://*:5558"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    # Where the core takes requests moving in from other engines (engine/transfer/link.py):
    # "" (the default: every engine on one machine) a socket file in a folder of its own
    # that only this user may enter (ipc://); else it binds this host's tcp `migration_port`
    # (0: a free one), a host the other engines reach on a private network ("0.0.0.0"
    # binds every interface and gives the machine's name). It tells its address to the
    # service. Over tcp the port speaks CurveZMQ with keys from `secret`.
    migration_host: str = ""
    migration_port: int = 0
    # Prefill/decode on separate engines: "prefill" runs prompts and hands each request
    # to the decode engine the router chose for it once its first token is out (it
    # decodes it itself if there is none, or the move fails); "decode" takes no routed
    # jobs while a prefill or "both" engine of its model runs, only the requests moved to
    # it; "both" (the default) does both
    role: str = "both"

    def __post_init__(self) -> None:
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0
               and self.block_size <= 128,
               f"block_size must be a power of two in [1, 128], got {self.block_size}")
        _check(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
               f"num_gpu_blocks must be >= 1 or None, got {self.num_gpu_blocks}")
        _check(self.num_cpu_blocks is None or self.num_cpu_blocks >= 0,
               f"num_cpu_blocks must be >= 0 or None, got {self.num_cpu_blocks}")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _check(0.0 < self.max_batch_share <= 1.0, "max_batch_share must be in (0, 1]")
        _check(0.0 < self.tenant_cache_quota <= 1.0, "tenant_cache_quota must be in (0, 1]")
        _check(1 <= self.metrics_top_tenants <= 100, "metrics_top_tenants must be in [1, 100]")
        _check(self.fairness in FAIRNESS_POLICIES,
               f"fairness must be one of {FAIRNESS_POLICIES}, got {self.fairness!r}")
        _check(self.max_model_len is None or self.max_model_len >= 2,
               "max_model_len must be >= 2 or None")
        _check(self.preemption_mode in PREEMPTION_MODES,
               f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _check(self.scheduling_policy in SCHEDULING_POLICIES,
               f"scheduling_policy must be one of {SCHEDULING_POLICIES}")
        _check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend must be one of {ATTENTION_BACKENDS}")
        _check(self.vocab_size >= 2, "vocab_size must be >= 2")
        _check(0.0 <= self.simulate_step_ms <= 60_000, "simulate_step_ms must be in [0, 60000]")
        _check(0 <= self.simulate_kv_bytes_per_token <= 1 << 24,
               "simulate_kv_bytes_per_token must be in [0, 16 MiB]")
        _check(0.0 <= self.simulate_token_us <= 1_000_000,
               "simulate_token_us must be in [0, 1000000]")
        _check(self.simulate_sliding_window is None or self.simulate_sliding_window >= 2,
               "simulate_sliding_window must be >= 2 or None")
        _check(not self.simulate_hybrid or self.simulate_sliding_window is not None,
               "simulate_hybrid needs simulate_sliding_window")
        _check(not self.simulate_hybrid or (self.hybrid_kv_cache and not self.cpu_prefix_cache),
               "simulate_hybrid models a table per layer group, which a model keeps only "
               "with hybrid_kv_cache on and cpu_prefix_cache off (with one table, model it "
               "without simulate_hybrid and simulate_sliding_window, in half as many blocks)")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        _check(self.max_pending_events >= 0, "max_pending_events must be >= 0")
        _check(self.kv_history_blocks >= 0, "kv_history_blocks must be >= 0")
        _check(0 <= self.migration_port < 65536, "migration_port must be in [0, 65535]")
        _check(self.role in ROLES, f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        _check(0.0 <= self.kv_metrics_sample <= 1.0, "kv_metrics_sample must be in [0, 1]")
        _check(1 <= self.tensor_parallel_size <= 64,
               f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}")
        _check(not (self.simulate and self.tensor_parallel_size > 1),
               "tensor_parallel_size > 1 needs a real model (simulate=False)")
        self.cpu_kernels = _on_off_auto("cpu_kernels", self.cpu_kernels)
        _check(self.large_matmuls in LARGE_MATMULS,
               f"large_matmuls must be one of {LARGE_MATMULS}, got {self.large_matmuls!r}")
        if self.preemption_mode == "swap" and self.num_cpu_blocks == 0:
            raise ConfigError("preemption_mode='swap' needs num_cpu_blocks > 0")
        if self.cpu_prefix_cache and self.num_cpu_blocks == 0:
            raise ConfigError("cpu_prefix_cache needs num_cpu_blocks > 0")
        if self.cpu_prefix_cache and not self.enable_prefix_caching:
            raise ConfigError("cpu_prefix_cache needs enable_prefix_caching")
        _check(self.disk_cache_bytes >= 0, "disk_cache_bytes must be >= 0")
        _check(0.0 <= self.pin_budget <= 1.0, "pin_budget must be in [0, 1]")
        _check(self.eviction_policy in EVICTION_POLICIES,
               f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
               f"got {self.eviction_policy!r}")
        _check(self.disk_cache_min_hits >= 0, "disk_cache_min_hits must be >= 0")
        _check(self.secret is None or (isinstance(self.secret, str) and len(self.secret) >= 32),
               "secret must be a string of at least 32 characters (e.g. 64 hex digits), "
               "or None")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
               f"got {self.kv_cache_dtype!r}")
        _check(not (self.simulate and self.kv_cache_dtype != "auto"),
               "kv_cache_dtype is a real model's: the simulator's stand-in K/V has no "
               "dtype (size a simulated pool with num_gpu_blocks)")
        _check(self.kv_cache_scales in KV_CACHE_SCALES,
               f"kv_cache_scales must be one of {', '.join(KV_CACHE_SCALES)}, "
               f"got {self.kv_cache_scales!r}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _on_off_auto(name: str, value: object) -> str:
    """"on", "off" or "auto" from a bool, one of those, or an environment spelling
    ("1", "0", "true", "false", "yes", "no")."""
    spelled = str(value).lower()
    if value is True or spelled in ("1", "true", "yes", "on"):
        return "on"
    if value is False or spelled in ("0", "false", "no", "off"):
        return "off"
    _check(spelled == "auto", f"{name} must be auto, on or off, got {value!r}")
    return "auto"
