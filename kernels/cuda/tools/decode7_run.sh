#!/bin/bash
# decode7's device run (from the repository root, on the GPU machine): the decode kernels' CUDA tests, the
# engine's GPU forward test, the attention microbenchmark, `poly-engine bench` on q3 and q35 (new path and,
# the old paths: --attn-decode old --moe-glu off --matvec-rpg 1 --attn-kv-store separate, and 4 rows per group), serve-mode decode at depth and the eager per-op
# profile. Everything goes to $OUT/summary.txt (the tail of each log) and five logs; under ~3 minutes.
set -u
C=.carry/decode7
B=/tmp/d7bin
mkdir -p $B /dev/shm/m && tar xJf $C/bin.tar.xz -C $B
export POLY_KERNEL_CACHE=/tmp/pkc
E=$B/poly-engine
OUT=${OUT:-/tmp/d7out}
mkdir -p $OUT
S=$OUT/summary.txt
T0=$(date +%s)
note() { echo "[t+$(( $(date +%s) - T0 ))s] $*" >> $S; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $S
# The models (CPU) while the kernel tests run (GPU).
[ -s /dev/shm/m/q3.gguf ] || $E synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf > /dev/null 2>&1 &
[ -s /dev/shm/m/q35.gguf ] || $E synth --arch qwen35moe --shape qwen3.6-35b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q35.gguf > /dev/null 2>&1 &

T=$OUT/tests.log
timeout 120 $B/cuda_layer_ops attention --test-threads 1 --nocapture >> $T 2>&1; note "cuda_layer_ops attention rc=$?"
timeout 120 $B/cuda_ops --test-threads 1 --nocapture expert matvec fused rope >> $T 2>&1; note "cuda_ops expert/matvec/fused/rope rc=$?"
# (The test binaries take no knobs since they became poly-engine flags: --matvec-rpg 4 is measured by the
# benches below.)
grep -E "^test |test result|FAIL|panicked|differ|not zero|above" $T | grep -v " ok$" >> $S
grep -E "attention_decode.*position (2000|8000|1999)" $T >> $S
timeout 90 $B/gpu_forward --test-threads 1 >> $T 2>&1; note "gpu_forward rc=$?"
grep -E "^test |test result|panicked" $T | tail -8 >> $S
timeout 30 $B/cuda_layer_bench bench_attention_decode --ignored --nocapture --test-threads 1 > $OUT/micro.log 2>&1; note "bench_attention_decode rc=$?"
grep "^bench" $OUT/micro.log >> $S
timeout 40 $B/cuda_bench bench_fused_gate_up --ignored --nocapture --test-threads 1 >> $OUT/micro.log 2>&1; note "bench_fused_gate_up rc=$?"
grep "bench gate" $OUT/micro.log >> $S
wait # the models

BL=$OUT/bench.log
bench() { # name tag poly-engine-flags...
    local m=$1 tag=$2; shift 2
    POLY_GPU_PROFILE=1 timeout 60 $E bench --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 128 --reps 2 "$@" > /tmp/d7_${m}_${tag}.json 2> /tmp/d7_${m}_${tag}.err
    note "bench $m $tag rc=$?"
    python3 -c "import json;d=json.load(open('/tmp/d7_${m}_${tag}.json'));print('  $m $tag', {k:(round(d[k]['avg_ts'],1),[round(x,1) for x in d[k]['samples_ts']]) for k in ('pp','tg') if k in d})" >> $S 2> /dev/null || echo "  $m $tag: no result" >> $S
    echo "== bench $m $tag" >> $BL; cat /tmp/d7_${m}_${tag}.err >> $BL
    grep -E "^decode" /tmp/d7_${m}_${tag}.err | head -2 >> $S
}
bench q3 new
bench q35 new
bench q3 old --attn-decode old --moe-glu off --matvec-rpg 1 --attn-kv-store separate
bench q3 rpg4 --matvec-rpg 4
bench q35 old --attn-decode old --moe-glu off --matvec-rpg 1 --attn-kv-store separate

SV=$OUT/serve.log
serve() { # model tag poly-engine-flags...
    local m=$1 tag=$2; shift 2
    echo "== serve $m $tag (prompt:gen in order)" >> $S
    # drive.py starts the engine it is given: a wrapper adds the flags.
    local w=/tmp/d7_engine_$tag
    printf '#!/bin/sh\nexec %s "$@" %s\n' "$E" "$*" > $w && chmod +x $w
    timeout 50 python3 $C/drive.py $w /dev/shm/m/$m.gguf 16384 40:128 2000:128 8000:128 >> $S 2>> $SV
    note "serve $m $tag rc=$?"
}
serve q3 new
serve q35 new
left 150 && serve q3 old --attn-decode old --moe-glu off --matvec-rpg 1 --attn-kv-store separate

if left 150; then
    timeout 25 $B/gpu_expert_cache --test-threads 1 >> $T 2>&1; note "gpu_expert_cache rc=$?"
    grep -E "test result|panicked" $T | tail -2 >> $S
fi
if left 165; then
    echo "== q3 eager per-op profile (POLY_GPU_PROFILE=2, --gpu-graphs off), 2000:64" >> $S
    printf '#!/bin/sh\nexec %s "$@" --gpu-graphs off\n' "$E" > /tmp/d7_engine_eager && chmod +x /tmp/d7_engine_eager
    POLY_GPU_PROFILE=2 timeout 30 python3 $C/drive.py /tmp/d7_engine_eager /dev/shm/m/q3.gguf 16384 2000:64 >> $S 2> $OUT/ops_q3.log
    note "profile q3 rc=$?"
    grep -A16 "^decode" $OUT/ops_q3.log | head -18 >> $S
fi
if left 160; then
    echo "== q35 eager per-op profile, 2000:64" >> $S
    POLY_GPU_PROFILE=2 timeout 25 python3 $C/drive.py /tmp/d7_engine_eager /dev/shm/m/q35.gguf 16384 2000:64 >> $S 2> $OUT/ops_q35.log
    note "profile q35 rc=$?"
    grep -A24 "^decode" $OUT/ops_q35.log | head -26 >> $S
fi
note "end"
cat $S
