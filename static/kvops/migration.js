// Moving requests between engines, as the pages show it: which engines a request may
// move to (the engine page's Migrate control), what a move's or a drain's answer says,
// and which engines a job ran on (the job page). Pure functions: node's tests import them.
import { num, when } from "./format.js";

// The name clients use for a model, as kvops/selectors.py model_name has it (its folder
// name): two engines that loaded the same model from different paths serve the same one.
function modelName(config) {
  const model = String(config?.model || "unknown");
  return model.replace(/\/+$/, "").split("/").pop().split(":")[0];
}

function load(engine) {
  const m = engine.metrics || {};
  return (m.running_tokens || 0) + (m.waiting_tokens || 0);
}

// The engines a running request of engine `name` may move to, from GET /api/engines/:
// alive, ready (not paused, not draining), serving the same model, and with a migration
// address; the least loaded first, as kvops/operators/moves.py destinations orders them.
// `ownConfig` stands in for the engine's own row when the list lacks it.
export function migrationTargets(engines, name, ownConfig = null) {
  const own = engines.find((e) => e.name === name);
  const model = modelName(own ? own.config : ownConfig);
  return engines
    .filter((e) => e.name !== name && e.alive && e.state === "ready"
                   && modelName(e.config) === model && e.config?.migration_address)
    .sort((a, b) => load(a) - load(b) || (a.name < b.name ? -1 : a.name > b.name ? 1 : 0))
    .map((e) => e.name);
}

function count(n, what) {
  return `${num(n)} ${what}${n === 1 ? "" : "s"}`;
}

// A move's answer (the `result` of POST .../requests/<id>/migrate/) in one line:
// "moved to b in 12 ms (pause 3.1 ms, 20 blocks sent, 4 cached)". The pause is how long
// the request stood still: the move's last blocks and its state.
export function migrationText(result) {
  const parts = [`pause ${num(result.pause_ms, 1)} ms`, `${count(result.blocks_sent ?? 0, "block")} sent`,
                 `${num(result.blocks_cached ?? 0)} cached`];
  return `moved to ${result.to} in ${num(result.ms)} ms (${parts.join(", ")})`;
}

// A drain's answer (POST .../drain/) in one line: its state and what happens to the
// requests that ran there.
export function drainText(result) {
  const state = result.state || "draining";
  if (result.mode === "migrate") return `${state}: its requests move to ${(result.to || []).join(", ")}`;
  if (result.mode === "abort") return `${state}: ${count((result.aborted || []).length, "request")} aborted`;
  return `${state}: its requests finish here`;
}

// How a job came to an engine after its first, by the `reason` of its `engines` entry:
// an operator's move or a drain ("migration"), or the hand-over of a prefill engine to
// its decode engine ("decode").
const ARRIVED = { migration: "moved", decode: "handed over to decode" };

// The engines a job ran on (its `engines`, oldest first: [{engine, at, reason}]) in one
// line, or "" when it ran on one: "ran on a, then b (moved at 12:01:03)". `timeOf`
// formats an ISO time.
export function ranOnText(engines, timeOf = when) {
  if (!engines || engines.length < 2) return "";
  const hops = engines.slice(1).map((e) =>
    `${e.engine}${e.at ? ` (${ARRIVED[e.reason] ?? "started"} at ${timeOf(e.at)})` : ""}`);
  return `ran on ${engines[0].engine}, then ${hops.join(", then ")}`;
}
