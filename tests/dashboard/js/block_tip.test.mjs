// node --test: the hovered block's tooltip (static/kvops/block_tip.js) from the state on
// screen, then with the engine's answer to the page's `block` question.
import assert from "node:assert/strict";
import test from "node:test";

import { agoText, blockTipHtml, ordinal, sharedMark } from "../../../static/kvops/block_tip.js";
import { KVState } from "../../../static/kvops/kvstate.js";
import { FINISH, snapshot } from "./kv_fixtures.mjs";

const text = (html) => html.replace(/<[^>]+>/g, "").replace(/&[a-z0-9#]+;/g, (e) => (
  { "&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&#39;": "'" }[e] ?? e));

test("ordinals and shared counts read as words do", () => {
  assert.deepEqual([1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111].map(ordinal),
                   ["1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th"]);
  assert.deepEqual([0, 1, 2, 3, 10].map(sharedMark), ["", "", "×2", "×3", "×10"]);
  assert.deepEqual([4.4, 59, 61, 7200].map(agoText), ["4 s", "59 s", "1 min", "2.0 h"]);
});

test("a held block names its holder and tokens; the answer adds their text and use", () => {
  const state = new KVState(snapshot());
  const mine = () => false;
  const before = text(blockTipHtml(state, "gpu", 5, null, mine));
  assert.match(before, /GPU block 5 · used/);
  assert.match(before, /held by r1 \(no job\): tokens 16–31/);  // its 2nd block of 16 tokens
  assert.doesNotMatch(before, /in use now/);
  const facts = { idle_s: null, eviction: null,
                  holders: [{ request_id: "r1", tokens: [16, 32], text: "<the tail>" }] };
  const after = text(blockTipHtml(state, "gpu", 5, facts, mine));
  assert.match(after, /“<the tail>”/);
  assert.match(after, /in use now/);
  const others = text(blockTipHtml(state, "gpu", 5, { ...facts, holders: [{ ...facts.holders[0], text: null }] },
                                   () => true));
  assert.match(others, /r1 \(another user's request\): tokens 16–31/);
  assert.doesNotMatch(others, /“/);
});

test("a cached block is held by the prefix cache and says its place in the eviction order", () => {
  const state = new KVState(snapshot());
  state.apply(FINISH);
  const tip = text(blockTipHtml(state, "gpu", 2, { idle_s: 12.2, eviction: { place: 3, of: 120 }, holders: [] },
                                () => false));
  assert.match(tip, /GPU block 2 · cached/);
  assert.match(tip, /held by the prefix cache/);
  assert.match(tip, /last used 12 s ago/);
  assert.match(tip, /3rd to be evicted of 120 cached/);
});
