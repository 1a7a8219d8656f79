"""Compile every Triton kernel for real GPUs ahead of time; no GPU needed.

    python -m kernels.compile_check [--arch 90 --arch 80]

The interpreter runs kernels as Python and accepts code the compiler rejects (types,
loop-carried values, dot shapes); compiling to a cubin for sm_80/sm_90 catches that on
a machine without CUDA. Launch constants come from the functions the launchers use.
Prints one row per compiled kernel (registers and spill bytes per thread when the
cuobjdump in Triton's wheel is there); exits 1 if any kernel fails to compile.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass

import torch

TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
FP8_MIN_ARCH = 89  # Triton's fp8 types need sm_89 (Ada) or later


@dataclass(frozen=True, slots=True)
class AttentionCase:
    name: str
    num_tokens: int
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    max_query_len: int
    num_splits: int | None  # None: the launcher's choice on a 132-SM GPU
    kv_dtype: torch.dtype | None = None  # an fp8 cache (None: dtype's)


ATTENTION_CASES = [
    AttentionCase("llama8b decode, 4 seqs", 4, 4, 32, 8, 128, 16, torch.bfloat16, 1, None),
    AttentionCase("llama8b decode, 64 seqs", 64, 64, 32, 8, 128, 16, torch.bfloat16, 1, None),
    AttentionCase("llama8b prefill", 4096, 2, 32, 8, 128, 16, torch.bfloat16, 4000, None),
    AttentionCase("smollm fp32, 1 seq", 1, 1, 9, 3, 64, 16, torch.float32, 1, 1),
    AttentionCase("smollm bf16 prefill", 512, 1, 9, 3, 64, 16, torch.bfloat16, 512, 1),
    AttentionCase("smollm bf16 decode", 32, 32, 9, 3, 64, 16, torch.bfloat16, 1, None),
    AttentionCase("fp32 prefill dim 128", 512, 2, 32, 8, 128, 16, torch.float32, 256, 1),
    AttentionCase("fp32 decode dim 128", 2, 2, 32, 8, 128, 16, torch.float32, 1, 2),
    AttentionCase("fp16 dim 80, block 1, gqa 8", 8, 8, 8, 1, 80, 1, torch.float16, 1, 4),
    AttentionCase("bf16 dim 256, block 128", 100, 1, 4, 4, 256, 128, torch.bfloat16, 100, 1),
    AttentionCase("llama8b decode, fp8 e4m3 KV", 64, 64, 32, 8, 128, 16, torch.bfloat16, 1, None,
                  torch.float8_e4m3fn),
    AttentionCase("llama8b prefill, fp8 e4m3 KV", 4096, 2, 32, 8, 128, 16, torch.bfloat16, 4000,
                  None, torch.float8_e4m3fn),
    AttentionCase("smollm decode, fp8 e5m2 KV", 32, 32, 9, 3, 64, 16, torch.bfloat16, 1, None,
                  torch.float8_e5m2),
]


def compile_kernel(kernel, arch: int, runtime_types: dict[str, str], constants: dict[str, object],
                   num_warps: int = 4):
    """runtime_types: argument -> Triton type ("*bf16", "i32", ...), or "1" for an int
    argument equal to 1, which Triton turns into a constant at launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature: dict[str, str] = {}
    constexprs = dict(constants)
    for name, ty in runtime_types.items():
        signature[name] = "constexpr" if ty == "1" else ty
        if ty == "1":
            constexprs[name] = 1
    signature.update({name: "constexpr" for name in constants})
    if list(signature) != kernel.arg_names:
        raise ValueError(f"{kernel.__name__}: signature {list(signature)} != arguments {kernel.arg_names}")
    source = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    if not compiled.asm.get("cubin"):
        raise RuntimeError(f"{kernel.__name__}: no cubin produced for sm_{arch}")
    return compiled


# a job: (kernel, arch, runtime_types, constants, num_warps), the arguments of compile_kernel
def attention_jobs(arch: int):
    from kernels.paged_attention import attention_constants, merge_constants
    from kernels.paged_attention_kernel import merge_splits_kernel, paged_attention_kernel
    from kernels.paged_attention_plan import choose_launch_plan

    for case in ATTENTION_CASES:
        if case.kv_dtype is not None and arch < FP8_MIN_ARCH:
            continue
        plan = choose_launch_plan(case.num_tokens, case.num_seqs, case.num_q_heads, case.num_kv_heads,
                                  case.head_dim, case.dtype, 8192, case.max_query_len, 132,
                                  case.num_splits, interpret=False)
        t = TRITON_DTYPES[case.dtype]
        kv = TRITON_DTYPES[case.kv_dtype or case.dtype]
        scales = "*fp32" if case.kv_dtype else "*i32"
        types = {"out_ptr": f"*{t}", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                 "q_ptr": f"*{t}", "key_cache_ptr": f"*{kv}", "value_cache_ptr": f"*{kv}",
                 "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                 "k_scale_ptr": scales, "v_scale_ptr": scales, "qk_scale": "fp32", "window": "i32", "softcap": "fp32",
                 "num_seqs": "1" if case.num_seqs == 1 else "i32",
                 "stride_q_tok": "i32", "stride_q_head": "i32", "stride_block_table": "i32"}
        constants = attention_constants(case.dtype, case.num_q_heads, case.num_kv_heads, case.head_dim,
                                        case.block_size, plan, interpret=False,
                                        fp8=case.kv_dtype is not None)
        label = f"{case.name} (block_m {plan.block_m}, tile_n {plan.tile_n}, splits {plan.num_splits})"
        yield label, (paged_attention_kernel, arch, types, constants, plan.num_warps)
        if plan.num_splits > 1:
            merge_types = {"out_ptr": f"*{t}", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32",
                           "part_sum_ptr": "*fp32", "query_start_loc_ptr": "*i32", "num_seqs": "i32"}
            merge = merge_constants(case.num_q_heads, case.head_dim, plan.num_splits)
            yield f"{case.name} merge", (merge_splits_kernel, arch, merge_types, merge, 4)


def copy_jobs(arch: int):
    from kernels.copy_blocks_kernel import copy_blocks_kernel
    from kernels.reshape_and_cache_kernel import reshape_and_cache_kernel

    cases = [("*i64", 8, 128, 0), ("*i32", 3, 80, 0)]
    if arch >= FP8_MIN_ARCH:
        cases += [("*i64", 8, 128, 1), ("*i32", 3, 64, 2)]
    for slot_type, heads, dim, fp8 in cases:
        data, cache = ("*bf16", ("*fp8e4nv", "*fp8e5")[fp8 - 1]) if fp8 else ("*i16", "*i16")
        scales = "*fp32" if fp8 else slot_type
        types = {"key_ptr": data, "value_ptr": data, "key_cache_ptr": cache, "value_cache_ptr": cache,
                 "slot_mapping_ptr": slot_type, "k_scale_ptr": scales, "v_scale_ptr": scales,
                 "num_slots": "i32", "stride_key_tok": "i32",
                 "stride_key_head": "i32", "stride_value_tok": "i32", "stride_value_head": "i32"}
        constants = {"NUM_KV_HEADS": heads, "HEAD_DIM": dim, "HEADS_PAD": 1 << (heads - 1).bit_length(),
                     "DIM_PAD": 1 << (dim - 1).bit_length(), "FP8": fp8}
        what = f" to {cache[1:]}" if fp8 else ""
        yield f"reshape_and_cache {heads}x{dim} {slot_type[1:]} slots{what}", \
            (reshape_and_cache_kernel, arch, types, constants, 4)
    types = {"cache_ptr": "*i16", "block_mapping_ptr": "*i64", "plane_numel": "i64", "block_numel": "i32"}
    yield "copy_blocks", (copy_blocks_kernel, arch, types, {"CHUNK": 1024}, 4)


def layer_jobs(arch: int):
    """The fused ops of a layer on the Triton path: RMSNorm (with and without the
    residual add), the gated activation, the gate/up projection with the activation,
    RoPE with the K/V store."""
    from kernels.gate_up_act import choose_tiles, kernel_constants
    from kernels.gate_up_act_kernel import gate_up_act_kernel
    from kernels.gated_act_kernel import gated_act_kernel
    from kernels.norm import norm_warps
    from kernels.norm_kernel import rms_norm_kernel
    from kernels.rope_store_kv_kernel import rope_store_kv_kernel

    for t, cols, delta, offset in [("bf16", 576, True, False), ("bf16", 4096, False, False),
                                   ("fp16", 2304, True, True), ("fp32", 576, True, False)]:
        types = {"out_ptr": f"*{t}", "x_ptr": f"*{t}", "delta_ptr": f"*{t}", "weight_ptr": f"*{t}",
                 "stride_x": "i32", "stride_delta": "i32", "stride_out": "i32", "n_cols": "i32",
                 "eps": "fp32", "offset": "fp32"}
        block = 1 << (cols - 1).bit_length()
        what = "add_rms_norm" if delta else "rms_norm"
        yield f"{what} {t} {cols}{' offset' if offset else ''}", (
            rms_norm_kernel, arch, types,
            {"HAS_DELTA": delta, "HAS_OFFSET": offset, "BLOCK": block}, norm_warps(block))
    for t, act in [("bf16", 0), ("fp16", 1), ("fp32", 0)]:
        types = {"out_ptr": f"*{t}", "x_ptr": f"*{t}", "stride_x": "i32", "stride_out": "i32",
                 "n_cols": "i32"}
        yield f"gated_act {t} {('silu', 'gelu_tanh')[act]}", \
            (gated_act_kernel, arch, types, {"ACT": act, "BLOCK": 1024}, 4)
    dtypes = {t: d for d, t in TRITON_DTYPES.items()}
    # rows: each tile size choose_tiles makes up to the decode bound (256); 1 is a
    # constant at launch (one sequence decoding)
    for t, rows, act, bias in [("bf16", 1, 0, False), ("bf16", 32, 1, True), ("bf16", 256, 0, False),
                               ("fp16", 64, 1, True), ("fp32", 1, 0, True), ("fp32", 256, 0, False)]:
        types = {"out_ptr": f"*{t}", "x_ptr": f"*{t}", "w_ptr": f"*{t}", "bias_ptr": f"*{t}",
                 "M": "1" if rows == 1 else "i32", "N": "i32", "K": "i32",
                 "stride_x": "i32", "stride_w": "i32", "stride_out": "i32"}
        tiles = choose_tiles(rows, dtypes[t], interpret=False)
        activation = ("silu", "gelu_pytorch_tanh")[act]
        constants = kernel_constants(dtypes[t], activation, bias, tiles, interpret=False)
        yield f"gate_up_act {t} {rows} rows {('silu', 'gelu_tanh')[act]}{' bias' if bias else ''} " \
              f"({tiles.block_m}x{tiles.block_n}x{tiles.block_k})", \
            (gate_up_act_kernel, arch, types, constants, tiles.num_warps)
    cases = [("bf16", 9, 3, 64, 0), ("bf16", 32, 8, 128, 0), ("fp32", 4, 4, 80, 0)]
    if arch >= FP8_MIN_ARCH:
        cases += [("bf16", 32, 8, 128, 1), ("fp16", 9, 3, 64, 2)]
    for t, heads, kv_heads, dim, fp8 in cases:
        cache = ("*fp8e4nv", "*fp8e5")[fp8 - 1] if fp8 else f"*{t}"
        scales = "*fp32" if fp8 else "*i64"
        types = {"q_out_ptr": f"*{t}", "qkv_ptr": f"*{t}", "cos_sin_ptr": "*fp32",
                 "key_cache_ptr": cache, "value_cache_ptr": cache, "slot_mapping_ptr": "*i64",
                 "k_scale_ptr": scales, "v_scale_ptr": scales, "num_slots": "i32", "stride_qkv": "i32"}
        pad = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
        constants = {"NUM_HEADS": heads, "NUM_KV_HEADS": kv_heads, "HEAD_DIM": dim,
                     "QK_PAD": pad(heads + kv_heads), "KV_PAD": pad(kv_heads), "HALF_PAD": pad(dim // 2),
                     "DIM_PAD": pad(dim), "FP8": fp8}
        what = f" to {cache[1:]}" if fp8 else ""
        yield f"rope_store_kv {t} {heads}/{kv_heads}x{dim}{what}", (rope_store_kv_kernel, arch, types, constants, 4)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers and stack (spill) bytes per thread, read with the cuobjdump shipped in
    Triton's wheel; empty when it is not there."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(cuobjdump, os.X_OK):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        dump = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    for line in dump.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
            return {"regs": int(fields["REG"]), "stack": int(fields["STACK"])}
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x10 (default 90 and 80)")
    args = parser.parse_args(argv)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: Triton was imported in interpreter mode; run it in a fresh process")
        return 2
    os.environ["TRITON_INTERPRET"] = "0"  # before Triton is imported: compile, don't interpret
    failures = 0
    print(f"{'arch':<6} {'kernel':<62} {'warps':>5} {'shared B':>9} {'regs':>5} {'stack B':>7}")
    for arch in args.arch or [90, 80]:
        for label, job in [*attention_jobs(arch), *copy_jobs(arch), *layer_jobs(arch)]:
            try:
                compiled = compile_kernel(*job)
            except Exception:  # report every kernel, then fail
                failures += 1
                print(f"sm_{arch:<3} {label:<62} FAILED")
                traceback.print_exc()
                continue
            meta = compiled.metadata
            usage = resource_usage(compiled.asm["cubin"])
            note = "  <- spills registers" if usage.get("stack", 0) > 0 else ""
            print(f"sm_{arch:<3} {label:<62} {meta.num_warps:>5} {meta.shared:>9} "
                  f"{usage.get('regs', '?'):>5} {usage.get('stack', '?'):>7}{note}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
