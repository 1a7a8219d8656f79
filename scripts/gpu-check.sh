#!/usr/bin/env bash
# The checks to run when a GPU is at hand (one script, for a short device lease):
# the CUDA-marked kernel tests (attention, fused MoE), tiny models of several families on
# the Triton backend, the Triton kernel benchmark, and the default model in
# bfloat16 on the GPU, alone and through the whole service, and last the service path on
# the paced simulator with a GPU machine's free cores (on the 2-core development machine
# the web server, the worker, the client and the core wait for each other's CPU). Output
# goes to stdout and, when $OUT is set (the device tool), to $OUT/gpu-check.log.
#
# On a machine without kvops's virtualenv (the device tool's: Python 3.12 with PyTorch,
# Triton and transformers, no network), run scripts/gpu-pack.sh here first and carry .gpu:
# its wheels go to /tmp/site, its valkey-server stands in for Redis, and the default
# model gets random weights of its own shapes (its real weights are too large to carry).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:+$OUT/gpu-check.log}
LOG=${LOG:-/dev/null}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1 KVOPS_DATA_DIR=${KVOPS_DATA_DIR:-$PWD/data}
if [ -d .gpu/whl ] && [ ! -x .venv/bin/python ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! command -v redis-server >/dev/null && [ -f .gpu/bin/valkey-server ]; then
  # the tests' session Redis and `make run` start `redis-server`: valkey takes its flags
  mkdir -p /tmp/bin && cp .gpu/bin/valkey-server /tmp/bin/redis-server
  chmod +x /tmp/bin/redis-server && export PATH=/tmp/bin:$PATH
fi
if ! "$PY" -c "import redis; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null; then
  redis-server --port 6379 --save '' --appendonly no --daemonize yes --logfile /tmp/redis.log
fi
MODEL=$KVOPS_DATA_DIR/models/SmolLM2-135M-Instruct
if [ ! -f "$MODEL/model.safetensors" ] && [ -d .gpu/model ]; then
  mkdir -p "$MODEL" && cp .gpu/model/* "$MODEL"/
  "$PY" - "$MODEL" <<'PYEOF' || exit 1
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.manual_seed(0)
config = AutoConfig.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.save_pretrained(sys.argv[1])  # model.safetensors, random weights of the real shapes
print("the default model's shapes, random weights:", sys.argv[1])
PYEOF
fi
# Sections, most wanted first; their time limits add up to under the device tool's 600 s a
# command (a section cut off still leaves its output in the log). Name sections to run
# only those: scripts/gpu-check.sh engine sim
section() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "== $name: $*"
  timeout "$limit" "$@"
  echo "(== $name: exit $?)"
}
ONLY="$*"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  # the engine at GPU pace (named only, about 6 minutes: scripts/gpu-check.sh pace): a
  # decode step by phase on the default model in bfloat16 at 1, 32 and 256 running (as
  # CUDA graphs with async scheduling, then a step at a time, then op by op), then
  # the engine against transformers, the kernels against SDPA and 256 streams through the
  # service (the engine, kernels and serve256 sections below)
  if [[ " $ONLY " == *" pace "* ]]; then
    ONLY="$ONLY pace-sync pace-eager engine kernels serve256"
    section pace 90 "$PY" -m benchmarks.bench_step --device cuda --model default \
      --running 1,32,256
    section pace-sync 50 "$PY" -m benchmarks.bench_step --device cuda --model default \
      --running 1,32,256 --async-scheduling off
    section pace-eager 50 "$PY" -m benchmarks.bench_step --device cuda --model default \
      --running 1,32,256 --enforce-eager --async-scheduling off
  fi
  # through the service: 32 streams, the default model in bfloat16 on cuda
  section serve 120 "$PY" -m benchmarks.bench_serve --streams "" --real 32 --real-tokens 128 \
    --real-device cuda --real-dtype bfloat16
  # the engine alone against transformers' generate, both on cuda
  section engine 65 "$PY" -m benchmarks.bench_engine --device cuda --dtype bfloat16 \
    --hf-batch-sizes 32 --repeats 1
  section kernels 60 "$PY" -m benchmarks.bench_kernels
  section cuda-tests 110 "$PY" -m pytest -q -m cuda tests/kernels
  # tiny models on CUDA: Triton attention, windowed layers, the fused MoE kernel, the fused
  # layer ops (norms, activation, RoPE + K/V store, the gate/up GEMM with its activation)
  # compiled against torch, decode steps as CUDA graphs against eager ones, the CPU tier's
  # copies ahead, the torch attention path off the CPU
  section tiny 100 "$PY" -m pytest -q tests/engine/test_model_triton.py \
    tests/engine/test_decode_graphs.py tests/kernels/test_fused_layer_ops.py \
    tests/kernels/test_gate_up_act.py tests/engine/test_cpu_tier.py \
    tests/kernels/test_torch_attention_off_cpu.py
  # a request moved between two engines with its KV cache: blocks read from one device
  # pool to the host (pinned) and written into the other's (engine/transfer/migration.py), and
  # between two cores over ZMQ (engine/transfer/link.py)
  section migration 50 "$PY" -m pytest -q tests/engine/test_migration.py tests/engine/test_migration_link.py
  # the disk tier of the prefix cache with a real model's CPU pool on a GPU machine:
  # block bytes out of and back into the pinned CPU pool (engine/kv/tiers/disk.py)
  section disk 30 "$PY" -m pytest -q tests/engine/test_disk_tier.py
  # fp8 K/V: reshape_and_cache and paged_attention compiled for this GPU against torch's
  # casts and the dequantised reference, a tiny model's fp8 run against transformers'
  section fp8 45 "$PY" -m pytest -q tests/kernels/test_fp8_kv.py tests/engine/test_fp8_kv.py
  # the service path with many free cores: the simulator, short streams at 5 ms a step
  section sim 45 "$PY" -m benchmarks.bench_serve --streams 256 --sim-tokens 64-64 --step-ms 5
  # 256 streams of the default model through the service (named only: over the budget
  # of one command together with the rest)
  [ -n "$ONLY" ] && section serve256 150 "$PY" -m benchmarks.bench_serve --streams "" \
    --real 256 --real-tokens 128 --real-device cuda --real-dtype bfloat16
  # fp8 K/V's quality on the default model in bfloat16 (named only)
  [ -n "$ONLY" ] && section fp8-quality 200 "$PY" -m benchmarks.kv_quality --device cuda
} 2>&1 | tee "$LOG"
