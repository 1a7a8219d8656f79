#!/usr/bin/env bash
# The checks to run when a GPU is at hand (one script, for a short device lease):
# the CUDA-marked kernel tests (attention, fused MoE), tiny models of several families on
# the Triton backend, the Triton kernel benchmark, and the default model in
# bfloat16 on the GPU, alone and through the whole service. Output goes to stdout and,
# when $OUT is set (the device tool), to $OUT/gpu-check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:+$OUT/gpu-check.log}
LOG=${LOG:-/dev/null}
PY=${PY:-.venv/bin/python}
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "== CUDA-marked tests"
  timeout 240 "$PY" -m pytest -q -m cuda tests/kernels
  echo "== tiny models on CUDA: Triton attention, windowed layers, the fused MoE kernel, the CPU tier"
  timeout 180 "$PY" -m pytest -q tests/engine/test_model_triton.py tests/engine/test_cpu_tier.py
  echo "== kernels.bench"
  timeout 120 "$PY" -m kernels.bench
  echo "== engine alone, default model, bfloat16"
  timeout 120 "$PY" -m engine.bench --dtype bfloat16 --repeats 1
  echo "== through the service: 32 streams, default model, bfloat16 on cuda"
  timeout 180 "$PY" -m kvops.bench_serve --streams "" --real 32 --real-tokens 128 \
    --real-device cuda --real-dtype bfloat16
} 2>&1 | tee "$LOG"
