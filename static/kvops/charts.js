// Hand-drawn canvas charts: a sparkline and a small time-series chart with an axis label.

function fit(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
  }
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, w, h);
  return [g, w, h];
}

export function sparkline(canvas, values, color = "#2f5bd3") {
  const [g, w, h] = fit(canvas);
  if (values.length < 2) return;
  const max = Math.max(...values, 1e-9);
  g.beginPath();
  values.forEach((v, i) => {
    const x = (i / (values.length - 1)) * w, y = h - 2 - (v / max) * (h - 4);
    i ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.strokeStyle = color;
  g.lineWidth = 1.5;
  g.stroke();
  g.lineTo(w, h); g.lineTo(0, h); g.closePath();
  g.fillStyle = color + "22";
  g.fill();
}

// What a sparkline plots, for the line under it: its quantity and unit, the time it
// spans and its top (the largest value: the sparkline's scale runs from 0 to it).
// points: [[ts (Unix seconds), value], ...], oldest first.
export function sparkCaption(what, points) {
  if (points.length < 2) return what;
  const span = points[points.length - 1][0] - points[0][0];
  const window = span < 90 ? `${Math.max(1, Math.round(span))} s` : `${Math.round(span / 60)} min`;
  const top = Math.max(...points.map(([, v]) => v));
  return `${what}, last ${window} · max ${top.toFixed(top >= 100 || Number.isInteger(top) ? 0 : 1)}`;
}

// The y axis: ticks from 0 at a 1-2-5 step (1, 2, 5, 10, 20, ...), at most `count`
// steps, the last at or above `top` (it becomes the top of the scale). integer: counts
// and rates of events, never a step under 1. Every tick is distinct, and so are their
// labels (tickLabel): no "1, 1, 0" when the data peak at 1.
export function niceTicks(top, { count = 2, integer = false } = {}) {
  const peak = top > 0 && Number.isFinite(top) ? top : 1;
  const raw = peak / count;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 5, 10].map((m) => m * magnitude).find((s) => s >= raw * (1 - 1e-9));
  if (integer) step = Math.max(1, Math.round(step));
  const steps = Math.max(1, Math.ceil(peak / step - 1e-9));
  return Array.from({ length: steps + 1 }, (_, i) => Number((i * step).toPrecision(12)));
}

// A tick's label with as many decimals as the step between ticks needs.
export function tickLabel(value, ticks) {
  const step = ticks.length > 1 ? ticks[1] - ticks[0] : 1;
  const decimals = Math.min(12, Math.max(0, -Math.floor(Math.log10(step) + 1e-9)));
  return value.toFixed(decimals);
}

// series: [{label, color, values: [number|null], bars?: bool}], all the same length.
// max: top of the scale (null: from the data, rounded up to a tick); format: a tick's
// label (default tickLabel); integer: the data are counts or event rates; xLabel: what
// the x axis spans (default: "last <n> s", one point a second).
export function timeChart(canvas, series, { max = null, format = null, integer = false,
                                            xLabel = null } = {}) {
  const [g, w, h] = fit(canvas);
  const pad = { l: 34, r: 6, t: 6, b: 14 };
  const n = Math.max(...series.map((s) => s.values.length), 0);
  const y = yAxis(g, w, h, pad, series, { max, format, integer });
  g.fillText(xLabel ?? (n > 1 ? `last ${n} s` : ""), pad.l, h - 2);
  if (n < 2) return;
  const x = (i) => pad.l + (i / (n - 1)) * (w - pad.l - pad.r);
  for (const s of series) {
    g.fillStyle = s.color;
    g.strokeStyle = s.color;
    if (s.bars) {
      const bw = Math.max(1, (w - pad.l - pad.r) / n - 1);
      s.values.forEach((v, i) => { if (v) g.fillRect(x(i) - bw / 2, y(v), bw, h - pad.b - y(v)); });
      continue;
    }
    polyline(g, s.values, x, y);
  }
}

// A line through the values at (x(i), y(v)), broken where a value is null.
function polyline(g, values, x, y) {
  g.beginPath();
  let started = false;
  values.forEach((v, i) => {
    if (v == null) { started = false; return; }
    started ? g.lineTo(x(i), y(v)) : g.moveTo(x(i), y(v));
    started = true;
  });
  g.lineWidth = 1.6;
  g.stroke();
}

// The y axis of a chart of `series` inside `pad`: gridlines at niceTicks, their labels;
// the scale's top is `max`, or the data's rounded up to a tick. Returns y(value).
function yAxis(g, w, h, pad, series, { max = null, format = null, integer = false }) {
  const ticks = niceTicks(max ?? Math.max(0, ...series.flatMap((s) => s.values.filter((v) => v != null))),
                          { integer });
  const top = max ?? ticks[ticks.length - 1];
  g.font = "10px system-ui, sans-serif";
  g.fillStyle = "#5d6678";
  g.strokeStyle = "#e3e6ec";
  g.lineWidth = 1;
  for (const tick of ticks) {
    if (tick > top * (1 + 1e-9)) break;
    const y = pad.t + (1 - tick / top) * (h - pad.t - pad.b);
    g.beginPath(); g.moveTo(pad.l, y + 0.5); g.lineTo(w - pad.r, y + 0.5); g.stroke();
    g.fillText(format ? format(tick) : tickLabel(tick, ticks), 2, y + 3);
  }
  return (v) => pad.t + (1 - Math.min(v, top) / top) * (h - pad.t - pad.b);
}

// A figure against the values of one setting (a what-if sweep): `labels` spread evenly
// along the x axis, under it; series: [{label, color, values: [number|null], dashed?}],
// one value a label (dashed: a reference, drawn as a line without dots). max, format,
// integer: as timeChart's.
export function leverChart(canvas, series, labels, { max = null, format = null,
                                                    integer = false } = {}) {
  const [g, w, h] = fit(canvas);
  const pad = { l: 34, r: 14, t: 6, b: 16 };
  const y = yAxis(g, w, h, pad, series, { max, format, integer });
  const n = labels.length;
  const x = (i) => pad.l + 8 + (n > 1 ? (i / (n - 1)) * (w - pad.l - pad.r - 16) : 0);
  g.textAlign = "center";
  labels.forEach((label, i) => g.fillText(label, x(i), h - 3));
  g.textAlign = "start";
  for (const s of series) {
    g.strokeStyle = s.color;
    g.fillStyle = s.color;
    g.setLineDash(s.dashed ? [4, 3] : []);
    polyline(g, s.values, x, y);
    g.setLineDash([]);
    if (s.dashed) continue;
    s.values.forEach((v, i) => {
      if (v == null) return;
      g.beginPath(); g.arc(x(i), y(v), 2.5, 0, 2 * Math.PI); g.fill();
    });
  }
}
