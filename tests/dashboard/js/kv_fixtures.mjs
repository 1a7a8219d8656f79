// Snapshots and deltas of a small engine, for the tests of the engine page's modules.

// A small engine: 8 GPU blocks, 4 CPU blocks, request 1 holding GPU blocks 2 and 5.
export function snapshot({ epoch = "e1", seq = 10, stale = false } = {}) {
  return {
    type: "snapshot", engine: "t", epoch, seq, ts: 1000 + seq / 10, step: seq * 3, stale,
    block_states: ["free", "used", "cached", "pinned"],
    config: { block_size: 16, num_gpu_blocks: 8, num_cpu_blocks: 4 },
    gpu: { state: [0, 0, 1, 0, 0, 1, 0, 0], ref_cnt: [0, 0, 1, 0, 0, 1, 0, 0],
           owner: [0, 0, 1, 0, 0, 1, 0, 0], hash32: [0, 0, 7, 0, 0, 0, 0, 0] },
    cpu: { state: [0, 0, 0, 0], ref_cnt: [0, 0, 0, 0], owner: [0, 0, 0, 0], hash32: [0, 0, 0, 0] },
    requests: [{ index: 1, request_id: "r1", status: "running", num_prompt_tokens: 20,
                 num_computed_tokens: 20, num_output_tokens: 0, block_table: [2, 5], cpu_block_table: [] }],
    eviction_order: [0, 1],
    metrics: { kv_usage: 0.25, running: 1 },
  };
}

export function delta(seq, parts = {}, epoch = "e1") {
  return { type: "delta", engine: "t", epoch, seq, ts: 1000 + seq / 10, step: seq * 3,
           metrics: { kv_usage: 0.25, running: 1, seq }, ...parts };
}

// Request 1 grows into block 6; request 2 arrives with block 3; request 1 decodes 4 tokens.
export const GROW = delta(11, {
  gpu: { ids: [3, 3], state: [1, 1], ref_cnt: [1, 1], owner: [2, 1], hash32: [0, 0] },  // 3, 6
  tables: { gpu: { append: [[1, 6]], set: [[2, 3]] } },
  requests: { upsert: [{ index: 2, request_id: "r2", status: "running", num_prompt_tokens: 9,
                         num_computed_tokens: 9, num_output_tokens: 0 }],
              progress: { index: [1], computed: [4], output: [4] } },
  eviction_order: [0, 4],
});
// Request 1 finishes: its blocks go back (block 2 stays cached), it leaves the table.
export const FINISH = delta(12, {
  gpu: { ids: [2, 3, 1], state: [2, 0, 0], ref_cnt: [0, 0, 0], owner: [0, 0, 0], hash32: [7, 0, 0],
         tenant32: [3289118412, 0, 0] },  // 2, 5, 6 (2 cached, tenant "A"'s)
  tables: { gpu: { append: [], set: [[1]] } },
  requests: { removed: [1] },
});

// A seeded random number generator (mulberry32): the same history on every run.
export function random(seed) {
  let a = seed >>> 0;
  const next = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  return { next, int: (n) => Math.floor(next() * n) };
}

function gaps(ids) {
  let prev = 0;
  return ids.map((id) => { const g = id - prev; prev = id; return g; });
}

// A random delta that follows `state` (a KVState): blocks changed, requests added,
// progressing, growing, replaced and removed, the eviction order now and then.
export function randomDelta(state, rnd, dt = 0.1) {
  const d = { type: "delta", engine: state.engine, epoch: state.epoch, seq: state.seq + 1,
              ts: state.ts + dt, step: state.step + 1, metrics: { kv_usage: rnd.next(), seq: state.seq + 1 } };
  for (const [name, n] of [["gpu", state.gpu.n], ["cpu", state.cpu.n]]) {
    const ids = [...new Set(Array.from({ length: rnd.int(6) }, () => rnd.int(n)))].sort((a, b) => a - b);
    if (!ids.length) continue;
    d[name] = { ids: gaps(ids), state: ids.map(() => rnd.int(4)), ref_cnt: ids.map(() => rnd.int(3)),
                owner: ids.map(() => rnd.int(8)), hash32: ids.map(() => rnd.int(2 ** 32)) };
  }
  const live = [...state.requests.keys()].sort((a, b) => a - b);
  const requests = {};
  const tables = { gpu: { append: [], set: [] }, cpu: { append: [], set: [] } };
  if (live.length < 6 && rnd.next() < 0.4) {
    const index = Math.max(0, ...live) + 1;
    requests.upsert = [{ index, request_id: `r${index}`, status: "running", num_prompt_tokens: 10 + rnd.int(50),
                         num_computed_tokens: 0, num_output_tokens: 0 }];
    tables.gpu.set.push([index, rnd.int(state.gpu.n), rnd.int(state.gpu.n)]);
  }
  const rest = live.filter(() => rnd.next() < 0.5);
  const removed = rest.filter(() => rnd.next() < 0.15);
  const progressing = rest.filter((index) => !removed.includes(index));
  if (removed.length) requests.removed = removed;
  if (progressing.length) {
    requests.progress = { index: gaps(progressing), computed: progressing.map(() => 1 + rnd.int(20)),
                          output: progressing.map(() => rnd.int(2)) };
    for (const index of progressing) {
      if (rnd.next() < 0.3) tables.gpu.append.push([index, rnd.int(state.gpu.n)]);
      else if (rnd.next() < 0.1) tables.cpu.set.push([index, rnd.int(state.cpu.n)]);
    }
  }
  if (Object.keys(requests).length) d.requests = requests;
  if (tables.gpu.append.length + tables.gpu.set.length + tables.cpu.set.length) d.tables = tables;
  if (rnd.next() < 0.3) d.eviction_order = [...new Set(Array.from({ length: rnd.int(4) }, () => rnd.int(state.gpu.n)))];
  return d;
}

// A KVState written back as a snapshot document (per-block arrays as JSON lists).
export function toSnapshot(state) {
  const pool = (p) => ({ state: [...p.state], ref_cnt: [...p.ref_cnt], owner: [...p.owner], hash32: [...p.hash32] });
  return {
    type: "snapshot", engine: state.engine, epoch: state.epoch, seq: state.seq, ts: state.ts, step: state.step,
    block_states: state.blockStates, config: state.config, gpu: pool(state.gpu), cpu: pool(state.cpu),
    requests: [...state.requests.values()].map((r) => ({ ...r, block_table: [...r.block_table],
                                                        cpu_block_table: [...r.cpu_block_table] })),
    eviction_order: [...state.evictionOrder], metrics: state.metrics,
  };
}
