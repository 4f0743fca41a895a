#!/usr/bin/env bash
# Device runs on NVIDIA H200 (see docs/PERFORMANCE.md). Usage: bash benchmarks/run_h200.sh PART
# The image's python3 has torch + triton; the rest travels as wheels in .whl/ (make them with
# tools/device_wheels.sh here, and name .whl in the device call's carry).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# The int4 dispatch tables tuned on an earlier machine of the same GPU (kernels/int4_tune.py's cache, keyed by device
# name, shape and backends): carry .kcache (a copy of an earlier call's $OUT/kcache) and a fresh machine skips the
# timing (the 27B at TP=1: a run that tuned took 174 s, the next 40 s). Every call returns its tables in $OUT/kcache.
if [ -z "${XPULORA_KERNEL_CACHE_DIR:-}" ]; then
  export XPULORA_KERNEL_CACHE_DIR=/tmp/kcache
  mkdir -p /tmp/kcache
  [ -d .kcache ] && cp -n .kcache/*.json /tmp/kcache/ 2>/dev/null
  trap 'mkdir -p "$OUT/kcache" && cp /tmp/kcache/*.json "$OUT/kcache/" 2>/dev/null' EXIT
fi
# 36-layer decode at the given batches (no adapters, tuned int4) from .old (carry it: `git archive <commit before>`)
# and from this tree, one after the other in one call
decode_old_new() {
  for side in old new; do
    dir=$PWD; [ $side = old ] && dir=$PWD/.old
    (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout 170 python3 benchmarks/bench_e2e.py --layers 36 --batches "$@" \
      --adapters 0 --int4-kernel tuned --peer-cases "" --root /tmp/e2e36l 2>&1) \
      | grep --line-buffered -E '"decode"|Error' | sed "s/^/$side /" | tee -a "$OUT/e2e_ab.txt" | cut -c1-330
  done
}
# Nsight Compute, one CSV row per kernel and metric: speed of light, occupancy, launch, warp state and memory
# sections plus the per-reason issue stalls. Usage: ncu_details SECONDS python3 SCRIPT.py > CSV
ncu_details() {
  local limit=$1 stalls
  shift
  stalls=$(for r in long_scoreboard short_scoreboard mio_throttle lg_throttle barrier wait math_pipe_throttle \
    not_selected selected no_instruction dispatch_stall drain membar branch_resolving imc_miss; do
    printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $r; done)
  timeout "$limit" ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --metrics "${stalls%,}" --csv --page details "$@"
}
# One XPULORA_LORA_CONFIG key's modes side by side (cols23: cols; prologue):
# 36-layer decode per mode, the tuned tables shared on the machine. The first mode gets E2E_FIRST_TIMEOUT (default
# E2E_TIMEOUT + 120 s): on a fresh machine it also tunes the int4 dispatch. Usage: config_ab KEY "MODES"
config_ab() {
  local limit=${E2E_FIRST_TIMEOUT:-$((${E2E_TIMEOUT:-200} + 120))}
  for mode in $2; do
    # shellcheck disable=SC2086  # E2E_BATCHES: one or more batch sizes, split into words on purpose
    XPULORA_LORA_CONFIG=$1=$mode timeout "$limit" python3 benchmarks/bench_e2e.py \
      --layers 36 --batches ${E2E_BATCHES:-32} --adapters 0 32 --int4-kernel tuned --peer-cases "" --root /tmp/e2e36l \
      2>&1 | grep --line-buffered -E '^\{"case": "(decode|int4_dispatch)|Error' | sed "s/^/$1=$mode /" \
      | tee -a "$OUT/$1_ab.txt" | cut -c1-420
    limit=${E2E_TIMEOUT:-200}
  done
}
# check's pytest part: kernels, layers and the GPU engine tests, 8 xdist workers where xdist is installed; the log
# in $OUT/tests.txt. Usage: gpu_pytest SECONDS
gpu_pytest() {
  local xdist=()
  python3 -c "import xdist" 2>/dev/null && xdist=(-n 8)
  OMP_NUM_THREADS=2 timeout "$1" python3 -m pytest -v -p no:cacheprovider -rfE --tb=short --timeout 240 --durations=25 \
    --junitxml="$OUT/tests.xml" "${xdist[@]}" tests/kernels tests/layers \
    tests/e2e/test_fused_engine.py tests/e2e/test_kernel_fallback.py tests/e2e/test_lora_engine.py \
    tests/e2e/test_qwen35.py > "$OUT/tests.txt" 2>&1
}
# check's dense engine check (batches 1 3 17), its log in $OUT/engine_check.txt, its exit status in /tmp/rc_engine.
# Usage: engine_dense SECONDS
engine_dense() {
  timeout "$1" python3 benchmarks/gpu_engine_check.py --only dense --batches 1 3 17 --no-sync-check \
    --root /tmp/gpu-check-d > "$OUT/engine_check.txt" 2>&1
  echo $? > /tmp/rc_engine
}
case "${1:-}" in
  tests)
    nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/env.txt"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/layers/test_lora_layers.py 2>&1 | tail -30 | tee "$OUT/kernel_tests.txt"
    timeout 120 python3 benchmarks/check_fla.py 2>&1 | tail -8 | tee "$OUT/fla.txt"
    timeout 200 python3 benchmarks/gpu_engine_check.py 2>&1 | grep --line-buffered -v Warn | tail -12 | tee "$OUT/engine_check.txt"
    ;;
  tp2)  # TP=2 vs TP=1 equality (4 layers) and full-depth decode speed, 2 GPUs
    timeout 570 python3 benchmarks/gpu_tp_check.py --skip collectives ${2:+--speed-shapes $2} 2>&1 \
      | grep --line-buffered -E '^\{|Error|error' | tail -40 | tee "$OUT/tp.txt"
    ;;
  tp2server)  # issue 21, 2 GPUs: TP=2 == TP=1 through the server (API + core + ranks), float32, 8B- and 27B-shaped
              # random int4 (4 layers) with two adapters, both LoRA modes; exit 1 on a difference
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 570 python3 benchmarks/gpu_tp_server_check.py 2>&1 | grep --line-buffered -E '^\{|PASS|FAIL|Error' | tee "$OUT/tp_server.txt"
    grep -q "gpu_tp_server_check: PASS" "$OUT/tp_server.txt"
    ;;
  check)  # every GPU test and check, within the device's 10-minute call; ends with one PASS/FAIL line, exit 1 on FAIL
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.txt"
    python3 -c "import torch, triton, transformers, numpy; print(torch.__version__, triton.__version__, transformers.__version__, numpy.__version__)" | tee -a "$OUT/env.txt"
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    failed=""
    rm -f /tmp/rc_engine /tmp/rc_engine40 /tmp/rc_hybrid /tmp/rc_fla /tmp/rc_device
    # cuda_mma compiles here first (NVRTC, kept in the kernel cache; the others would wait on its lock), so that its
    # time shows apart from the tests' (sixteenth session: three LoRA-engine tests ran past 240 s on a fresh machine).
    SECONDS=0
    timeout 120 python3 -c "import torch; from kernels import int4_cuda as c; c.available() and c.compile_for(torch.zeros(1, device='cuda').device)" \
      || failed="$failed compile"
    echo "cuda_mma compiled in $SECONDS s" | tee "$OUT/compile.txt"
    left=$(( 570 - SECONDS ))  # the call's 600 s, less the compile and the summary
    # The scripts run beside pytest (one GPU, ~140 GiB: room for all); each writes its own log. The engine check
    # runs in three parts side by side: on a fresh machine its first engines time the int4 shapes (auto = tuned),
    # and the dense half in one process passed 540 s once a fifth check joined it (eleventh session).
    (engine_dense $left; echo "engine dense 1 3 17: $SECONDS s") &
    (timeout $left python3 benchmarks/gpu_engine_check.py --only dense --batches 40 --root /tmp/gpu-check-d40 \
       > "$OUT/engine_check40.txt" 2>&1; echo $? > /tmp/rc_engine40; echo "engine dense 40: $SECONDS s") &
    (timeout $left python3 benchmarks/gpu_engine_check.py --only hybrid --root /tmp/gpu-check-h > "$OUT/engine_hybrid.txt" 2>&1
     echo $? > /tmp/rc_hybrid; echo "engine hybrid: $SECONDS s") &
    (timeout 200 python3 benchmarks/check_fla.py > "$OUT/fla.txt" 2>&1; echo $? > /tmp/rc_fla) &
    (timeout 200 python3 -c "import sys; from server.cli import main; sys.exit(main())" check-device \
       > "$OUT/check_device.txt" 2>&1; echo $? > /tmp/rc_device) &
    gpu_pytest $(( left - 40 )) || failed="$failed tests"
    wait
    for part in engine engine40 hybrid fla device; do [ "$(cat /tmp/rc_$part 2>/dev/null)" = 0 ] || failed="$failed $part"; done
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      timeout 300 python3 benchmarks/gpu_tp_check.py --skip collectives speed > "$OUT/tp.txt" 2>&1 || failed="$failed tp2"
    fi
    tail -n 8 "$OUT/tests.txt"; grep -hE 'PASS|FAIL|"ok": false|Error' "$OUT"/engine_check.txt "$OUT"/engine_check40.txt "$OUT"/engine_hybrid.txt "$OUT"/fla.txt | tail -n 12
    cat "$OUT/check_device.txt" | grep -v '^INFO'
    if [ -n "$failed" ]; then echo "run_h200 check: FAIL ($failed )"; exit 1; fi
    echo "run_h200 check: PASS"
    ;;
  check-short)  # check's core in ${CHECK_S:-380} s, for a call with little device time left: the pytest part and the
                # dense engine check (batches 1 3 17) side by side; exit 1 on a failure or a timeout
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/env.txt"
    limit=${CHECK_S:-380}
    rm -f /tmp/rc_engine
    engine_dense "$limit" &
    gpu_pytest "$limit"; rc=$?
    wait
    tail -n 6 "$OUT/tests.txt"; grep -hE 'PASS|FAIL|"ok": false|Error' "$OUT/engine_check.txt" | tail -n 8
    echo "pytest rc=$rc engine rc=$(cat /tmp/rc_engine)"
    [ $rc = 0 ] && [ "$(cat /tmp/rc_engine)" = 0 ] || { echo "run_h200 check-short: FAIL"; exit 1; }
    echo "run_h200 check-short: PASS"
    ;;
  pytest)  # check's pytest part alone (gpu_pytest); exit 1 on a failure
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/env.txt"
    gpu_pytest "${PYTEST_TIMEOUT:-300}"
    rc=$?; tail -n 6 "$OUT/tests.txt"; echo "pytest rc=$rc"; [ $rc = 0 ] || exit 1
    ;;
  ab)  # 36-layer decode (no adapters, tuned int4) at ${AB_BATCHES:-1 32} from .old (carry it: `git archive <commit
      # before>`) and from this tree, alternated ${AB_ROUNDS:-2} times: old, new, old, new
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    # shellcheck disable=SC2086  # AB_BATCHES: a list, split into words on purpose
    for _ in $(seq "${AB_ROUNDS:-2}"); do decode_old_new ${AB_BATCHES:-1 32}; done
    ;;
  final)  # e2e decode (36 layers: batch 1 and 32 without adapters; 8 layers: batch x adapters with the peer), int4 table
    timeout 110 python3 benchmarks/bench_e2e.py --layers 36 --batches 1 32 --adapters 0 --peer-cases "" \
      --root /tmp/e2e36 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/e2e36.txt"
    timeout 250 python3 benchmarks/bench_e2e.py --layers 8 --batches 1 8 32 64 --adapters 0 1 8 32 \
      --peer-cases 32:32,8:8 --root /tmp/e2e8 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/e2e8.txt"
    timeout 110 python3 benchmarks/bench_int4.py --budget-ms 10 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/int4.txt"
    ;;
  probe)  # CUDA tests of the changed kernels, int4 launch sweep, engine fast paths (one GPU)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.txt"
    PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
      tests/kernels/test_fused.py tests/kernels/test_int4.py -k "(fused or split_k or accelerator) and not interpreter" \
      2>&1 | tail -25 | tee "$OUT/kernel_tests.txt"
    timeout 150 python3 benchmarks/gpu_engine_check.py 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/engine_check.txt"
    timeout 220 python3 benchmarks/bench_int4.py --sweep --budget-ms 5 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/sweep.txt"
    ;;
  e2e36)  # the whole e2e matrix at 36 layers with the peer (one engine per adapter count; not yet run)
    timeout 560 python3 benchmarks/bench_e2e.py --layers 36 --peer-cases 32:32,8:8 --root /tmp/e2e36m 2>&1 \
      | grep --line-buffered -E '^\{|Error' | tee "$OUT/e2e36_matrix.txt"
    ;;
  lora)  # where the adapters' time goes: 8 layers, batch 32, 0 / 1 / 32 adapters (one GPU)
    timeout 200 python3 benchmarks/profile_step.py --layers 8 --batches 32 --adapters 0 1 32 --top 12 2>&1 \
      | grep --line-buffered -E '^\{|Error' | tee "$OUT/profile_lora.txt"
    ;;
  serve)  # the engine-core issue on one H200: fast paths vs reference (quick), then the server vs the offline loop vs
          # pure decode on the 36-layer model with 32 adapters (one model, one engine, one server)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 150 python3 benchmarks/gpu_engine_check.py --quick --device cuda 2>&1 | grep --line-buffered -E '^\{|PASS|FAIL|Error' \
      | tee "$OUT/engine_check.txt"
    timeout 420 python3 benchmarks/bench_serve.py --layers 36 --adapters 32 --batches 32 64 --requests 256 \
      --new-tokens 128 --clients 4 --root /tmp/serve36 2>&1 | grep --line-buffered -E '^\{|Error|Traceback' | tee "$OUT/serve.txt"
    tail -n 60 /tmp/serve36/server.log > "$OUT/server_log_tail.txt" 2>/dev/null
    ;;
  async)  # issue 14 after async scheduling, one H200: engine check (async == sync == reference; no implicit host sync in
          # steady-state steps), then the server vs the offline loop vs pure decode, each loop also with async off
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 190 python3 benchmarks/gpu_engine_check.py --quick --device cuda > "$OUT/engine_check.txt" 2>&1
    grep -E '^\{|PASS|FAIL|Error' "$OUT/engine_check.txt"
    timeout 380 python3 benchmarks/bench_serve.py --layers 36 --adapters 32 --batches 32 64 --requests 256 \
      --new-tokens 128 --clients 4 --sync-too --root /tmp/serve36 2>&1 | grep --line-buffered -E '^\{|Error|Traceback' | tee "$OUT/serve.txt"
    tail -n 40 /tmp/serve36/server.log > "$OUT/server_log_tail.txt" 2>/dev/null
    ;;
  int4)  # issue 18: the int4 kernels side by side with bf16 (new triton_mma sweep, old Triton, native, dequant), every
          # output checked vs the reference (exit 1 on mismatch), the tuner's tables; then the int4 tests on CUDA
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 60 python3 tools/int4_ir.py > "$OUT/ir.jsonl" 2>&1
    timeout 280 python3 benchmarks/bench_int4.py > "$OUT/int4.txt" 2>&1; echo "bench rc=$?" >> "$OUT/int4.txt"
    timeout 230 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_int4.py tests/layers/test_int4_auto.py \
      tests/kernels/test_kernel_checks.py > "$OUT/int4_tests.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/int4_tests.txt"
    grep -E "targets|correctness|rc=" "$OUT/int4.txt"; tail -4 "$OUT/int4_tests.txt"
    ;;
  serve64)  # the serving run at concurrency 64 only (the last minutes of a session)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 290 python3 benchmarks/bench_serve.py --layers 36 --adapters 32 --batches 64 --requests 256 \
      --new-tokens 128 --clients 4 --sync-too --root /tmp/serve36 2>&1 | grep --line-buffered -E '^\{|Error|Traceback' | tee "$OUT/serve.txt"
    ;;
  plan)  # where the loop's time goes on the serving plan, async scheduling on and off, and its implicit host syncs
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 400 python3 benchmarks/profile_plan.py --layers 36 --adapters 32 --batch ${2:-32} --requests ${3:-128} \
      --new-tokens 128 --root /tmp/plan36 > "$OUT/plan.txt" 2>&1
    grep -E '^\{|Error|Traceback' "$OUT/plan.txt"
    ;;
  lora-fill)  # issue 14: one rank-16 adapter's slot fill at 36 Qwen3-8B layers, per-slice copies vs the packed fill
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/layers/test_lora_slots.py 2>&1 | tail -3 | tee "$OUT/fill_tests.txt"
    timeout 200 python3 benchmarks/bench_lora_fill.py --layers 36 --rank 16 --r-max 16 2>&1 | grep --line-buffered -E '^\{|Error' \
      | tee "$OUT/fill.txt"
    ;;
  lora-kernels)  # issue 18: LoRA kernel tests on CUDA, then the per-layer table and 36-layer step lines vs bytes
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_triton.py tests/layers/test_lora_layers.py \
      tests/layers/test_lora_triton_wrappers.py 2>&1 | tail -4 | tee "$OUT/lora_tests.txt"
    timeout 220 python3 benchmarks/bench_lora.py --tokens 32 --adapters 1 32 --no-peers 2>&1 | grep --line-buffered -E '^\{|Error' \
      | tee "$OUT/lora_kernels.txt"
    ;;
  lora-sweep)  # issue 18: launch parameters one at a time (${2:-split}: split, fused or cols), decode, 32 tokens
    timeout 230 python3 benchmarks/bench_lora.py --sweep --variants "${2:-split}" --lora-dtypes model 2>&1 \
      | grep --line-buffered -E '^\{|Error' | tee "$OUT/lora_sweep_${2:-split}.txt"
    ;;
  lora-e2e)  # issue 18: 36 layers, batch 32, 0 and 32 adapters, bf16 and fp8 storage (XPULORA_LORA_CONFIG=fused=1 for the other variant)
    timeout 230 python3 benchmarks/bench_e2e.py --layers 36 --batches 32 --adapters 0 32 --lora-dtypes auto fp8 \
      --peer-cases "" --root /tmp/e2e36l 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/lora_e2e${XPULORA_LORA_CONFIG:+_tuned}.txt"
    ;;
  kernels18)  # issue 18 in one call: the int4 table vs bf16 (every launch shape, fold included, checked: exit 1 on
              # mismatch), the mma kernel's and the tuner's tests on CUDA, the LoRA per-layer table vs its bytes
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 300 python3 benchmarks/bench_int4.py > "$OUT/int4.txt" 2>&1; echo "bench rc=$?" >> "$OUT/int4.txt"
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/layers/test_int4_auto.py tests/kernels/test_int4.py \
      -k "accelerator and (mma or tun or int4_auto)" > "$OUT/int4_tests.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/int4_tests.txt"
    timeout 170 python3 benchmarks/bench_lora.py --tokens 32 --adapters 1 32 --no-peers > "$OUT/lora_kernels.txt" 2>&1
    echo "lora rc=$?" >> "$OUT/lora_kernels.txt"
    grep -E "targets|correctness|PASS|FAIL|rc=" "$OUT/int4.txt" | tail -40; tail -3 "$OUT/int4_tests.txt"
    grep -E '^\{' "$OUT/lora_kernels.txt" | tail -30; tail -1 "$OUT/lora_kernels.txt"
    ;;
  lora-ab)  # issue 18: the LoRA kernels' CUDA tests, then the per-layer table (decode, 32 tokens, 1 and 32 adapters)
            # from .old (carry it: `git archive <commit before>`) and from this tree, one after the other
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 220 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_triton.py \
      tests/layers/test_lora_triton_wrappers.py > "$OUT/lora_tests.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/lora_tests.txt"
    tail -4 "$OUT/lora_tests.txt"
    for side in old new; do
      dir=$PWD; [ $side = old ] && dir=$PWD/.old
      (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout 150 python3 benchmarks/bench_lora.py --tokens 32 --adapters 1 32 \
        --no-peers --lora-dtypes model --variants split 2>&1) | grep --line-buffered -E '^\{|Error' \
        | sed "s/^/$side /" | tee -a "$OUT/lora_ab.txt" | grep -E '"step"|Error'
    done
    ;;
  cols23)  # issue 18: the column expand (kernels/lora_cols.py): its CUDA tests, the per-layer LoRA table (split vs
           # cols, decode 32 and 64 tokens, 1 and 32 adapters, bf16), then 36-layer decode per ${COLS_MODES:-0 32} (cols=N: steps of up to N tokens)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_lora_triton.py -k "cols or column" \
      > "$OUT/cols_tests.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/cols_tests.txt"; tail -3 "$OUT/cols_tests.txt"
    # shellcheck disable=SC2086  # COLS_TOKENS, COLS_DTYPES: lists, split into words on purpose
    timeout 160 python3 benchmarks/bench_lora.py --tokens ${COLS_TOKENS:-32 64} --adapters 1 32 --no-peers \
      --lora-dtypes ${COLS_DTYPES:-model} --variants split cols 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/cols_lora.txt" | grep -E '"step"|Error'
    config_ab cols "${COLS_MODES:-0 32}"
    ;;
  prologue)  # issue 18: the LoRA shrink joined to the norm / silu-and-mul launch: its CUDA tests, 36-layer decode per
              # mode of PROLOGUE_E2E (e.g. "0 32 32,prologue_warps=8"), then the per-layer table against the separate
              # launches (32 tokens, PROLOGUE_ADAPTERS adapters)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_prologue.py 2>&1 | tail -4 | tee "$OUT/prologue_tests.txt"
    [ -n "${PROLOGUE_E2E:-}" ] && config_ab prologue "$PROLOGUE_E2E"
    timeout 150 python3 benchmarks/bench_prologue.py --tokens ${PROLOGUE_TOKENS:-32} --adapters ${PROLOGUE_ADAPTERS:-1 8 32} \
      2>&1 | tee "$OUT/prologue.txt"
    ;;
  steps18)  # issue 18: 36 layers, batch 1 and 32: no adapters with the int4 kernel auto, then with tuned also 32 adapters
            # (bf16 and fp8 storage); the 64-layer 27B-shaped hybrid at TP=1 (batch 1 and 32, graphs, tuned int4)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 110 python3 benchmarks/bench_e2e.py --layers 36 --batches 1 32 --adapters 0 --int4-kernel auto \
      --peer-cases "" --root /tmp/e2e36l 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/e2e36_auto.txt"
    timeout 220 python3 benchmarks/bench_e2e.py --layers 36 --batches 1 32 --adapters 0 32 --lora-dtypes auto fp8 \
      --int4-kernel tuned --peer-cases "" --root /tmp/e2e36l 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/e2e36_tuned.txt"
    timeout 220 python3 benchmarks/gpu_tp_check.py --layers 1 --skip collectives equal --tp-sizes 1 --int4-kernel tuned \
      --speed-shapes 27b 2>&1 | grep --line-buffered -E '^\{|Error|error' | tee "$OUT/tp1_27b.txt"
    ;;
  ncu18)  # issue 18: Nsight Compute on one launch each of the copy, bf16, native and mma int4 kernels (M = 1, 16)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    ncu_details "${2:-200}" \
      python3 benchmarks/ncu_int4.py > "$OUT/ncu.csv" 2> "$OUT/ncu_cases.txt"; echo "ncu rc=$?" | tee -a "$OUT/ncu_cases.txt"
    grep -E '^\{' "$OUT/ncu_cases.txt" | tail -3; grep -c '"Duration"' "$OUT/ncu.csv"
    ;;
  ncu-lora)  # issue 18: Nsight Compute on add_lora's two launches per Qwen3-8B wrapped layer (32 tokens over 32 and
             # over 1 rank-16 adapters, bf16; split and column expand), each beside a copy of the bytes it must read
             # (benchmarks/ncu_lora.py)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    ncu_details "${2:-200}" \
      python3 benchmarks/ncu_lora.py > "$OUT/ncu_lora.csv" 2> "$OUT/ncu_lora_cases.txt"
    echo "ncu rc=$?" | tee -a "$OUT/ncu_lora_cases.txt"
    grep -E '^\{"checked' "$OUT/ncu_lora_cases.txt"; grep -c '"Duration"' "$OUT/ncu_lora.csv"
    ;;
  gemv18)  # issue 18: the one-row int4 kernel (triton_gemv) on CUDA: its tests, the int4 table at M = 1 4 16 with its
           # sweep and the tuner's tables, then 36-layer batch-1 decode with the old fixed dispatch vs tuned (gemv)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_int4.py tests/layers/test_int4_auto.py \
      -k "accelerator" > "$OUT/int4_tests.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/int4_tests.txt"; tail -3 "$OUT/int4_tests.txt"
    timeout 200 python3 benchmarks/bench_int4.py --ms 1 4 16 > "$OUT/int4.txt" 2>&1; echo "bench rc=$?" >> "$OUT/int4.txt"
    grep -E "targets|correctness|tuner|rc=" "$OUT/int4.txt" | cut -c1-600
    grep -E '"M": 1,' "$OUT/int4.txt" | python3 -c "import sys,json; [print(r['K'],r['N'],'bf16',r['bf16_us'],'native',r.get('native_us'),'mma',r.get('mma_us'),'gemv',r.get('gemv_us'),r.get('gemv_best')) for r in map(json.loads,sys.stdin)]"
    for kern in auto:native_cuda tuned; do
      timeout 120 python3 benchmarks/bench_e2e.py --layers 36 --batches 1 --adapters 0 --int4-kernel $kern \
        --peer-cases "" --root /tmp/e2e36l 2>&1 | grep --line-buffered -E '^\{|Error' | tee "$OUT/e2e36_b1_${kern/:/_}.txt" | cut -c1-400
    done
    ;;
  cuda18)  # issue 18: the CUDA C int4 kernel (cuda_mma, NVRTC): its CUDA tests, then the int4 table at M = 1-64 on the
           # Qwen3-8B shapes with every launch shape checked and timed, and the tuner's tables (exit 1 on a mismatch)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    python3 -c "import torch; print(torch.__version__, torch.version.cuda)" | tee "$OUT/env.txt"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/kernels/test_int4_cuda.py \
      > "$OUT/cuda_tests.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/cuda_tests.txt"; tail -25 "$OUT/cuda_tests.txt" | cut -c1-700
    timeout 300 python3 benchmarks/bench_int4.py --shapes ${SHAPES:-8b} --ms ${MS:-1 4 16 32 64} > "$OUT/int4.txt" 2>&1
    echo "bench rc=$?" >> "$OUT/int4.txt"
    sed -n '/K x N/,$p' "$OUT/int4.txt" | cut -c1-400
    grep -E '^\{' "$OUT/int4.txt" | python3 -c "import sys,json; [print(r['K'],r['N'],r['M'],'bf16',r['bf16_us'],'native',r.get('native_us'),'mma',r.get('mma_us'),'cuda',r.get('cuda_us'),r.get('cuda_sweep')) for r in map(json.loads,sys.stdin) if 'M' in r]"
    ;;
  ab18)  # issue 18: the int4 table at M = 16 / 32 (new launch shapes), then 36-layer decode at batch 1 and 32 (no
         # adapters) from .old (carry it: `git archive <commit before>`) and from this tree, in one call; then where
         # the new batch-1 step's device time goes
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 150 python3 benchmarks/bench_int4.py --shapes 8b --ms 16 32 --no-tuner > "$OUT/int4_ab.txt" 2>&1
    echo "bench rc=$?" >> "$OUT/int4_ab.txt"; sed -n '/K x N/,$p' "$OUT/int4_ab.txt" | cut -c1-200
    decode_old_new 1 32
    timeout 120 python3 benchmarks/bench_mixed.py --layers 36 --adapters 0 --batches 2 33 --prompts 0 --top 14 \
      --root /tmp/e2e36l 2>&1 | grep -v Warn | tail -40 | tee "$OUT/mixed_b1.txt" | cut -c1-200
    ;;
  split18)  # issue 18: cuda_mma with K split over the grid in the tuner's candidates (eighteenth session): the int4 table
            # at M = 16 / 32 / 64 (every launch shape checked and timed, the tuner's tables), then 36-layer decode at
            # batch 32 and 64 (no adapters, tuned) from .old (carry it: `git archive <commit before>`) and this tree
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 200 python3 benchmarks/bench_int4.py --shapes 8b --ms 16 32 64 > "$OUT/int4.txt" 2>&1
    echo "bench rc=$?" >> "$OUT/int4.txt"; sed -n '/K x N/,$p' "$OUT/int4.txt" | cut -c1-300
    grep -E '^\{' "$OUT/int4.txt" | python3 -c "import sys,json; [print(r['K'],r['N'],r['M'],'bf16',r['bf16_us'],'cuda',r.get('cuda_us'),sorted((v,k) for k,v in (r.get('cuda_sweep') or {}).items())[:4]) for r in map(json.loads,sys.stdin) if 'M' in r]"
    # shellcheck disable=SC2086  # E2E_BATCHES: one or more batch sizes, split into words on purpose
    decode_old_new ${E2E_BATCHES:-32 64}
    ;;
  recheck18)  # issue 18: what the fifteenth session's `check` failed, after its fixes (cuda_mma needs K % 256, fewer
              # launch shapes, the compiled module cached on disk): the cuda_mma tests, the LoRA engine tests, and the
              # dense engine check at batch 17, side by side (less than the whole `check`; the device time ran out)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    (timeout 230 python3 benchmarks/gpu_engine_check.py --only dense --batches 17 --no-sync-check \
       --root /tmp/gpu-check-d > "$OUT/engine_check17.txt" 2>&1; echo "engine check rc=$?" >> "$OUT/engine_check17.txt") &
    timeout 230 python3 -m pytest -q -p no:cacheprovider -rfE --durations=8 -n 4 tests/kernels/test_int4_cuda.py \
      tests/e2e/test_lora_engine.py "tests/kernels/test_int4.py::test_accelerator_backend_matches_reference" \
      > "$OUT/tests18.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/tests18.txt"
    wait
    tail -16 "$OUT/tests18.txt" | cut -c1-200; grep -E '"ok"|PASS|FAIL|rc=' "$OUT/engine_check17.txt" | cut -c1-160
    ;;
  mixed14)  # issue 14: what a prompt costs the decode step it joins (36 layers, 32 adapters, B-1 decoding + one
            # P-token arrival per step; kernels by name), then the int4 kernel tests on CUDA (gemv included)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 330 python3 benchmarks/bench_mixed.py --layers 36 --adapters 32 --batches 32 64 --prompts 0 16 32 64 128 \
      --root /tmp/mixed36 2>&1 | grep --line-buffered -E '^\{|Error|Traceback' | tee "$OUT/mixed.txt" | cut -c1-300
    timeout 220 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_int4.py tests/layers/test_int4_auto.py \
      -k "accelerator" > "$OUT/int4_tests.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/int4_tests.txt"; tail -3 "$OUT/int4_tests.txt"
    ;;
  attn14)  # issue 14: mixed steps' attention split between the decode and prefill kernels: CUDA attention tests,
           # the engine check (tiny shapes: mixed-step graphs vs the torch reference), bench_mixed at batch 64
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_attention_triton.py > "$OUT/attn_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/attn_tests.txt"; tail -3 "$OUT/attn_tests.txt"
    timeout 150 python3 benchmarks/gpu_engine_check.py --quick --root /tmp/gpu-check-q 2>&1 | grep --line-buffered -E '^\{|PASS|FAIL|Error' \
      | tee "$OUT/engine_check.txt" | cut -c1-160
    timeout 200 python3 benchmarks/bench_mixed.py --layers 36 --adapters 32 --batches 64 --prompts 0 16 64 \
      --root /tmp/mixed36 2>&1 | grep --line-buffered -E '^\{|Error|Traceback' | tee "$OUT/mixed.txt" | cut -c1-400
    ;;
  burst18)  # issue 14: the opening burst (c prompts at an idle engine), 36 layers, 32 adapters: the default (graphs and
            # budget 2048), then graphs up to 512 (the budget follows), then budget 2048 with graphs up to 512 (eager steps)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 200 python3 benchmarks/bench_burst.py --layers 36 --adapters 32 --batches 32 64 --budgets 0 \
      --root /tmp/burst36 2>&1 | grep --line-buffered -E '^\{|Error|Traceback' | tee "$OUT/burst.txt"
    timeout 330 python3 benchmarks/bench_burst.py --layers 36 --adapters 32 --batches 32 64 --budgets 0 2048 \
      --max-mixed-graph-tokens 512 --root /tmp/burst36 2>&1 | grep --line-buffered -E '^\{|Error|Traceback' \
      | tee -a "$OUT/burst.txt"
    ;;
  prefill18)  # issues 14/18: the LoRA kernels' launch shapes in prefill steps (64-prompt burst, graphs up to 2048):
              # the default, the shrink without K splits (its grid is large at these token counts), longer token runs
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    for cfg in "" shrink_split_k=1 run_m=64 shrink_split_k=1,run_m=64; do
      XPULORA_LORA_CONFIG=$cfg timeout 140 python3 benchmarks/bench_burst.py --layers 36 --adapters 32 --batches 64 \
        --repeats 2 --root /tmp/burst36 2>&1 | grep --line-buffered -E '^\{|Error|Traceback' | tee -a "$OUT/prefill.txt" \
        | grep --line-buffered '^{' | python3 -c "import sys,json; [print(r['lora_config'] or 'default', r['last_ms'], r['device_us'], dict(r['top_kernels']).get('_lora_expand_kernel'), dict(r['top_kernels']).get('_lora_shrink_kernel')) for r in map(json.loads, sys.stdin) if r.get('case') == 'burst']"
    done
    ;;
  serve18)  # issue 14 after the tuned int4 default: the server vs the offline loop vs pure decode, 36 layers, 32 adapters
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    # shellcheck disable=SC2086  # BATCHES="64": one concurrency only; MNBT=128: tokens per step on both sides;
    # MMGT=2048: mixed-step graphs up to 2048 tokens on both sides (the default budget follows)
    timeout 520 python3 benchmarks/bench_serve.py --layers 36 --adapters 32 --batches ${BATCHES:-32 64} --requests 256 \
      --new-tokens 128 --clients 4 --root /tmp/serve36 ${MNBT:+--max-num-batched-tokens $MNBT} \
      ${MMGT:+--max-mixed-graph-tokens $MMGT} 2>&1 \
      | tee "$OUT/serve_log.txt" | grep --line-buffered -E '^\{|Error|Traceback' | tee "$OUT/serve.txt"
    grep -hE "captured|KV cache" "$OUT/serve_log.txt" /tmp/serve36/server.log 2>/dev/null | cut -c1-300
    tail -n 40 /tmp/serve36/server.log > "$OUT/server_log_tail.txt" 2>/dev/null
    ;;
  graphs4096)  # issue 14: mixed-step graphs up to 4096 tokens (the budget follows) against the 2048 default: the
              # server at c=64 with 4096 (serve18 figures at 2048 are the twelfth session's), then the opening burst
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    date +%T; MMGT=4096 BATCHES=64 bash "$0" serve18; date +%T
    for g in 4096 2048; do
      timeout 200 python3 benchmarks/bench_burst.py --layers 36 --adapters 32 --batches 64 128 --budgets 0 \
        --max-mixed-graph-tokens $g --root /tmp/burst36 2>&1 | grep --line-buffered -E '^\{|Error|Traceback' \
        | tee -a "$OUT/burst.txt"; date +%T
    done
    ;;
  gdn30)  # the Gated DeltaNet kernels (kernels/gdn_triton.py): their CUDA tests, bench_gdn_decode (the recurrence, the
          # conv and the gated norm against the forms they replaced), then the hybrid engine check; exit 1 on a failure
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    failed=""
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_triton.py tests/kernels/test_gdn.py \
      tests/kernels/test_kernel_checks.py > "$OUT/gdn_tests.txt" 2>&1 || failed="$failed tests"
    tail -n 3 "$OUT/gdn_tests.txt"
    timeout 90 python3 benchmarks/bench_gdn_decode.py 2>&1 | tee "$OUT/gdn_decode.txt" | cut -c1-700
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed bench"
    timeout "${HYBRID_S:-330}" python3 benchmarks/gpu_engine_check.py --only hybrid --root /tmp/gpu-check-h \
      > "$OUT/engine_hybrid.txt" 2>&1 || failed="$failed hybrid"
    grep -hE 'PASS|FAIL|"ok": false|Error' "$OUT/engine_hybrid.txt" | tail -n 8
    if [ -n "$failed" ]; then echo "run_h200 gdn30: FAIL ($failed )"; exit 1; fi
    echo "run_h200 gdn30: PASS"
    ;;
  gdn30-e2e)  # the 27B-shaped hybrid at TP=1 (64 layers, graphs, tuned int4), batch 1 and 32: this tree, .old, this tree
              # (carry .old: `git archive c203b60`, before the GDN kernels); the first run also tunes the int4 dispatch.
              # GDN_BENCH=1: bench_gdn_decode.py first, the sides "new old" only, then profile_step --shape 27b (one call)
    limit=260 sides="new old new"
    if [ -n "${GDN_BENCH:-}" ]; then
      sides="new old"
      PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 90 python3 benchmarks/bench_gdn_decode.py 2>&1 | tee "$OUT/gdn_decode.txt" \
        | cut -c1-700
    fi
    for side in $sides; do
      dir=$PWD; [ $side = old ] && dir=$PWD/.old
      (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout $limit python3 benchmarks/gpu_tp_check.py --layers 1 --skip \
        collectives equal --tp-sizes 1 --int4-kernel tuned --speed-shapes 27b --root /tmp/tp27 2>&1) \
        | grep --line-buffered -E '"bench"|Error' | sed "s/^/$side /" | tee -a "$OUT/tp1_27b.txt" | cut -c1-330
      limit=140
    done
    if [ -n "${GDN_BENCH:-}" ]; then  # then where this tree's 27B step goes (16 layers, kernels of one eager forward)
      PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 150 python3 benchmarks/profile_step.py --shape 27b --layers 16 \
        --batches 1 32 --int4-kernel tuned --top 24 2>&1 | grep --line-buffered -E '"part"|Error' \
        | tee "$OUT/profile27b.txt" | cut -c1-3000
    fi
    ;;
  gdn31)  # the thirty-first session's last GDN form (the gating inside the recurrence, the norm its own launch; not yet
          # run on CUDA): its CUDA tests, bench_gdn_decode (joined_* against the three launches), the hybrid engine's
          # triton-GDN check; exit 1 on a failure. Then, in the next call, `GDN_BENCH=1 ... gdn30-e2e` with .old =
          # `git archive 04c8437` (the one-launch form with the norm, measured in the thirty-first session's call 1)
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    failed=""
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_triton.py tests/kernels/test_skinny.py \
      tests/kernels/test_kernel_checks.py \
      > "$OUT/gdn_tests.txt" 2>&1 || failed="$failed tests"
    tail -n 2 "$OUT/gdn_tests.txt"
    timeout 90 python3 benchmarks/bench_gdn_decode.py 2>&1 | tee "$OUT/gdn_decode.txt" | cut -c1-300
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed bench"
    timeout 300 python3 benchmarks/gpu_engine_check.py --only hybrid --hybrid-triton-only --root /tmp/gpu-check-h \
      2>&1 | grep --line-buffered -E 'PASS|FAIL|"check"|Error' | tee "$OUT/engine_hybrid.txt" | cut -c1-200
    [ "${PIPESTATUS[0]}" = 0 ] || failed="$failed hybrid"
    if [ -n "$failed" ]; then echo "run_h200 gdn31: FAIL ($failed )"; exit 1; fi
    echo "run_h200 gdn31: PASS"
    ;;
  e2e27b)  # the 27B-shaped hybrid at TP=1 (64 layers, graphs, tuned int4), batch 1 and 32, per tree of E2E_SIDES
           # (default "new old": this tree, then .old; any other name X is the tree in .X, carried), then where this
           # tree's 27B step goes (profile_step, 16 layers). Carry .kcache (an earlier call's $OUT/kcache) to skip tuning
    limit=${E2E27_FIRST_S:-260}
    for side in ${E2E_SIDES:-new old}; do
      dir=$PWD; [ "$side" != new ] && dir=$PWD/.$side
      (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout "$limit" python3 benchmarks/gpu_tp_check.py --layers 1 --skip \
        collectives equal --tp-sizes 1 --int4-kernel tuned --speed-shapes 27b --root /tmp/tp27 2>&1) \
        | grep --line-buffered -E '"bench"|Error' | sed "s/^/$side /" | tee -a "$OUT/tp1_27b.txt" | cut -c1-330
      limit=140
    done
    PYTHONPATH=$PWD:${PYTHONPATH:-} timeout "${PROFILE_S:-150}" python3 benchmarks/profile_step.py --shape 27b \
      --layers 16 --batches 1 32 --int4-kernel tuned --top 24 2>&1 | grep --line-buffered -E '"part"|Error' \
      | tee "$OUT/profile27b.txt" | cut -c1-3000
    ;;
  fp8cols34)  # issue 18: fp8 adapters on the decode kernels (thirty-fourth session: the column expand and the shrink
              # joined to the norm / silu-and-mul take fp8): their CUDA tests, then the per-layer LoRA step lines at
              # 32 tokens over 1 and 32 adapters, split vs cols, bf16 vs fp8 storage
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_lora_triton.py \
      tests/kernels/test_lora_prologue.py -k "column_expand or fp8 or one_token or start_up" \
      > "$OUT/fp8cols_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/fp8cols_tests.txt"; tail -4 "$OUT/fp8cols_tests.txt"
    timeout "${FP8_BENCH_S:-150}" python3 benchmarks/bench_lora.py --tokens 32 --adapters 1 32 --variants split cols \
      --lora-dtypes model fp8 --no-peers 2>&1 | grep --line-buffered -E '"step"|Error' | tee "$OUT/fp8cols_steps.txt" \
      | cut -c1-400
    ;;
  order35)  # issue 18: the LoRA decode kernels' loads in chain order (thirty-fifth session) against .old2 (carry it:
            # `git archive` of the tree before): their CUDA tests, bench_prologue per tree (old, new, old, new) and
            # at three K splits of the joined op, then 36-layer decode at batch 32, 0 / 1 / 32 adapters per tree
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_prologue.py tests/kernels/test_lora_triton.py \
      -k "prologue or column or fp8 or one_token or start_up" > "$OUT/order_tests.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/order_tests.txt"; tail -3 "$OUT/order_tests.txt"
    for side in old2 new old2 new; do
      dir=$PWD; [ $side != new ] && dir=$PWD/.$side
      (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout 90 python3 benchmarks/bench_prologue.py --tokens 32 --adapters 1 32 \
        2>&1) | grep -E '"bench"|Error|differ' | sed "s/^/$side /" | tee -a "$OUT/order_prologue.txt" | cut -c1-420
    done
    for cfg in prologue_split_k=4 prologue_split_k=16 prologue_split_k=32; do  # the joined op's K chunks (default 8)
      XPULORA_LORA_CONFIG=$cfg timeout 60 python3 benchmarks/bench_prologue.py --tokens 32 --adapters 1 32 2>&1 \
        | grep -E '"bench"|Error|differ' | sed "s/^/new $cfg /" | tee -a "$OUT/order_prologue.txt" | cut -c1-420
    done
    for side in old2 new; do
      dir=$PWD; [ $side != new ] && dir=$PWD/.$side
      (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout "${ORDER_E2E_S:-200}" python3 benchmarks/bench_e2e.py --layers 36 \
        --batches 32 --adapters 0 1 32 --int4-kernel tuned --peer-cases "" --root /tmp/e2e36l 2>&1) \
        | grep --line-buffered -E '^\{"case": "decode"|Error' | sed "s/^/$side /" | tee -a "$OUT/order_e2e.txt" | cut -c1-330
    done
    ;;
  *) echo "usage: run_h200.sh tests|check|pytest|ab|tp2|probe|final|lora|e2e36|serve|async|serve64|plan|int4|lora-fill|lora-kernels|lora-sweep|lora-e2e|kernels18|ncu18|steps18|gemv18|mixed14|attn14|serve18|tp2server|burst18|prefill18|graphs4096|split18|lora-ab|cols23|gdn30|gdn30-e2e|gdn31|e2e27b|fp8cols34|order35"; exit 2 ;;
esac
