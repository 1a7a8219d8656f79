// node --test: the engine page's words for how K/V is stored (static/kvops/kv_format.js).
import assert from "node:assert/strict";
import test from "node:test";

import { kvCaption } from "../../../static/kvops/kv_format.js";

test("an fp8 engine says its format, scales and a block's bytes", () => {
  assert.equal(kvCaption({ dtype: "bfloat16", kv_cache_dtype: "fp8_e4m3", kv_cache_scales: "tensor",
                           kv_bytes_per_block: 184320 }), " · fp8_e4m3 K/V (scales per layer), 180 KiB a block");
  assert.equal(kvCaption({ dtype: "bfloat16", kv_cache_dtype: "fp8_e5m2", kv_cache_scales: "head",
                           kv_bytes_per_block: 2.5 * 1048576 }), " · fp8_e5m2 K/V (scales per KV head), 2.5 MiB a block");
});

test("the model's own dtype; nothing for the simulator or an engine that does not say", () => {
  assert.equal(kvCaption({ dtype: "bfloat16", kv_cache_dtype: "auto", kv_bytes_per_block: 368640 }),
               " · bfloat16 K/V, 360 KiB a block");
  assert.equal(kvCaption({ simulate: true, dtype: "uint64", kv_bytes_per_block: 128 }), "");
  assert.equal(kvCaption({}), "");
  assert.equal(kvCaption(undefined), "");
});
