// How an engine stores K/V, as the engine page's GPU map caption says it: the dtype
// (the model's, or fp8 with its scales) and one block's bytes, every layer, from the
// engine's config (describe_config). No DOM: tests/dashboard/js/kv_format.test.mjs.
import { byteSize } from "./format.js";

const SCALES = { tensor: "scales per layer", head: "scales per KV head", unit: "scale 1" };

// " · fp8_e4m3 K/V (scales per layer), 180 KiB a block"; "" for the simulator, whose
// stand-in K/V has no dtype, or an engine that does not say.
export function kvCaption(config) {
  const c = config || {};
  if (!c.kv_bytes_per_block || c.simulate) return "";
  const fp8 = c.kv_cache_dtype && c.kv_cache_dtype !== "auto";
  const dtype = fp8 ? c.kv_cache_dtype : (c.dtype || "");
  const scales = fp8 && SCALES[c.kv_cache_scales] ? ` (${SCALES[c.kv_cache_scales]})` : "";
  return ` · ${dtype} K/V${scales}, ${byteSize(c.kv_bytes_per_block)} a block`;
}
