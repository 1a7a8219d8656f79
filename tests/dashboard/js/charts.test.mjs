// node --test: the charts' axis ticks (static/kvops/charts.js), without a browser.
import assert from "node:assert/strict";
import test from "node:test";

import { niceTicks, sparkCaption, tickLabel } from "../../../static/kvops/charts.js";

const labels = (ticks) => ticks.map((t) => tickLabel(t, ticks));

test("event rates peaking at 1 get 0 and 1, not 1, 1, 0", () => {
  const ticks = niceTicks(1, { integer: true });
  assert.deepEqual(ticks, [0, 1]);
  assert.deepEqual(labels(ticks), ["0", "1"]);
});

test("ticks are distinct, ascending, cover the peak, and so are their labels", () => {
  for (const peak of [0, 1e-6, 0.003, 0.1, 0.37, 1, 1.5, 2, 3, 7, 9.99, 10, 11, 99, 101, 1234, 5e6]) {
    for (const integer of [false, true]) {
      const ticks = niceTicks(peak, { integer });
      assert.equal(ticks[0], 0);
      assert.ok(ticks.length >= 2 && ticks.length <= 4, `${peak}: ${ticks}`);
      assert.ok(ticks[ticks.length - 1] >= peak, `${peak}: ${ticks}`);
      for (let i = 1; i < ticks.length; i++) assert.ok(ticks[i] > ticks[i - 1]);
      const shown = labels(ticks);
      assert.equal(new Set(shown).size, shown.length, `${peak}: ${shown}`);
      if (integer) assert.ok(ticks.every(Number.isInteger), `${peak}: ${ticks}`);
    }
  }
});

test("steps are 1, 2 or 5 times a power of ten", () => {
  for (const peak of [0.37, 3, 7, 11, 99, 1234]) {
    const ticks = niceTicks(peak);
    const step = ticks[1] - ticks[0];
    const mantissa = step / 10 ** Math.floor(Math.log10(step));
    assert.ok([1, 2, 5].some((m) => Math.abs(m - mantissa) < 1e-9), `${peak}: step ${step}`);
  }
  assert.deepEqual(niceTicks(7), [0, 5, 10]);
  assert.deepEqual(labels(niceTicks(0.37)), ["0.0", "0.2", "0.4"]);
});

// A canvas that records what is drawn on it.
function recordingCanvas() {
  const texts = [];
  const g = new Proxy({ fillText: (t) => texts.push(t) }, {
    get: (target, name) => (name in target ? target[name] : () => {}),
    set: () => true,
  });
  return { texts, canvas: { clientWidth: 300, clientHeight: 120, width: 300, height: 120, getContext: () => g } };
}

test("the preemption chart's axis reads 0 and 1 when one preemption a second is the peak", async () => {
  globalThis.window = { devicePixelRatio: 1 };
  const { timeChart } = await import("../../../static/kvops/charts.js");
  const { texts, canvas } = recordingCanvas();
  timeChart(canvas, [{ color: "#c00", values: [0, 1, 0, 0], bars: true },
                     { color: "#80c", values: [0, 0, 1, 0] }], { integer: true });
  assert.deepEqual(texts.filter((t) => /^\d/.test(t)), ["0", "1"]);
  const percent = recordingCanvas();
  timeChart(percent.canvas, [{ color: "#00c", values: [0.2, 0.4] }],
            { max: 1, format: (v) => `${Math.round(v * 100)}%` });
  assert.deepEqual(percent.texts.filter((t) => t.endsWith("%")), ["0%", "50%", "100%"]);
});

test("a sparkline's caption says what it plots, over how long, and its top", () => {
  assert.equal(sparkCaption("generated tokens/s", []), "generated tokens/s");
  assert.equal(sparkCaption("generated tokens/s", [[1000, 3]]), "generated tokens/s");
  assert.equal(sparkCaption("generated tokens/s", [[1000, 0], [1030, 12.34], [1045, 7]]),
               "generated tokens/s, last 45 s · max 12.3");
  assert.equal(sparkCaption("generated tokens/s", [[1000, 120.4], [1120, 340.6]]),
               "generated tokens/s, last 2 min · max 341");
});

test("a lever chart puts each value's label under its point, breaks at a gap, dots no reference", async () => {
  globalThis.window = { devicePixelRatio: 1 };
  const { leverChart } = await import("../../../static/kvops/charts.js");
  const calls = [];
  const record = (name) => (...args) => calls.push([name, ...args]);
  const g = new Proxy({}, {
    get: (target, name) => (["fillText", "moveTo", "lineTo", "arc", "setLineDash"].includes(name)
      ? record(name) : () => {}),
    set: () => true,
  });
  const canvas = { clientWidth: 300, clientHeight: 120, width: 300, height: 120, getContext: () => g };
  leverChart(canvas, [{ color: "#888", values: [0.5, 0.5, 0.5], dashed: true },
                      { color: "#00c", values: [0.2, null, 0.6] }], ["16", "32", "64"],
             { max: 1, format: (v) => `${Math.round(100 * v)}%` });
  const labelled = calls.filter(([name, text]) => name === "fillText" && ["16", "32", "64"].includes(text));
  assert.deepEqual(labelled.map(([, text]) => text), ["16", "32", "64"]);
  const xs = labelled.map(([, , x]) => x);
  assert.ok(xs[0] < xs[1] && xs[1] < xs[2] && xs[2] <= 300, `${xs}`);
  // the dots: the replayed series' two values, at their labels' x; none for the reference
  const dots = calls.filter(([name]) => name === "arc");
  assert.deepEqual(dots.map(([, x]) => x), [xs[0], xs[2]]);
  // the reference is one line of three points; the replayed series starts again after its
  // gap (the moves left of the first point are the y axis's gridlines)
  const starts = calls.filter(([name, x]) => name === "moveTo" && x >= xs[0]).map(([, x]) => x);
  assert.deepEqual(starts, [xs[0], xs[0], xs[2]]);
  assert.ok(calls.some(([name, dash]) => name === "setLineDash" && dash.length === 2));
});
