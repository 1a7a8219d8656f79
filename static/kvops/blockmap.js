// One pool's blocks on a canvas, one square cell per block, painted straight into an
// ImageData (a delta repaints only the cells that changed, then puts back the rows it
// touched). A second canvas on top draws the selected request's block table as a path.
import { STATE } from "./colors.js";

const SMALL_CELL = 8;  // px: cells this small are painted pixel by pixel (65,536 blocks: 3 px)

export class BlockMap {
  constructor(canvas, overlay, palette, { maxHeight = 640, maxCell = 18 } = {}) {
    this.canvas = canvas;
    this.overlay = overlay;
    this.ctx = canvas.getContext("2d");
    this.octx = overlay.getContext("2d");
    this.palette = palette;
    this.maxHeight = maxHeight;
    this.maxCell = maxCell;
    this.pool = null;  // {n, state, ref_cnt, owner, hash32}
    this.evictRank = null;  // Int32Array: place in the eviction order, -1 if not in it
    this.mask = null;  // Uint8Array: 1 for the selected request's blocks
    // a used cell's colour key from its owner's request index (null: the index itself,
    // a colour per request; the "by tenant" mode gives one per tenant: tenant_kv.js)
    this.keyOf = null;
    this.cachedKey = null;  // in a colouring mode: a cached cell's key from its tenant32
    this.path = [];  // the selected request's table, in order
    this.base = 0;  // colors()'s answer: the cell's colour and its dot's
    this.dot = 0;
    this.hover = -1;
    this.fitted = null;  // [n, width]: what the canvas was last sized for
    this.dirtyLo = Infinity;
    this.dirtyHi = -1;
  }

  // Cell size: the largest that fits the width and maxHeight (at least 2 px).
  layout(n, width) {
    let cell = this.maxCell;
    while (cell > 2 && Math.ceil(n / Math.floor(width / cell)) * cell > this.maxHeight) cell--;
    this.cell = cell;
    this.gap = cell >= 5 ? 1 : 0;
    this.cols = Math.max(1, Math.floor(width / cell));
    this.rows = Math.ceil(n / this.cols);
    const w = this.cols * cell, h = Math.max(1, this.rows * cell);
    for (const c of [this.canvas, this.overlay]) { c.width = w; c.height = h; }
    this.image = this.ctx.createImageData(w, h);
    this.pixels = new Uint32Array(this.image.data.buffer);
    this.width = w;
  }

  // Show another pool (a snapshot, a moment of the timeline). The canvas is sized again
  // only when the block count or the width changed: resizing it clears and reallocates it.
  attach(pool, evictRank, width) {
    this.pool = pool;
    this.evictRank = evictRank;
    this.mask = null;
    this.path = [];
    if (this.fitted === null || this.fitted[0] !== pool.n || this.fitted[1] !== width) {
      this.layout(pool.n, width);
      this.fitted = [pool.n, width];
    }
    this.paintAll();
  }

  // Show another pool of the same size, keeping what is painted: the caller repaints the
  // cells where the two differ (the timeline's first move away from the live state).
  swap(pool, evictRank) {
    if (pool.n !== this.pool.n) throw new Error(`swap: a pool of ${pool.n} blocks for a map of ${this.pool.n}`);
    this.pool = pool;
    this.evictRank = evictRank;
  }

  // A cell's colour and its dot's (0: none), left in this.base and this.dot (no array
  // per cell: the timeline repaints thousands of cells a position).
  colors(i) {
    const p = this.pool, pal = this.palette;
    const dimmed = this.mask !== null && this.mask[i] === 0;
    const s = p.state[i];
    if (s === STATE.used) {
      this.base = pal.ownerColor(this.keyOf === null ? p.owner[i] : this.keyOf(p.owner[i]), dimmed);
      this.dot = !dimmed && p.ref_cnt[i] > 1 ? pal.sharedDot : 0;
    } else if (s === STATE.cached) {
      const evict = !dimmed && this.evictRank !== null && this.evictRank[i] >= 0;
      const t = this.cachedKey !== null ? p.tenant32[i] : 0;
      this.base = t ? pal.cachedTint(this.cachedKey(t), dimmed) : dimmed ? pal.cachedDim : pal.cached;
      this.dot = evict ? pal.evictDot : 0;
    } else if (s === STATE.pinned) {
      this.base = dimmed ? pal.pinnedDim : pal.pinned;
      this.dot = dimmed ? 0 : pal.pinDot;
    } else {
      this.base = dimmed ? pal.freeDim : pal.free;
      this.dot = 0;
    }
  }

  paintCell(i) {
    this.colors(i);
    const base = this.base, dot = this.dot;
    const s = this.cell, inner = s - this.gap, W = this.width, px = this.pixels;
    const x0 = (i % this.cols) * s, y0 = Math.floor(i / this.cols) * s;
    if (inner <= SMALL_CELL) {  // a few pixels a row: plain stores beat fill()'s call
      for (let y = 0; y < inner; y++) {
        const at = (y0 + y) * W + x0;
        for (let x = 0; x < inner; x++) px[at + x] = base;
      }
    } else {
      for (let y = 0; y < inner; y++) px.fill(base, (y0 + y) * W + x0, (y0 + y) * W + x0 + inner);
    }
    if (dot && inner >= 3) {
      const d = inner >= 7 ? Math.round(inner / 3) : 1, c = (inner - d) >> 1;
      for (let y = 0; y < d; y++) px.fill(dot, (y0 + c + y) * W + x0 + c, (y0 + c + y) * W + x0 + c + d);
    }
    const row = Math.floor(i / this.cols);
    if (row < this.dirtyLo) this.dirtyLo = row;
    if (row > this.dirtyHi) this.dirtyHi = row;
  }

  paintAll() {
    this.pixels.fill(this.palette.background);
    for (let i = 0; i < this.pool.n; i++) this.paintCell(i);
    this.flush();
    this.drawOverlay();
  }

  paint(ids) {
    for (let k = 0; k < ids.length; k++) if (ids[k] < this.pool.n) this.paintCell(ids[k]);
  }

  flush() {
    if (this.dirtyHi < 0) return;
    const y = this.dirtyLo * this.cell, h = (this.dirtyHi - this.dirtyLo + 1) * this.cell;
    this.ctx.putImageData(this.image, 0, 0, 0, y, this.width, h);
    this.dirtyLo = Infinity;
    this.dirtyHi = -1;
  }

  // Colour used cells by owner request (null) or by the key keyOf(owner index) gives,
  // and cached cells grey (null) or in a light tint of the key cachedKey(tenant32) gives.
  colourBy(keyOf, cachedKey = null) {
    this.keyOf = keyOf;
    this.cachedKey = cachedKey;
    if (this.pool) this.paintAll();
  }

  // Highlight one request's blocks (its table, in order), or none (null).
  select(table) {
    if (table && !table.length) table = null;  // nothing of it in this pool: dim nothing
    this.path = table ? table.slice() : [];
    this.mask = table ? new Uint8Array(this.pool.n) : null;
    if (table) for (const id of table) if (id < this.pool.n) this.mask[id] = 1;
    this.paintAll();  // which cells are dimmed changed everywhere (a click, not a delta)
  }

  // The selected request's table changed in a delta.
  updateSelection(table) {
    if (this.mask === null || !table.length) { this.select(table); return; }
    const grew = table.length >= this.path.length && this.path.every((id, k) => table[k] === id);
    if (!grew) { this.select(table); return; }
    const added = table.slice(this.path.length);
    for (const id of added) if (id < this.pool.n) this.mask[id] = 1;
    this.path = table.slice();
    this.paint(added);
    this.drawOverlay();
  }

  center(id) {
    return [(id % this.cols) * this.cell + (this.cell - this.gap) / 2,
            Math.floor(id / this.cols) * this.cell + (this.cell - this.gap) / 2];
  }

  drawOverlay() {
    const g = this.octx;
    g.clearRect(0, 0, this.overlay.width, this.overlay.height);
    if (this.path.length) {
      g.lineJoin = "round";
      for (const [width, color] of [[3.5, "rgba(255,255,255,.9)"], [1.5, "#161b26"]]) {
        g.beginPath();
        this.path.forEach((id, k) => { const [x, y] = this.center(id); k ? g.lineTo(x, y) : g.moveTo(x, y); });
        g.lineWidth = width;
        g.strokeStyle = color;
        g.stroke();
      }
      const r = Math.max(3, this.cell * 0.6);
      const [sx, sy] = this.center(this.path[0]);
      g.fillStyle = "#161b26";
      g.beginPath(); g.arc(sx, sy, r, 0, 2 * Math.PI); g.fill();
      const [ex, ey] = this.center(this.path[this.path.length - 1]);
      g.strokeStyle = "#161b26"; g.lineWidth = 2;
      g.beginPath(); g.arc(ex, ey, r, 0, 2 * Math.PI); g.stroke();
    }
    if (this.hover >= 0) {
      const x = (this.hover % this.cols) * this.cell, y = Math.floor(this.hover / this.cols) * this.cell;
      g.strokeStyle = "#000"; g.lineWidth = 1;
      g.strokeRect(x - 1.5, y - 1.5, this.cell + 2, this.cell + 2);
    }
  }

  // The block under a mouse position, or -1.
  blockAt(event) {
    const rect = this.canvas.getBoundingClientRect();
    const x = Math.floor((event.clientX - rect.left) / this.cell);
    const y = Math.floor((event.clientY - rect.top) / this.cell);
    if (x < 0 || x >= this.cols || y < 0) return -1;
    const id = y * this.cols + x;
    return id < this.pool.n ? id : -1;
  }

  setHover(id) {
    if (id === this.hover) return;
    this.hover = id;
    this.drawOverlay();
  }
}
