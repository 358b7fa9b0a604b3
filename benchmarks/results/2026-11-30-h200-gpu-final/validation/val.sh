set -u
C=.carry/final2
mkdir -p /tmp/bin /dev/shm/m && tar xJf $C/bin.tar.xz -C /tmp/bin
export POLY_KERNEL_CACHE=/tmp/pkc POLY_WITNESS_MODELS=/tmp/nogemma
S=$OUT/summary.txt
/tmp/bin/poly-engine synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf > /dev/null 2>&1 &
SY=$!
timeout 100 /tmp/bin/gpu_forward --test-threads 1 > $OUT/gpu_forward.txt 2>&1; echo "gpu_forward rc=$?" >> $S
grep -E "test result" $OUT/gpu_forward.txt >> $S
timeout 60 /tmp/bin/gpu_expert_cache --test-threads 1 > $OUT/gpu_expert_cache.txt 2>&1; echo "gpu_expert_cache rc=$?" >> $S
grep -E "test result" $OUT/gpu_expert_cache.txt >> $S
timeout 100 /tmp/bin/witness_gpu --nocapture > $OUT/witness_gpu.txt 2>&1; echo "witness_gpu rc=$?" >> $S
grep -E "references accepted|CUDA against CPU|^witness_gpu:" $OUT/witness_gpu.txt >> $S
wait $SY
T=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
for f in "" "--vram-reserve-mib $((T-8192))"; do
  echo "-- bench $f" >> $S
  timeout 60 /tmp/bin/poly-engine bench --model /dev/shm/m/q3.gguf --gpu 0 --prompt 512 --gen 64 --reps 2 $f 2>/dev/null | python3 -c 'import json,sys; d=json.load(sys.stdin); print("pp512 %.0f tg64 %.1f share %s" % (d["pp"]["avg_ts"], d["tg"]["avg_ts"], d.get("experts",{}).get("vram_share")))' >> $S 2>&1
done
cat $S
