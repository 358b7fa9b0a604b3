#!/bin/bash
# Session 7, one call: models, card tests (host points fused, expert cache, i-quant MMQ), the A/B of
# --fuse host-points at 8 GB and in full VRAM, where the staged waits come from, the i-quants' timing.
set -u
export POLY_ENGINE_BIN=/tmp/bin/poly-engine OUT=$DEVOUT RAW=0 POLY_KERNEL_CACHE=/tmp/pkc
mkdir -p /tmp/bin && tar xJf .carry/s7/bin.tar.xz -C /tmp/bin && tar xJf .carry/s7b/bin.tar.xz -C /tmp/bin && mv .carry/s7/bin.tar.xz /tmp/old-bin.tar.xz
F="--fuse all,no-delta,no-glu-q8,no-down-sum"
LLAMA=0 MODELS="q3u q35s" TEST_BINS="cuda_host_flags gpu_expert_cache" TEST_TIMEOUT=200 bash benchmarks/offload_vs_llama.sh .carry/s7 prep
grep -hE "^test .*(FAILED|ok)$" /tmp/ovl/cuda_host_flags.txt /tmp/ovl/gpu_expert_cache.txt > $OUT/tests.txt 2>&1
grep -h -B2 -A12 "panicked" /tmp/ovl/cuda_host_flags.txt /tmp/ovl/gpu_expert_cache.txt | head -80 >> $OUT/tests.txt
MODELS="q3u q35s" PP_ROUNDS=0 ROUNDS=2 VGEN=64 VARIANTS="$F;--cache-bias 1;--cache-bias 1 $F" LEAN=1 SERVER=0 FULL=1 FULL_VARIANTS="$F" bash benchmarks/offload_vs_llama.sh .carry/s7 ours
E=/tmp/bin/poly-engine; TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
for mv in "q3u|--copy-ahead 1" "q3u|--expert-uploads 0"; do
  m=${mv%%|*}; v=${mv#*|}
  POLY_GPU_PROFILE=1 timeout 100 $E bench --model /dev/shm/m/$m.gguf --gpu 0 --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile $v > /tmp/pb.json 2> /tmp/pb.err
  echo "== $m [$v] $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); e=d["experts"]; print("tg %.1f share %.3f cpu %d ahead %s/%s up %s copy_us %.1f" % (d["tg"]["avg_ts"], e["vram_share"], e["cpu_experts"], e["ahead_routed"], e["ahead_copied"], e["uploads"], e["copy_us_per_expert"]))' /tmp/pb.json 2>&1)"
  grep -A6 "POLY_GPU_PROFILE summary" /tmp/pb.err | grep -E "segmented|card's own|copy-ahead|decode \(1"
done > $OUT/staged.txt 2>&1
{
for t in iquant_prompt_matmul_on_the_tensor_cores_matches_cpu expert_grouped_matmul_matches_cpu prompt_matmul_on_the_tensor_cores_matches_cpu prompt_matmul_matches_cpu_and_equals_the_matvec; do
  timeout 200 /tmp/bin/cuda_layer_ops --exact $t --nocapture --test-threads 1 2>&1 | tail -25
done
timeout 120 /tmp/bin/cuda_ops --exact modules_come_from_the_cache_the_second_time 2>&1 | tail -3
timeout 200 /tmp/bin/cuda_bench --ignored --exact bench_iquants_as_test_backend_ops --nocapture --test-threads 1 2>&1 | tail -60
} > $OUT/iq.txt 2>&1
