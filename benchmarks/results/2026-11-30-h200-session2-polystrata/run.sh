# polystrata benchmark through the server on the H200, final main of session 2 (carry: .carry/pb3/bin.tar.xz
# with poly-engine and polystrata, stripped). qwen3moe 30B-A3B shape, every weight in VRAM and the card held
# to 8 GB, n_ctx 16,384. From the repository root on the device.
set -u
mkdir -p /tmp/bin /dev/shm/m && tar xJf .carry/pb3/bin.tar.xz -C /tmp/bin
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
for m in q3 q3-8gb; do
  echo "== polystrata benchmark $m" >> $S
  timeout 100 /tmp/bin/polystrata benchmark --home $H --model $m --prompt-tokens 2000,8000 --answer-tokens 128 > $OUT/$m.txt 2> $OUT/$m.err; echo "rc=$?" >> $S
  cat $OUT/$m.txt >> $S; tail -3 $OUT/$m.err >> $S
done
cat $S
