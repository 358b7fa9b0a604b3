#!/bin/bash
# Session 7, second stay: the two fixed card tests, and --copy-ahead 3 against the default at 8 GB.
set -u
export POLY_ENGINE_BIN=/tmp/bin/poly-engine POLY_KERNEL_CACHE=/tmp/pkc
mkdir -p /tmp/bin /dev/shm/m && tar xJf .carry/s7c/bin.tar.xz -C /tmp/bin
E=/tmp/bin/poly-engine
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
{
timeout 120 /tmp/bin/gpu_expert_cache --test-threads 1 bus_admissions_after_the_copies_answer_as_at_finish one_graph_tokens_equal_segmented_ones 2>&1 | grep -E "^test |test result|panicked"
timeout 120 /tmp/bin/cuda_layer_ops --exact iquant_prompt_matmul_on_the_tensor_cores_matches_cpu --test-threads 1 2>&1 | grep -E "^test |test result|panicked|n 8 \("
} > $OUT/tests-c.txt 2>&1
wait
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
for round in 1 2; do for m in q3u q35s; do for v in "" "--copy-ahead 3"; do
  timeout 100 $E bench --model /dev/shm/m/$m.gguf --gpu 0 --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile $v > /tmp/b.json 2> /tmp/b.err
  echo "$m [$v] $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); e=d["experts"]; print("tg64 %.1f (%s) share %.3f cpu %d ahead %s/%s" % (d["tg"]["avg_ts"], ", ".join("%.1f" % x for x in d["tg"]["samples_ts"]), e["vram_share"], e["cpu_experts"], e["ahead_routed"], e["ahead_copied"]))' /tmp/b.json 2>&1)"
done; done; done > $OUT/ahead3.txt 2>&1
lscpu | grep -E "Model name|L3" >> $OUT/ahead3.txt
