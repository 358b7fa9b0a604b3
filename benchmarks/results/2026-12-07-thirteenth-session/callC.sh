#!/bin/bash
# Thirteenth session, call C (a fresh machine, the last of the session's device time): issue 15's goal table
# on this machine with main's build (e15dfec plus tests), ours and llama.cpp's on the same files:
#   - the kept router and MoE-end kernels' new test cases (cuda_moe_fused's router_topk, cuda_fused's
#     moe_add_rms_norm: 512 and 62 experts, tied logits, 10 slots), not run with these kernels before;
#   - through the server at 8 GB (polystrata benchmark, context 34,000: a 40-token chat, prompts of 8,000
#     and 30,000 tokens), while llama.cpp builds at nice 19 (noted: the build takes what our CPU share leaves);
#   - after the build, on a quiet host: bench at 8 GB (tg64 at bench's context and at the server's 34,000),
#     llama.cpp at 8 GB (answers at --n-cpu-moe 28/26, prompts of 8,000 at 34/31 and 30,000 at 40/33: the
#     H100's scans), every peak by nvidia-smi;
#   - Nsight Compute's full set for one launch each of our attention and router kernels and llama.cpp's
#     (where a short launch's time goes: the next session's lead).
set -u
OUT=$DEVOUT; S=$OUT/callC.txt; T0=$(date +%s); . .carry/s13/common.sh
R=/tmp/r; mkdir -p /tmp/bin /dev/shm/m /tmp/lsrc /tmp/lcb $R
tar xJf $C/bin.tar.xz -C /tmp/bin && tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
setsid nice -n 19 bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $S
lscpu | grep -E "^(Model name|L3)" >> $S
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); RES=$(( TOTAL - 8192 ))
$E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 0 --out /dev/shm/m/q3u.gguf > /tmp/s1.txt 2>&1 &
P1=$!
$E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35s.gguf > /tmp/s2.txt 2>&1 &
P2=$!
timeout 60 /tmp/bin/cuda_moe_fused --test-threads 1 router_topk > $R/t1.txt 2>&1; st "cuda_moe_fused router_topk: $(grep -E '^test result' $R/t1.txt)"
timeout 60 /tmp/bin/cuda_fused --test-threads 1 moe_add_rms_norm > $R/t2.txt 2>&1; st "cuda_fused moe_add_rms_norm: $(grep -E '^test result' $R/t2.txt)"
grep -E "FAILED|panicked" $R/t1.txt $R/t2.txt | head -4 >> $S
wait $P1; st "q3u written: $(grep -E 'routing measured' /tmp/s1.txt | head -1 | grep -oE 'top 10%.*count\)')"
wait $P2; st "q35s written: $(grep -E 'routing measured' /tmp/s2.txt | head -1 | grep -oE 'top 10%.*count\)')"
smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; st "  peak $(sort -n $R/vram.txt | tail -1) MiB"; }
H=/tmp/home; mkdir -p $H
for m in q35s q3u; do
  /tmp/bin/polystrata tokenizer --gguf /dev/shm/m/$m.gguf --out $H/packs/$m/tokenizer > /dev/null 2>&1
  cat > $H/strata-$m-8gb.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/$m.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RES", "--no-expert-profile"], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-8gb"}
J
  smi_start
  timeout 150 /tmp/bin/polystrata benchmark --home $H --model $m-8gb --prompt-tokens 8000,30000 --answer-tokens 128 --runs 1 > $OUT/server-$m.txt 2> $R/server-$m.err
  st "server $m 8GB rc=$?"; smi_stop
  cat $OUT/server-$m.txt >> $S
done
while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; [ $(( $(date +%s) - T0 )) -gt 300 ] && break; done
st "llama build: $(ls /tmp/lcb/build.* 2>/dev/null) $(cat /tmp/lcb/build_time.txt 2>/dev/null)"
for m in q35s q3u; do
  b "$m 8GB tg64" $E --model /dev/shm/m/$m.gguf --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile
  b "$m 8GB tg64 --max-context 34000" $E --model /dev/shm/m/$m.gguf --vram-reserve-mib $RES --prompt 0 --gen 64 --reps 2 --no-expert-profile --max-context 34000
done
ll() { # model, n-cpu-moe, llama-bench args
  local m=$1 n=$2; shift 2
  [ $(( $(date +%s) - T0 )) -gt 430 ] && return
  smi_start
  timeout 60 $LB -m /dev/shm/m/$m.gguf -ngl 99 --n-cpu-moe $n -fa 1 "$@" -o md 2>&1 | grep -E "pp|tg|error" >> $S
  smi_stop
}
ll q35s 26 -p 0 -n 64 -r 2
ll q3u 28 -p 0 -n 64 -r 2
ll q35s 31 -p 8000 -n 0 -ub 2048 -b 8192 -r 1
ll q3u 34 -p 8000 -n 0 -ub 2048 -b 8192 -r 1
ll q35s 33 -p 30000 -n 0 -ub 2048 -b 8192 -r 1
ncu_one() { # label, kernel regex, skip, command...
  local l=$1 k=$2 n=$3; shift 3
  [ $(( $(date +%s) - T0 )) -gt 460 ] && return
  timeout 35 ncu --graph-profiling node -k regex:$k --launch-skip $n --launch-count 1 --set full --csv --page details "$@" > $R/ncu-$l.csv 2>/dev/null
  st "ncu $l rc=$?"
}
ncu_one attn-ours attn_decode_f16 300 $E bench --model /dev/shm/m/q3u.gguf --gpu 0 --prompt 0 --gen 16 --reps 1 --no-expert-profile
ncu_one router-ours router_topk 300 $E bench --model /dev/shm/m/q3u.gguf --gpu 0 --prompt 0 --gen 16 --reps 1 --no-expert-profile
ncu_one topk-llama topk_moe 300 $LB -m /dev/shm/m/q3u.gguf -ngl 99 -fa 1 -p 0 -n 16 -r 1
ncu_one attn-llama flash_attn_ext_vec 300 $LB -m /dev/shm/m/q3u.gguf -ngl 99 -fa 1 -p 0 -n 16 -r 1
tar cJf $OUT/ncu-full.tar.xz -C $R $(cd $R && ls ncu-*.csv 2>/dev/null) 2>/dev/null
cp $R/server-q35s.err $R/server-q3u.err $OUT/ 2>/dev/null
cat $S
