#!/usr/bin/env bash
# Device runs on NVIDIA H200 (see docs/PERFORMANCE.md). Usage: bash benchmarks/run_h200.sh PART
# The image's python3 has torch + triton; fla-core travels as a wheel in .whl/.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-}" in
  tests)
    nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/env.txt"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/layers/test_lora_layers.py 2>&1 | tail -30 | tee "$OUT/kernel_tests.txt"
    timeout 120 python3 benchmarks/check_fla.py 2>&1 | tail -8 | tee "$OUT/fla.txt"
    timeout 200 python3 benchmarks/gpu_engine_check.py 2>&1 | grep -v Warn | tail -12 | tee "$OUT/engine_check.txt"
    ;;
  tp2)  # TP=2 vs TP=1 equality (4 layers) and full-depth decode speed, 2 GPUs
    timeout 570 python3 benchmarks/gpu_tp_check.py --skip collectives ${2:+--speed-shapes $2} 2>&1 \
      | grep -E '^\{|Error|error' | tail -40 | tee "$OUT/tp.txt"
    ;;
  check)  # CUDA kernel tests, int4 launch sweep, engine fast paths (dense + hybrid), TP=2 vs TP=1
    PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_int4.py tests/kernels/test_gdn.py \
      -k "(accelerator or split or decode or conv) and not interpreter" 2>&1 | tail -6 | tee "$OUT/kernel_tests.txt"
    timeout 150 python3 benchmarks/bench_int4.py --sweep --budget-ms 20 2>&1 | grep -E '^\{|Error' | tee "$OUT/sweep.txt"
    timeout 150 python3 benchmarks/gpu_engine_check.py 2>&1 | grep -E '^\{|Error' | tee "$OUT/engine_check.txt"
    timeout 150 python3 benchmarks/gpu_tp_check.py --skip collectives speed 2>&1 | grep -E '^\{|Error|error' \
      | tee "$OUT/tp.txt"
    ;;
  final)  # e2e decode (36 layers: batch 1 and 32 without adapters; 8 layers: batch x adapters with the peer), int4 table
    timeout 110 python3 benchmarks/bench_e2e.py --layers 36 --batches 1 32 --adapters 0 --peer-cases "" \
      --root /tmp/e2e36 2>&1 | grep -E '^\{|Error' | tee "$OUT/e2e36.txt"
    timeout 250 python3 benchmarks/bench_e2e.py --layers 8 --batches 1 8 32 64 --adapters 0 1 8 32 \
      --peer-cases 32:32,8:8 --root /tmp/e2e8 2>&1 | grep -E '^\{|Error' | tee "$OUT/e2e8.txt"
    timeout 110 python3 benchmarks/bench_int4.py --budget-ms 10 2>&1 | grep -E '^\{|Error' | tee "$OUT/int4.txt"
    ;;
  probe)  # CUDA tests of the changed kernels, int4 launch sweep, engine fast paths (one GPU)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.txt"
    PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
      tests/kernels/test_fused.py tests/kernels/test_int4.py -k "(fused or split_k or accelerator) and not interpreter" \
      2>&1 | tail -25 | tee "$OUT/kernel_tests.txt"
    timeout 150 python3 benchmarks/gpu_engine_check.py 2>&1 | grep -E '^\{|Error' | tee "$OUT/engine_check.txt"
    timeout 220 python3 benchmarks/bench_int4.py --sweep --budget-ms 5 2>&1 | grep -E '^\{|Error' | tee "$OUT/sweep.txt"
    ;;
  e2e36)  # the whole e2e matrix at 36 layers with the peer (one engine per adapter count; not yet run)
    timeout 560 python3 benchmarks/bench_e2e.py --layers 36 --peer-cases 32:32,8:8 --root /tmp/e2e36m 2>&1 \
      | grep -E '^\{|Error' | tee "$OUT/e2e36_matrix.txt"
    ;;
  lora)  # where the adapters' time goes: 8 layers, batch 32, 0 / 1 / 32 adapters (one GPU)
    timeout 200 python3 benchmarks/profile_step.py --layers 8 --batches 32 --adapters 0 1 32 --top 12 2>&1 \
      | grep -E '^\{|Error' | tee "$OUT/profile_lora.txt"
    ;;
  *) echo "usage: run_h200.sh tests|check|tp2|probe|final|lora|e2e36"; exit 2 ;;
esac
