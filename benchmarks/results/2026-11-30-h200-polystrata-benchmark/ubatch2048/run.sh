set -u
mkdir -p /tmp/bin /dev/shm/m && cp .carry/pb2/poly-engine .carry/pb2/polystrata /tmp/bin/
export POLY_KERNEL_CACHE=/tmp/pkc
S=$OUT/summary.txt
/tmp/bin/poly-engine synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf > /dev/null 2>&1
H=/tmp/home; mkdir -p $H
/tmp/bin/polystrata tokenizer --gguf /dev/shm/m/q3.gguf --out $H/packs/q3/tokenizer >> $S 2>&1
cat > $H/strata-q3.json <<J
{"exe": "/tmp/bin/poly-engine", "args": ["--model", "/dev/shm/m/q3.gguf", "--max-context", "16384", "--gpu", "0"], "tokenizer": "packs/q3/tokenizer", "model_name": "q3"}
J
echo "== polystrata benchmark q3 (every weight in VRAM; serve reads prompts in calls of 2048 by default now)" >> $S
timeout 100 /tmp/bin/polystrata benchmark --home $H --model q3 --prompt-tokens 2000,8000 --answer-tokens 128 > $OUT/q3.txt 2> $OUT/q3.err; echo "rc=$?" >> $S
cat $OUT/q3.txt >> $S; grep -E "ready|loaded" $OUT/q3.err | tail -2 >> $S
cat $S
