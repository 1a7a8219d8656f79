// The engine's requests in a virtualised table: only the rows in view are in the DOM, so
// a thousand requests updated ten times a second stay cheap. Click a row to select the
// request (its blocks are highlighted on the map); operators get action buttons, and on
// a running request a Migrate control (an engine to move it to, and a button).
import { ownerCss } from "./colors.js";
import { esc, num } from "./format.js";

const ROW_HEIGHT = 30;
const RESORT_MS = 500;  // between deltas rows keep their places, their numbers update
const STATUS_ORDER = { running: 0, swapped: 1, waiting: 2, finished: 3, aborted: 4 };
const COLUMNS = [
  ["", null], ["request", "request_id"], ["job", "job_id"], ["status", "status"],
  ["prompt", "num_prompt_tokens"], ["computed", "num_computed_tokens"],
  ["output", "num_output_tokens"], ["cached", "num_cached_tokens"], ["blocks", "blocks"],
  ["preempt.", "num_preemptions"], ["swaps", "num_swaps_out"], ["prio", "priority"], ["actions", null],
];
// (preempt.: recompute preemptions; swaps: swaps out. engine/sched/scheduler.py, above
// SchedulerCounters, says what each counts.)
// The empty table's words, by filter (the others: "<status> requests").
const EMPTY_NOUNS = { live: "live requests", all: "requests" };
// What an operator may do to a request in each state (the engine refuses the rest).
const ACTIONS = {
  running: [["preempt", "Preempt"], ["swap-out", "Swap out"], ["abort", "Abort"]],
  swapped: [["swap-in", "Swap in"], ["abort", "Abort"]],
  waiting: [["abort", "Abort"]],
};

// The samples of a forked request ("<request>/<i>", n > 1) stay together, in sample
// order, where the first of them sorts.
function groupSamples(rows) {
  if (!rows.some((r) => r.request_id.includes("/"))) return rows;  // no fork: nothing to move
  const groups = new Map();
  for (const r of rows) {
    const slash = r.request_id.lastIndexOf("/");
    const key = slash < 0 ? r.request_id : r.request_id.slice(0, slash);
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(r);
  }
  const out = [];
  for (const members of groups.values()) {
    if (members.length > 1) members.sort((a, b) => sampleIndex(a) - sampleIndex(b));
    out.push(...members);
  }
  return out;
}

function sampleIndex(r) {
  const slash = r.request_id.lastIndexOf("/");
  return slash < 0 ? -1 : Number(r.request_id.slice(slash + 1));
}

function sortValue(r, key) {
  if (key === "blocks") return r.block_table.length + r.cpu_block_table.length;
  if (key === "status") return STATUS_ORDER[r.status] ?? 9;
  if (key === "job_id") return Number(r.job_id) || 0;
  return r[key];
}

export class RequestTable {
  constructor(root, { operator, onSelect, onAction, othersOf = () => false }) {
    this.root = root;
    this.operator = operator;
    this.othersOf = othersOf;  // r -> is it another user's request? (a plain user's view)
    this.onSelect = onSelect;
    this.onAction = onAction;  // (action, request id, {to} for migrate)
    this.moveOptions = "";  // the Migrate chooser's <option>s: the engines a request may move to
    this.sortKey = "status";
    this.ascending = true;
    this.filter = "live";
    this.search = "";
    this.selected = null;  // request index
    this.rows = [];  // request indices, in display order
    this.elements = new Map();  // request index -> its row element, for the rows in view
    this.sortedAt = 0;
    this.state = null;
    root.innerHTML = `
      <div class="vhead">${COLUMNS.map(([label, key]) =>
        `<div ${key ? `data-sort="${key}"` : ""} class="${key && key !== "request_id" && key !== "status" && key !== "job_id" ? "num" : ""}">${label}</div>`).join("")}</div>
      <p class="vempty muted">Waiting for the engine's state…</p>
      <div class="vbody" hidden><div class="vspacer"></div></div>`;
    this.body = root.querySelector(".vbody");
    this.empty = root.querySelector(".vempty");
    this.spacer = root.querySelector(".vspacer");
    root.querySelector(".vhead").addEventListener("click", (e) => this.sortBy(e.target.dataset.sort));
    this.body.addEventListener("scroll", () => this.renderRows());
    this.body.addEventListener("click", (e) => this.click(e));
    this.markSorted();
  }

  sortBy(key) {
    if (!key) return;
    this.ascending = this.sortKey === key ? !this.ascending : key === "status";
    this.sortKey = key;
    this.markSorted();
    this.refresh();
  }

  markSorted() {
    for (const el of this.root.querySelectorAll(".vhead > div")) {
      el.classList.toggle("sorted", el.dataset.sort === this.sortKey);
      el.classList.toggle("asc", el.dataset.sort === this.sortKey && this.ascending);
    }
  }

  setFilter(filter, search) {
    this.filter = filter;
    this.search = search.trim().toLowerCase();
    this.refresh();
  }

  setState(state) {  // a new snapshot: request indices may mean other requests now
    this.state = state;
    for (const el of this.elements.values()) el.remove();
    this.elements = new Map();
    this.refresh(true);
  }

  // Whether the filter and the search let request `r` through.
  shows(r) {
    const { filter, search } = this;
    if (filter === "live" && !(r.status === "running" || r.status === "waiting" || r.status === "swapped")) return false;
    if (filter !== "live" && filter !== "all" && r.status !== filter) return false;
    return !search || r.request_id.toLowerCase().includes(search) || String(r.job_id ?? "").includes(search);
  }

  // Re-filter and re-sort (when forced, or RESORT_MS after the last time), then draw
  // the rows in view from the current state.
  refresh(force = true) {
    if (!this.state) return;
    const now = performance.now();
    if (!force && now - this.sortedAt < RESORT_MS) { this.renderRows(); return; }
    this.sortedAt = now;
    const sortKey = this.sortKey;
    const rows = [...this.state.requests.values()].filter((r) => this.shows(r));
    const dir = this.ascending ? 1 : -1;
    rows.sort((a, b) => {
      const x = sortValue(a, sortKey), y = sortValue(b, sortKey);
      return (x < y ? -dir : x > y ? dir : 0) || a.index - b.index;
    });
    this.rows = groupSamples(rows).map((r) => r.index);
    this.spacer.style.height = `${rows.length * ROW_HEIGHT}px`;
    this.showEmpty(rows.length === 0);
    this.renderRows();
  }

  // No row to show: say so in words instead of a blank table.
  showEmpty(empty) {
    if (empty) {
      const noun = EMPTY_NOUNS[this.filter] ?? `${this.filter} requests`;
      this.empty.textContent = this.search ? `No ${noun} match “${this.search}”.`
        : this.filter === "live" ? "No live requests (none waiting, running or swapped)." : `No ${noun}.`;
    }
    this.empty.hidden = !empty;
    this.body.hidden = empty;
  }

  get count() { return this.rows.length; }

  // Rows in view are kept as elements, one per request, and updated cell by cell: a
  // delta changes a few numbers, and rebuilding the rows would restyle them all.
  renderRows() {
    const top = this.body.scrollTop, height = this.body.clientHeight || 380;
    const first = Math.max(0, Math.floor(top / ROW_HEIGHT) - 4);
    const last = Math.min(this.rows.length, Math.ceil((top + height) / ROW_HEIGHT) + 4);
    const shown = new Map();
    for (let k = first; k < last; k++) {
      const r = this.state.requests.get(this.rows[k]);
      if (!r) continue;
      const el = this.elements.get(r.index) || this.createRow(r);
      this.updateRow(el, r, k);
      shown.set(r.index, el);
    }
    for (const [index, el] of this.elements) if (!shown.has(index)) el.remove();
    this.elements = shown;
  }

  createRow(r) {
    const el = document.createElement("div");
    el.className = r.request_id.includes("/") ? "vrow sample" : "vrow";
    el.dataset.index = r.index;
    el.dataset.request = r.request_id;
    el.innerHTML = `<div class="hue" style="background:${ownerCss(r.index)}"></div>
      <div class="mono" title="${esc(r.request_id)}${r.request_id.includes("/") ? " (a sample of a request with n > 1: the samples share its prompt's blocks)" : ""}">${esc(r.request_id)}</div>
      <div>${this.othersOf(r) ? '<span class="muted" title="its job is its owner\'s to see">another user\'s</span>'
    : r.job_id ? `<a href="/jobs/${esc(r.job_id)}/">${esc(r.job_id)}</a>` : "–"}</div>
      <div></div>${'<div class="num"></div>'.repeat(8)}<div class="actions"></div>`;
    el.cells = [...el.children];
    el.shown = [];  // what each cell shows now
    this.spacer.appendChild(el);
    return el;
  }

  updateRow(el, r, k) {
    const top = `${k * ROW_HEIGHT}px`;
    if (el.style.top !== top) el.style.top = top;
    el.classList.toggle("selected", r.index === this.selected);
    const c = el.cells, shown = el.shown;
    const set = (i, html) => { if (shown[i] !== html) { shown[i] = html; c[i].innerHTML = html; } };
    set(3, `<span class="pill ${esc(r.status)}" ${r.parked ? 'title="swapped out by an operator: waits for Swap in"' : ""}>${esc(r.status)}${r.parked ? " ⏸" : ""}</span>`);
    set(4, num(r.num_prompt_tokens));
    set(5, num(r.num_computed_tokens));
    set(6, num(r.num_output_tokens));
    set(7, num(r.num_cached_tokens));
    set(8, `${r.block_table.length}${r.cpu_block_table.length ? ` <span class="muted">+${r.cpu_block_table.length}c</span>` : ""}`);
    set(9, String(r.num_preemptions));
    set(10, String(r.num_swaps_out ?? 0));
    set(11, String(r.priority));
    if (this.operator) set(12, this.actionsHtml(r));
  }

  actionsHtml(r) {
    const buttons = (ACTIONS[r.status] || []).map(([action, label]) =>
      `<button class="small ${action === "abort" ? "danger" : "secondary"}" data-action="${action}">${label}</button>`).join("");
    if (r.status !== "running" || !this.moveOptions) return buttons;  // only a running request moves
    return `${buttons}<select class="small" data-to aria-label="the engine to move it to">${this.moveOptions}</select>`
      + '<button class="small secondary" data-action="migrate" title="move it, with its KV cache, to the engine chosen">Migrate</button>';
  }

  // The engines a running request may move to now (migration.js migrationTargets), the
  // first chosen. A row's chooser is rebuilt only when they change: a choice made stays.
  setDestinations(names) {
    const options = names.map((name) => `<option value="${esc(name)}">${esc(name)}</option>`).join("");
    if (options === this.moveOptions) return;
    this.moveOptions = options;
    if (this.state) this.renderRows();
  }

  click(event) {
    const row = event.target.closest(".vrow");
    if (!row || event.target.closest("a, select")) return;
    const index = Number(row.dataset.index);
    const button = event.target.closest("button[data-action]");
    if (button) {
      this.onAction(button.dataset.action, row.dataset.request, { to: row.querySelector("select[data-to]")?.value });
      return;
    }
    this.select(this.selected === index ? null : index);
  }

  select(index) {
    this.selected = index;
    this.renderRows();
    this.onSelect(index);
  }

  // Scroll so the selected request's row shows.
  reveal(index) {
    const at = this.rows.indexOf(index);
    if (at >= 0) this.body.scrollTop = Math.max(0, at * ROW_HEIGHT - 60);
  }
}
