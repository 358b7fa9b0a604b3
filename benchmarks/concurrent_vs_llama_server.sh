#!/bin/bash
# Several chats at once over HTTP (issue 20): `polystrata serve --parallel N` against `llama-server -np N` on
# the same GGUF, the same clients (benchmarks/concurrent_http.py), alternating, N = $NS (default 1 2 4 8),
# $ROUNDS rounds. Each N gets a fresh server of each kind: ours with --gguf FILE in a temporary home, llama.cpp's
# with -c 2048·N (2,048 tokens a slot) and -t $THREADS (default: the cores). One JSON line a run.
#
# usage (repository root, release build): bash benchmarks/concurrent_vs_llama_server.sh MODEL.gguf LLAMA_SERVER
set -u
MODEL=$1
LLAMA_SERVER=$2
NS=${NS:-"1 2 4 8"}
THREADS=${THREADS:-$(nproc)}
CHATS_TOTAL=${CHATS_TOTAL:-16}
ANSWER=${ANSWER:-128}
HOME_DIR=$(mktemp -d)
trap 'kill $PID 2>/dev/null; rm -rf "$HOME_DIR"' EXIT

wait_up() { for _ in $(seq 1 120); do curl -sf "$1" > /dev/null 2>&1 && return 0; sleep 0.5; done; return 1; }
run() { # label, url, model name, clients
    local chats=$(( CHATS_TOTAL / $4 )); [ $chats -lt 2 ] && chats=2
    python3 benchmarks/concurrent_http.py --url "$2" --model "$3" --clients $4 --chats $chats --answer $ANSWER --label "$1"
}
for round in $(seq ${ROUNDS:-1}); do
    for n in $NS; do
        ./target/release/polystrata serve --home "$HOME_DIR" --gguf "$MODEL" --parallel $n --port 8191 > "$HOME_DIR/serve.log" 2>&1 &
        PID=$!
        wait_up http://127.0.0.1:8191/v1/models && until curl -s http://127.0.0.1:8191/health | grep -q '"loaded":true'; do sleep 0.5; done
        NAME=$(curl -s http://127.0.0.1:8191/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
        run "polystrata --parallel $n" http://127.0.0.1:8191 "$NAME" $n
        kill $PID; wait $PID 2>/dev/null
        "$LLAMA_SERVER" -m "$MODEL" -np $n -c $(( 2048 * n )) -t $THREADS --port 8192 > "$HOME_DIR/llama.log" 2>&1 &
        PID=$!
        wait_up http://127.0.0.1:8192/health
        run "llama-server -np $n" http://127.0.0.1:8192 model $n
        kill $PID; wait $PID 2>/dev/null
    done
done
