#!/usr/bin/env bash
# The H200 benches in one call (device tool; run from the repository root). Each bench runs under its
# own time limit and writes its JSON to $OUT; a failing or timed-out bench does not stop the others.
# tuning_rank tunes the runtime bench's rank preset (decode, batch 1, at context TUNE_CONTEXT, default 8192,
# TUNE_TRIALS trials per kernel, default 5) into the repository's store, so a
# later runtime section in the same call uses the records; the store is copied to $OUT. long_context runs
# bench_attention.py's hbm + step sections alone (indexer + sparse MLA vs dense MLA per decode step at 32K,
# 128K, 1M context, batch 16; the indexer / MLA structure from the heuristics). attention_decode and
# moe_decode are the kernel-family decode sweeps (bench_attention_decode.py; bench_moe.py's decode section at
# MOE_DECODE_SHAPES, default T=64 top-16, T=1 and T=8 top-2). parallel needs
# 2+ GPUs (kind nvidia-h200-x2 or larger; NVLink multicast off).
#
#   bash benches/h200_suite.sh [SECTION ...]     sections: tuning tuning_rank attention long_context runtime moe kda
#                                                parallel attention_decode moe_decode
#                                                (default: tuning attention runtime moe kda)
#
# Wheels the H200 image lacks (fla-core, optuna, ...) are installed from .whl/ when it is present
# (carry it). Limits in seconds: T_TUNING, T_TUNING_RANK, T_ATTENTION, T_RUNTIME, T_MOE, T_KDA, T_PARALLEL,
# T_LONG_CONTEXT, T_ATTENTION_DECODE, T_MOE_DECODE. RUNTIME_ARGS: more bench_runtime_gpu.py flags (e.g. --sections).
set -u
export OUT=${OUT:-/tmp/h200_suite}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:.
fi
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
sections=${*:-tuning attention runtime moe kda}
run() {  # name limit command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.stdout" 2> "$OUT/$name.stderr"
  echo "== $name: exit $? after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/suite.log"
  tail -c 1500 "$OUT/$name.stderr" >> "$OUT/suite.log"
  rm -f "$OUT/$name.stdout" "$OUT/$name.stderr"   # the benches write their JSON to $OUT themselves
}
for s in $sections; do
  case $s in
    tuning) run tuning "${T_TUNING:-150}" python3 benches/bench_tuning.py --trials 4 --budget-s 70 --timeout-s 25 \
              --e2e-after-s 105 --store "$OUT/nvidia-h200.jsonl" ;;
    tuning_rank) run tuning_rank "${T_TUNING_RANK:-240}" python3 benches/bench_tuning.py --model rank --function decode \
              --shapes "{\"decode\": {\"R\": 1, \"context\": ${TUNE_CONTEXT:-8192}}}" --trials ${TUNE_TRIALS:-5} --budget-s $(( ${T_TUNING_RANK:-240} - 60 )) --timeout-s 20 \
              --no-e2e --store autotune_cache/records/nvidia-h200.jsonl
              cp autotune_cache/records/nvidia-h200.jsonl "$OUT/" ;;
    parallel) run parallel "${T_PARALLEL:-540}" python3 benches/bench_parallel_gpu.py --world 2 \
              --budget-s $(( ${T_PARALLEL:-540} - 60 )) ${PARALLEL_ARGS:-} ;;
    long_context) run long_context "${T_LONG_CONTEXT:-150}" env BENCH_DEADLINE=$(( $(date +%s) + ${T_LONG_CONTEXT:-150} - 20 )) \
              sh -c 'python3 benches/bench_attention.py --section hbm --out "$OUT/hbm.json" &&
                     python3 benches/bench_attention.py --section step --out "$OUT/attention_step.json"' ;;
    attention) run attention "${T_ATTENTION:-120}" python3 benches/bench_attention.py --budget $(( ${T_ATTENTION:-120} - 25 ))
              [ -f "$OUT/attention.json" ] && rm -f "$OUT/attention.partial.json" ;;
    runtime) run runtime "${T_RUNTIME:-150}" python3 benches/bench_runtime_gpu.py --budget-s $(( ${T_RUNTIME:-150} - 20 )) \
              --compile-timeout-s 60 ${RUNTIME_ARGS:-} ;;
    moe) run moe "${T_MOE:-60}" env MOE_BENCH_SECTIONS=decode,layer MOE_BENCH_LAYER_T=64 python3 benches/bench_moe.py ;;
    kda) run kda "${T_KDA:-155}" env KDA_BENCH_DEADLINE_S=$(( ${T_KDA:-155} - 23 )) python3 benches/bench_kda.py ;;
    attention_decode) run attention_decode "${T_ATTENTION_DECODE:-152}" python3 benches/bench_attention_decode.py \
              --budget-s $(( ${T_ATTENTION_DECODE:-152} - 14 )) ;;
    moe_decode) run moe_decode "${T_MOE_DECODE:-120}" env MOE_BENCH_SECTIONS=decode MOE_BENCH_GEMV_SWEEP=0 \
              MOE_BENCH_DECODE_SHAPES=${MOE_DECODE_SHAPES:-64x16,1x2,8x2} MOE_BENCH_DECODE_DEADLINE=$(( ${T_MOE_DECODE:-120} - 8 )) \
              python3 benches/bench_moe.py ;;
    *) echo "unknown section $s (see the header for the sections)" | tee -a "$OUT/suite.log" ;;
  esac
done
