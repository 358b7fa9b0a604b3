#!/bin/bash
# NOT RUN (written at the end of the thirteenth session, whose device time was spent): the next stay's
# first call. `--attn-heads-per-block 1|2|4` (a GQA group's heads in shorter blocks of the flash-decoding
# kernel; default unchanged: the whole group in one block) on the card:
#   1. cuda_layer_ops' attention_decode test: every cut gives the whole group's output, quantized copy and
#      stored row bit for bit (and the CPU's within 1e-9 NMSE), every case of the test;
#   2. greedy answers with logprobs equal to the default's (parsed JSON), q3u and q35s, every weight in VRAM;
#   3. tg128 pp512 every weight in VRAM, default against 1, 2, 4 alternating; at 8 GB once the llama.cpp
#      build is done (start it first: its last steps ran beside call C's 8 GB runs);
#   4. Nsight Compute node by node at tg128's context for the best cut (attn_decode_f16_g* and the merge).
#   here:  cargo build --release -p poly-engine --bin poly-engine -p polystrata --bin polystrata (one
#          feature set for every engine binary compared); cargo test --release -p poly-kernels --test
#          cuda_layer_ops --no-run; copy poly-engine and the cuda_layer_ops executable into a folder, strip
#          --strip-all, XZ_OPT=-9e tar cJf .carry/s13/bin.tar.xz -C FOLDER .; the llama.cpp source as
#          ../shared/device/README.md says (.carry/s13/llama.cpp.tar.xz) with llamacpp_build_cuda.sh beside
#          it; bash benchmarks/device_lean.sh on; carry .carry/s13
#   there: DEVOUT=$OUT bash benchmarks/results/2026-12-07-thirteenth-session/not-run-next.sh
set -u
OUT=$DEVOUT; S=$OUT/next.txt; T0=$(date +%s); . benchmarks/results/2026-12-07-thirteenth-session/common.sh
decode_test() {
  timeout 170 /tmp/bin/cuda_layer_ops --test-threads 1 attention_decode > $OUT/test-cuda_layer_ops.txt 2>&1
  st "cuda_layer_ops attention_decode rc=$?: $(grep -E '^test result' $OUT/test-cuda_layer_ops.txt | tail -1)"
}
prep_machine decode_test
for m in q3u q35s; do
  run $E $m /tmp/r-base.json
  for h in 1 2 4; do
    run $E $m /tmp/r-$h.json --attn-heads-per-block $h
    python3 -c 'import json,sys; a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]; print("equal" if a==b else "DIFFER")' /tmp/r-base.json /tmp/r-$h.json > /tmp/eq.txt
    st "identity $m heads-per-block $h: $(cat /tmp/eq.txt)"
  done
done
for r in 1 2; do for m in q3u q35s; do
  b "$m full default" $E --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2
  for h in 1 2 4; do b "$m full hpb $h" $E --model /dev/shm/m/$m.gguf --prompt 512 --gen 128 --reps 2 --attn-heads-per-block $h; done
done; done
cat $S
