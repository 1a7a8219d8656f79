// Small formatting and DOM helpers shared by the pages.

export function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => (
    { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

const FORMATS = [];  // Intl.NumberFormat per number of digits (making one is slow)

export function num(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  FORMATS[digits] ??= new Intl.NumberFormat("en-US", { maximumFractionDigits: digits,
                                                       minimumFractionDigits: digits });
  return FORMATS[digits].format(value);
}

// A count and its noun, the noun plural unless the count is 1: "1 block", "3 blocks".
// `many`: a plural that is not the noun and "s".
export function plural(n, noun, many = `${noun}s`) {
  return `${num(n)} ${n === 1 ? noun : many}`;
}

// KV block-seconds (blocks held x seconds: engine/kv/block_seconds.py), a tenth under 10.
export function blockSeconds(value) {
  return num(value, value !== null && value !== undefined && Math.abs(value) < 10 ? 1 : 0);
}

export function pct(fraction, digits = 1) {
  if (fraction === null || fraction === undefined || Number.isNaN(fraction)) return "–";
  return `${(100 * fraction).toFixed(digits)}%`;
}

// A size in bytes in binary units: "512 B", "47 KiB", "1.5 MiB", "10 GiB".
const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

export function byteSize(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  let value = n, unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) { value /= 1024; unit++; }
  const digits = unit > 0 && value < 10 && !Number.isInteger(value) ? 1 : 0;
  return `${num(value, digits)} ${UNITS[unit]}`;
}

export function clock(ts) {  // seconds since the epoch -> HH:MM:SS.mmm (local time)
  const d = new Date(ts * 1000);
  return d.toTimeString().slice(0, 8) + "." + String(d.getMilliseconds()).padStart(3, "0");
}

export function when(iso) {  // time of day for today, date and time before
  if (!iso) return "–";
  const d = new Date(iso);
  const time = d.toLocaleTimeString(undefined, { hour12: false });
  return d.toDateString() === new Date().toDateString() ? time : `${d.toLocaleDateString()} ${time}`;
}

export function seconds(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(2)} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

export function $(selector, root = document) { return root.querySelector(selector); }

export function toast(message, bad = false) {
  const box = document.getElementById("toasts");
  if (!box) return;
  const el = document.createElement("div");
  el.className = bad ? "toast bad" : "toast";
  el.textContent = message;
  box.appendChild(el);
  setTimeout(() => el.remove(), 5000);
}

// (guarded: node's unit tests import these helpers without a page)
export const operator = typeof document !== "undefined" && document.body?.dataset.operator === "1";
