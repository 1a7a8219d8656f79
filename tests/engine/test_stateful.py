"""Random sequences of everything an engine and its operators can do, with the KV
bookkeeping checked after every step."""
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import EngineError, SamplingParams
from engine.kv.layout import group_hash
from engine.model.simulated_runner import _SEED, digest
from engine.request import RequestStatus

from .sim import expected, sim_engine

PREFIXES = [list(range(10, 18)), list(range(40, 53)), [7] * 6]
BLOCK = 4
TENANTS = [None, "A", "B"]


class EngineMachine(RuleBasedStateMachine):
    mode = "recompute"
    cpu_tier = False  # the CPU pool is a second-level prefix cache too
    # global layers and sliding ones (window 6) with a block table each (engine/kv/group.py)
    hybrid = False
    # tenants' quota on the cached blocks (engine/kv/tenant_cache.py) and fairness
    tenant_quota = 1.0
    fairness = "share"

    def __init__(self):
        super().__init__()
        hybrid = dict(simulate_sliding_window=6, simulate_hybrid=True) if self.hybrid else {}
        self.engine = sim_engine(block_size=BLOCK, num_gpu_blocks=28 if self.hybrid else 20,
                                 num_cpu_blocks=10, max_num_batched_tokens=24, max_num_seqs=6,
                                 preemption_mode=self.mode, cpu_prefix_cache=self.cpu_tier,
                                 tenant_cache_quota=self.tenant_quota, fairness=self.fairness,
                                 **hybrid)
        self.n = 0
        self.prompts = {}
        self.requests = []  # every Request object added, finished ones too
        self.hash_tokens = {}  # block hash -> the token prefix it names

    # --- rules ------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 999), max_size=6),
          max_tokens=st.integers(1, 12), tenant=st.sampled_from(TENANTS))
    def add(self, prefix, suffix, max_tokens, tenant):
        prompt = prefix + suffix
        rid = f"r{self.n}"
        self.n += 1
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens),
                                tenant=tenant)
        self.prompts[rid] = (prompt, max_tokens)
        self.requests.append(self.engine.scheduler.requests[rid])

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 999), max_size=6),
          max_tokens=st.integers(1, 12), n=st.integers(2, 3), tenant=st.sampled_from(TENANTS))
    def fork(self, prefix, suffix, max_tokens, n, tenant):
        """n samples of one prompt: shared blocks, copy-on-write of the partial one."""
        prompt = prefix + suffix
        rid = f"r{self.n}"
        self.n += 1
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n),
                                tenant=tenant)
        self.prompts[rid] = (prompt, max_tokens)
        self.requests.append(self.engine.scheduler.requests[rid])

    @rule(n=st.integers(1, 3))
    def step(self, n):
        for _ in range(n):
            for out in self.engine.step():
                if out.finished and out.finish_reason != "abort":
                    # a sample "r3/1" of a fork is checked against its parent's prompt
                    prompt, max_tokens = self.prompts[out.request_id.split("/")[0]]
                    assert out.output_token_ids == expected(prompt, max_tokens)
            self.requests.extend(r for r in self.engine.scheduler.requests.values()
                                 if r.parent_id is not None and r not in self.requests)

    def _pick(self, data, status):
        live = [r.request_id for r in self.engine.scheduler.requests.values()
                if status is None or r.status == status]
        return data.draw(st.sampled_from(live)) if live else None

    @rule(data=st.data())
    def abort(self, data):
        rid = self._pick(data, None)
        if rid:
            self.engine.abort(rid)

    @rule(data=st.data())
    def preempt(self, data):
        rid = self._pick(data, RequestStatus.RUNNING)
        if rid:
            self.engine.preempt(rid)

    @rule(data=st.data())
    def swap_out(self, data):
        rid = self._pick(data, RequestStatus.RUNNING)
        if rid:
            try:
                self.engine.swap_out(rid)
            except EngineError:
                pass  # CPU pool full: refused, nothing changed (checked by the invariants)

    @rule(data=st.data())
    def swap_in(self, data):
        rid = self._pick(data, RequestStatus.SWAPPED)
        if rid:
            try:
                self.engine.swap_in(rid)
            except EngineError:
                pass

    @rule(n=st.one_of(st.none(), st.integers(0, 5)))
    def evict(self, n):
        self.engine.evict_cached_blocks(n)

    @rule(prefix=st.sampled_from(PREFIXES), pin=st.booleans())
    def pin(self, prefix, pin):
        try:
            (self.engine.pin_prefix if pin else self.engine.unpin_prefix)(prefix)
        except EngineError:
            pass

    @rule(tenant=st.sampled_from(TENANTS[1:]),
          share=st.one_of(st.none(), st.sampled_from([0.1, 0.3, 1.0])))
    def tenant_quota_live(self, tenant, share):
        if share is None:
            self.engine.set_tenant(tenant, clear=("cache_quota",))
        else:
            self.engine.set_tenant(tenant, cache_quota=share)

    @precondition(lambda self: self.n % 7 == 3)
    @rule()
    def reset(self):
        self.engine.reset_prefix_cache()

    # --- invariants -------------------------------------------------------------------
    @invariant()
    def bookkeeping(self):
        self.engine.kv.check_invariants()
        scheduler = self.engine.scheduler  # the live requests that will fork, and only they
        assert {id(r) for r in scheduler.unforked} == {
            id(r) for r in scheduler.requests.values() if r.fork_pending}

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self):
        for r in self.requests:
            for i, h in enumerate(r.block_hashes):
                self.hash_tokens.setdefault(h, r.all_token_ids[:(i + 1) * BLOCK])
                if self.hybrid:  # the sliding group's block of the same tokens
                    self.hash_tokens.setdefault(group_hash(h, 1), r.all_token_ids[:(i + 1) * BLOCK])
        kv, runner = self.engine.kv, self.engine.runner
        for pool, cache in ((kv.gpu, runner.gpu_cache), (kv.cpu, runner.cpu_cache)):
            for h, block in pool.cached.items():
                tokens = self.hash_tokens[h]
                state, want = _SEED, []
                for t in tokens:
                    state = digest(state, t)
                    want.append(state)
                got = cache[block.block_id * BLOCK:(block.block_id + 1) * BLOCK]
                assert np.array_equal(got, np.array(want[-BLOCK:], dtype=np.uint64)), \
                    f"{pool.pool} block {block.block_id} does not hold the tokens of its hash"

    def teardown(self):
        # Drain: everything still live must finish correctly and leave no block held.
        for rid in [r.request_id for r in self.engine.scheduler.requests.values()
                    if r.parked]:
            self.engine.abort(rid)
        steps = 0
        while self.engine.has_unfinished_requests():
            self.step(1)
            steps += 1
            assert steps < 2000, "engine made no progress"
        self.engine.reset_prefix_cache()  # drops pins too
        self.engine.kv.check_invariants()
        assert self.engine.kv.gpu.num_free == self.engine.kv.gpu.num_blocks
        assert self.engine.kv.cpu.num_free == self.engine.kv.cpu.num_blocks


class SwapEngineMachine(EngineMachine):
    mode = "swap"


class CpuTierMachine(EngineMachine):
    cpu_tier = True


class CpuTierSwapMachine(EngineMachine):
    mode = "swap"
    cpu_tier = True


class HybridMachine(EngineMachine):
    hybrid = True


class HybridSwapMachine(EngineMachine):
    mode = "swap"
    hybrid = True


class TenantsMachine(EngineMachine):
    """A quota of a fifth of the pool per tenant, and fairness "vtc"."""
    tenant_quota = 0.2
    fairness = "vtc"


class TenantsSwapCpuTierMachine(TenantsMachine):
    mode = "swap"
    cpu_tier = True


class VtcMachine(EngineMachine):
    """fairness "vtc" without a quota: its preemptions for a lighter tenant, the heavier
    tenants' prompt chunks after its admission, admission past a pick that waits for
    blocks, and who gives way when the pool runs out."""
    fairness = "vtc"


class VtcSwapCpuTierMachine(VtcMachine):
    mode = "swap"
    cpu_tier = True


_settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestRecompute = EngineMachine.TestCase
TestRecompute.settings = _settings
TestSwap = SwapEngineMachine.TestCase
TestSwap.settings = _settings
TestCpuTier = CpuTierMachine.TestCase
TestCpuTier.settings = _settings
TestCpuTierSwap = CpuTierSwapMachine.TestCase
TestCpuTierSwap.settings = _settings
TestHybrid = HybridMachine.TestCase
TestHybrid.settings = _settings
TestHybridSwap = HybridSwapMachine.TestCase
TestHybridSwap.settings = _settings
TestTenants = TenantsMachine.TestCase
TestTenants.settings = _settings
TestTenantsSwapCpuTier = TenantsSwapCpuTierMachine.TestCase
TestTenantsSwapCpuTier.settings = _settings
TestVtc = VtcMachine.TestCase
TestVtc.settings = _settings
TestVtcSwapCpuTier = VtcSwapCpuTierMachine.TestCase
TestVtcSwapCpuTier.settings = _settings
