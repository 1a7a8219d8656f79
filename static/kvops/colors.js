// Colours of KV blocks. The block map paints them into an ImageData (packed RGBA in a
// Uint32Array, little-endian: 0xAABBGGRR); the legend and the request table use the CSS
// forms. docs/engine-page.md explains each one.

export const STATE = { free: 0, used: 1, cached: 2, pinned: 3 };
export const CSS = {
  free: "#e9ecf1",       // free, no data worth keeping
  cached: "#9aa6b8",     // ref count 0, still in the prefix cache (reusable until evicted)
  pinned: "#2a2622",     // held by a pin, never evicted
  pinDot: "#f2b400",     // the dot on a pinned block
  sharedDot: "#ffffff",  // ref count > 1: a prefix shared by several requests
  evictDot: "#e0241b",   // among the next blocks the free queue gives out: loses its data
  background: "#ffffff",
};
// Where a prompt block's K/V came from, in a job's KV story (kv_story.js): found in the
// GPU pool's prefix cache, found in the CPU tier, or computed for the request.
export const SOURCE_CSS = { gpu: "#1d8a4e", cpu: "#8a5cd6", computed: "#e3a33b" };
const GOLDEN_ANGLE = 137.508;

export function ownerHue(index) { return (index * GOLDEN_ANGLE) % 360; }
export function ownerCss(index, light = 48) { return `hsl(${ownerHue(index).toFixed(1)} 70% ${light}%)`; }

function pack(r, g, b) { return ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0; }

function hexToRgb(hex) {
  const v = parseInt(hex.slice(1), 16);
  return [(v >> 16) & 255, (v >> 8) & 255, v & 255];
}

function hslToRgb(h, s, l) {
  s /= 100; l /= 100;
  const k = (n) => (n + h / 30) % 12;
  const a = s * Math.min(l, 1 - l);
  const f = (n) => l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)));
  return [Math.round(255 * f(0)), Math.round(255 * f(8)), Math.round(255 * f(4))];
}

// Mixed toward white: how blocks outside the selected request are drawn.
function dim([r, g, b], amount = 0.78) {
  return [r + (255 - r) * amount, g + (255 - g) * amount, b + (255 - b) * amount].map(Math.round);
}

export class Palette {
  constructor() {
    this.hues = 720;  // owner hues, quantised
    this.owner = new Uint32Array(this.hues);
    this.ownerDim = new Uint32Array(this.hues);
    this.tint = new Uint32Array(this.hues);  // cached blocks coloured by owner: lighter
    this.tintDim = new Uint32Array(this.hues);
    for (let i = 0; i < this.hues; i++) {
      const rgb = hslToRgb(i / 2, 70, 48);
      this.owner[i] = pack(...rgb);
      this.ownerDim[i] = pack(...dim(rgb));
      const light = hslToRgb(i / 2, 45, 78);
      this.tint[i] = pack(...light);
      this.tintDim[i] = pack(...dim(light));
    }
    const named = (hex) => [pack(...hexToRgb(hex)), pack(...dim(hexToRgb(hex)))];
    [this.free, this.freeDim] = named(CSS.free);
    [this.cached, this.cachedDim] = named(CSS.cached);
    [this.pinned, this.pinnedDim] = named(CSS.pinned);
    [this.pinDot] = named(CSS.pinDot);
    [this.sharedDot] = named(CSS.sharedDot);
    [this.evictDot] = named(CSS.evictDot);
    [this.background] = named(CSS.background);
  }

  ownerColor(index, dimmed) {
    const i = Math.floor(ownerHue(index) * 2) % this.hues;
    return dimmed ? this.ownerDim[i] : this.owner[i];
  }

  // A cached cell in a colouring mode: its key's hue, lighter than a used cell's.
  cachedTint(index, dimmed) {
    const i = Math.floor(ownerHue(index) * 2) % this.hues;
    return dimmed ? this.tintDim[i] : this.tint[i];
  }
}
