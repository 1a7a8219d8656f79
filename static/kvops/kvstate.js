// An engine's KV state in the browser: built from a snapshot, kept current by deltas
// (docs/live-protocol.md). Per-block arrays are typed arrays; requests keep their block
// tables as plain arrays in block-table order.

export const ARRAYS = ["state", "ref_cnt", "owner", "hash32", "tenant32"];
const TYPED = { "|u1": Uint8Array, "<u1": Uint8Array, "|i1": Int8Array, "<i2": Int16Array,
                "<u2": Uint16Array, "<i4": Int32Array, "<u4": Uint32Array };

function base64Bytes(text) {
  if (Uint8Array.fromBase64) return Uint8Array.fromBase64(text);
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

// A per-block array of a snapshot: a JSON list or {dtype, data (base64, little-endian)}.
export function decodeArray(obj) {
  if (Array.isArray(obj)) return Int32Array.from(obj);
  const bytes = base64Bytes(obj.data);
  if (obj.dtype === "<i8" || obj.dtype === "<u8") {
    const wide = new BigInt64Array(bytes.buffer, 0, bytes.length / 8);
    return Int32Array.from(wide, (v) => Number(v));
  }
  const Kind = TYPED[obj.dtype];
  if (!Kind) throw new Error(`unknown array dtype ${obj.dtype}`);
  return new Kind(bytes.buffer, 0, bytes.length / Kind.BYTES_PER_ELEMENT);
}

function pool(arrays) {
  const p = { n: 0 };
  for (const k of ARRAYS) if (arrays[k] !== undefined) p[k] = decodeArray(arrays[k]);
  // Widen so deltas can hold any count (the wire may send narrow dtypes).
  p.ref_cnt = Int32Array.from(p.ref_cnt);
  p.owner = Int32Array.from(p.owner);
  p.state = Uint8Array.from(p.state);
  p.n = p.state.length;
  // A sealed state (a plain user's: kvops/dashboard/visibility.py) has no hashes: all 0, "none"
  p.hash32 = p.hash32 ? Uint32Array.from(p.hash32) : new Uint32Array(p.n);
  // A cached block's tenant key (engine/observe/tenants.py tenant32; 0: none known)
  p.tenant32 = p.tenant32 ? Uint32Array.from(p.tenant32) : new Uint32Array(p.n);
  return p;
}

function copyPool(p) {
  return { n: p.n, state: p.state.slice(), ref_cnt: p.ref_cnt.slice(), owner: p.owner.slice(),
           hash32: p.hash32.slice(), tenant32: p.tenant32.slice() };
}


const SCALARS = ["engine", "epoch", "seq", "step", "ts", "stale", "sealed", "config", "blockStates", "metrics"];

export function ungap(gaps) {  // [5, 1, 1, 13] -> [5, 6, 7, 20]
  const out = new Array(gaps.length);
  let v = 0;
  for (let i = 0; i < gaps.length; i++) { v += gaps[i]; out[i] = v; }
  return out;
}

export class KVState {
  constructor(snapshot) {
    this.engine = snapshot.engine;
    this.epoch = snapshot.epoch;
    this.seq = snapshot.seq;
    this.step = snapshot.step;
    this.ts = snapshot.ts;
    this.stale = Boolean(snapshot.stale);
    this.sealed = Boolean(snapshot.sealed);  // no hashes: a plain user's view
    this.config = snapshot.config;
    this.blockStates = snapshot.block_states;
    this.gpu = pool(snapshot.gpu);
    this.cpu = pool(snapshot.cpu);
    this.requests = new Map();
    for (const r of snapshot.requests) this.requests.set(r.index, { ...r });
    this.metrics = snapshot.metrics;
    this.evictRank = new Int32Array(this.gpu.n).fill(-1);  // (a queue may pass 32,767 blocks)
    this.setEvictionOrder(snapshot.eviction_order || []);
    this.disown();
  }

  // Copy on write: clone() and restore() share request objects and their block tables
  // between states (a replay's checkpoints and the state it shows), so neither copies a
  // thousand requests. A state changes only the objects and tables it owns, copying a
  // shared one at its first change (ownRequest, appendToTable). After a clone neither side
  // owns anything.
  disown() {
    this.owned = new WeakSet();
  }

  ownRequest(index) {
    const r = this.requests.get(index);
    if (!r || this.owned.has(r)) return r;
    const mine = { ...r };
    this.owned.add(mine);
    this.requests.set(index, mine);
    return mine;
  }

  // Append op's blocks (op[1..]) to a request's table: in place if this state owns the
  // table, else into a copy made at its new size (one allocation, not a copy and then
  // its growth: a seek after a restore copies hundreds of tables, and the garbage they
  // leave is what makes the browser pause to collect it).
  appendToTable(r, key, op) {
    const table = r[key];
    if (this.owned.has(table)) {
      for (let i = 1; i < op.length; i++) table.push(op[i]);
      return;
    }
    const n = table.length, grown = new Array(n + op.length - 1);
    for (let i = 0; i < n; i++) grown[i] = table[i];
    for (let i = 1; i < op.length; i++) grown[n + i - 1] = op[i];
    this.owned.add(grown);
    r[key] = grown;
  }

  setEvictionOrder(order) {
    const touched = this.evictionOrder || [];
    for (const id of touched) this.evictRank[id] = -1;
    this.evictionOrder = order;
    order.forEach((id, rank) => { if (id < this.evictRank.length) this.evictRank[id] = rank; });
    return touched.concat(order);
  }

  // An independent copy: deltas applied to it leave this state as it is (a replay keeps
  // its keyframe this way).
  clone() {
    const copy = Object.create(KVState.prototype);
    for (const k of SCALARS) copy[k] = this[k];
    copy.gpu = copyPool(this.gpu);
    copy.cpu = copyPool(this.cpu);
    copy.requests = new Map(this.requests);
    copy.evictRank = this.evictRank.slice();
    copy.evictionOrder = this.evictionOrder.slice();
    copy.disown();
    this.disown();
    return copy;
  }

  // Become a copy of `other`, a state of pools of the same sizes, keeping this state's
  // per-block arrays (a map attached to them stays attached). Returns the block ids whose
  // place in the eviction order may have changed.
  restore(other) {
    if (other.gpu.n !== this.gpu.n || other.cpu.n !== this.cpu.n) {
      throw new Error(`restore: pools of ${other.gpu.n}/${other.cpu.n} blocks into ${this.gpu.n}/${this.cpu.n}`);
    }
    for (const name of ["gpu", "cpu"]) for (const k of ARRAYS) this[name][k].set(other[name][k]);
    for (const k of SCALARS) this[k] = other[k];
    this.requests = new Map(other.requests);
    this.disown();
    return this.setEvictionOrder(other.evictionOrder.slice());
  }

  // True if the delta follows the state (same publisher run, next sequence number).
  follows(delta) { return delta.epoch === this.epoch && delta.seq === this.seq + 1; }

  // Apply a delta that follows(); returns what changed, for painting.
  apply(delta) {
    this.seq = delta.seq;
    this.step = delta.step;
    this.ts = delta.ts;
    const changed = { gpu: [], cpu: [], tables: new Set(), requests: false, removed: [],
                      structural: false };  // structural: requests came, went or changed status
    for (const name of ["gpu", "cpu"]) {
      const blocks = delta[name];
      if (!blocks) continue;
      const p = this[name];
      const ids = ungap(blocks.ids);
      for (let i = 0; i < ids.length; i++) {
        const id = ids[i];
        p.state[id] = blocks.state[i];
        p.ref_cnt[id] = blocks.ref_cnt[i];
        p.owner[id] = blocks.owner[i];
        if (blocks.hash32) p.hash32[id] = blocks.hash32[i];
        if (blocks.tenant32) p.tenant32[id] = blocks.tenant32[i];
      }
      changed[name] = ids;
    }
    if (delta.requests) this.applyRequests(delta.requests, changed);
    if (delta.tables) this.applyTables(delta.tables, changed);
    if (delta.eviction_order) changed.gpu = changed.gpu.concat(this.setEvictionOrder(delta.eviction_order));
    this.metrics = delta.metrics;
    return changed;
  }

  applyRequests(changes, changed) {
    for (const entry of changes.upsert || []) {
      const old = this.requests.get(entry.index) || { block_table: [], cpu_block_table: [] };
      const r = { ...old, ...entry };  // (its tables stay old's until changed)
      this.owned.add(r);
      this.requests.set(entry.index, r);
    }
    for (const index of changes.removed || []) {
      this.requests.delete(index);
      changed.removed.push(index);
    }
    changed.structural = Boolean((changes.upsert && changes.upsert.length) || changed.removed.length);
    const p = changes.progress;
    if (p) {
      let index = 0;
      for (let i = 0; i < p.index.length; i++) {
        index += p.index[i];
        const r = this.ownRequest(index);
        if (!r) continue;
        r.num_computed_tokens += p.computed[i];
        r.num_output_tokens += p.output[i];
      }
    }
    changed.requests = true;
  }

  applyTables(tables, changed) {
    for (const [name, key] of [["gpu", "block_table"], ["cpu", "cpu_block_table"]]) {
      const ops = tables[name];
      if (!ops) continue;
      for (const op of ops.append) {
        const r = this.ownRequest(op[0]);
        if (!r) continue;
        this.appendToTable(r, key, op);
        changed.tables.add(op[0]);
      }
      for (const op of ops.set) {
        const r = this.ownRequest(op[0]);
        if (r) {
          r[key] = op.slice(1);
          this.owned.add(r[key]);
        }
        changed.tables.add(op[0]);
      }
    }
  }

  requestById(requestId) {
    for (const r of this.requests.values()) if (r.request_id === requestId) return r;
    return null;
  }

  // Every request holding a block, with the block's place in its table.
  holders(poolName, id) {
    const key = poolName === "gpu" ? "block_table" : "cpu_block_table";
    const out = [];
    for (const r of this.requests.values()) {
      const at = r[key].indexOf(id);
      if (at >= 0) out.push({ request: r, position: at });
    }
    return out;
  }
}
