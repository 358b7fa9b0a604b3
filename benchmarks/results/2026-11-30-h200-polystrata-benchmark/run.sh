set -u
mkdir -p /tmp/bin /dev/shm/m && tar xJf .carry/final2/bin.tar.xz -C /tmp/bin && cp .carry/pb/polystrata /tmp/bin/
export POLY_KERNEL_CACHE=/tmp/pkc
S=$OUT/summary.txt
/tmp/bin/poly-engine synth --arch qwen3moe --shape qwen3-30b-a3b --type Q4_K --seed 1 --route-skew 1 --out /dev/shm/m/q3.gguf > /dev/null 2>&1
H=/tmp/home; mkdir -p $H
/tmp/bin/polystrata tokenizer --gguf /dev/shm/m/q3.gguf --out $H/packs/q3/tokenizer >> $S 2>&1
T=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
cat > $H/strata-q3.json <<J
{"exe": "/tmp/bin/poly-engine", "args": ["--model", "/dev/shm/m/q3.gguf", "--max-context", "16384", "--gpu", "0"], "tokenizer": "packs/q3/tokenizer", "model_name": "q3"}
J
cat > $H/strata-q3-8gb.json <<J
{"exe": "/tmp/bin/poly-engine", "args": ["--model", "/dev/shm/m/q3.gguf", "--max-context", "16384", "--gpu", "0", "--vram-reserve-mib", "$((T-8192))"], "tokenizer": "packs/q3/tokenizer", "model_name": "q3-8gb"}
J
echo "== polystrata benchmark q3 (every weight in VRAM)" >> $S
timeout 100 /tmp/bin/polystrata benchmark --home $H --model q3 --prompt-tokens 2000,8000 --answer-tokens 128 > $OUT/q3.txt 2> $OUT/q3.err; echo "rc=$?" >> $S
cat $OUT/q3.txt >> $S; tail -3 $OUT/q3.err >> $S
echo "== polystrata benchmark q3-8gb" >> $S
timeout 100 /tmp/bin/polystrata benchmark --home $H --model q3-8gb --prompt-tokens 2000,8000 --answer-tokens 128 > $OUT/q38.txt 2> $OUT/q38.err; echo "rc=$?" >> $S
cat $OUT/q38.txt >> $S; tail -3 $OUT/q38.err >> $S
cat $S
