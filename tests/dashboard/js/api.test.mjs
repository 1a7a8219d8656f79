// node --test: errorText (static/kvops/api.js), the one reading of an error answer for
// every page: /api's {"error": {type, code, message, field, fields}}, /v1's OpenAI
// object, and what api() makes of a network failure or a body that is not JSON.
import assert from "node:assert/strict";
import test from "node:test";

import { errorText } from "../../../static/kvops/api.js";

test("an /api error shows its message", () => {
  const data = { error: { type: "invalid_request", code: "max_value", field: "max_num_seqs",
                          message: "max_num_seqs: must be in [1, 16]",
                          fields: { max_num_seqs: ["must be in [1, 16]"] } } };
  assert.equal(errorText({ status: 400, ok: false, data }), "max_num_seqs: must be in [1, 16]");
});

test("an operator action the engine refused shows the engine's message", () => {
  const data = { error: { type: "conflict", code: "InvalidStateError", field: null, fields: {},
                          message: "request job-1-0 is swapped" } };
  assert.equal(errorText({ status: 409, ok: false, data }), "request job-1-0 is swapped");
});

test("OpenAI's error object shows its message", () => {
  const data = { error: { message: "no such model", type: "invalid_request_error", param: "model", code: null } };
  assert.equal(errorText({ status: 404, ok: false, data }), "no such model");
});

test("a network failure, a body that is not JSON, and no body", () => {
  assert.equal(errorText({ status: 0, ok: false, data: { error: "network error: down" } }),
               "network error: down");
  assert.equal(errorText({ status: 502, ok: false, data: null }), "HTTP 502");
  assert.match(errorText({ status: 500, ok: false, data: { unexpected: 1 } }), /^HTTP 500: /);
});
