#!/bin/bash
# GPU baseline: our engine (every weight in VRAM) against llama.cpp CUDA on synth models of the real shapes.
set -u
C=.carry
S=$OUT/summary.txt; : > $S
nvidia-smi --query-gpu=name,memory.total --format=csv >> $S
ls /usr/local/cuda/bin | tr '\n' ' ' >> $S; echo >> $S; which nsys ncu >> $S 2>&1
mkdir -p /tmp/lcb /tmp/lsrc
tar xJf $C/g1/llama.cpp.tar.xz -C /tmp/lsrc
setsid bash $C/g1/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/build_log.txt 2>&1 &
BPID=$!
mkdir -p /dev/shm/m
E=$C/g1/poly-engine
export POLY_KERNEL_CACHE=/tmp/pkc
( time $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf ) >> $S 2>&1
( time $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35.gguf ) >> $S 2>&1
ls -la /dev/shm/m >> $S
for m in q3 q35; do
  echo "== ours $m pp512 tg128 (gpu)" >> $S
  timeout 300 $E bench --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 128 --reps 3 >> $S 2>$OUT/ours_${m}_err.txt; echo rc=$? >> $S
  echo "== ours $m pp4096 ubatch 4096 / 512" >> $S
  timeout 200 $E bench --model /dev/shm/m/$m.gguf --gpu 0 --prompt 4096 --gen 0 --reps 2 --ubatch 4096 >> $S 2>>$OUT/ours_${m}_err.txt; echo rc=$? >> $S
  timeout 200 $E bench --model /dev/shm/m/$m.gguf --gpu 0 --prompt 4096 --gen 0 --reps 2 --ubatch 512 >> $S 2>>$OUT/ours_${m}_err.txt; echo rc=$? >> $S
  echo "== ours $m tg batch-invariant" >> $S
  timeout 200 $E bench --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 128 --reps 2 --batch-invariant >> $S 2>>$OUT/ours_${m}_err.txt; echo rc=$? >> $S
done
nvidia-smi --query-gpu=memory.used --format=csv >> $S
wait $BPID
tail -5 /tmp/lcb/build_log.txt >> $S; cat /tmp/lcb/build_time.txt >> $S 2>/dev/null
LB=$(find /tmp/lcb/build -name llama-bench -type f | head -1)
echo "llama-bench: $LB" >> $S
for m in q3 q35; do
  echo "== llama $m" >> $S
  timeout 400 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512,4096 -n 128 -r 3 -o md >> $S 2>$OUT/llama_${m}_err.txt
  timeout 200 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 4096 -n 0 -ub 2048 -b 4096 -r 2 -o md >> $S 2>>$OUT/llama_${m}_err.txt
done
cp /tmp/lcb/build_log.txt $OUT/ 2>/dev/null
