#!/bin/bash
# Issue 15's comparison in one stay on the H200 machine: the card held to a budget (8 GB by default) and
# every weight in VRAM, ours (poly-engine bench, and the server through `polystrata benchmark`) against
# llama.cpp CUDA built there from the pinned sdist (`-ngl 99 -fa 1 --n-cpu-moe N`), on synthetic models at
# the real shapes written there, with uniform routing AND with skew (synth prints the routing's estimated
# top-10% share; bench's JSON the measured one, `route_top10_share`).
#
# usage (repository root on the device): bash benchmarks/offload_vs_llama.sh CARRY_DIR prep|ours|llama
#   prep   unpacks, starts the llama.cpp build in its own session, writes the models to /dev/shm, runs the
#          GPU correctness tests (gpu_expert_cache: every placement and --missing-experts mode against
#          every expert in VRAM; gpu_forward), then waits for the build so the later phases run on a quiet
#          host (the CPU share of a token is host work).
#   ours   poly-engine bench at the budget for every model, the binary before the change
#          (bin/poly-engine-base, when carried) beside this one; every weight in VRAM; one-call pp8000;
#          polystrata benchmark through the server (prompts of 2,000 / 8,000 / 30,000 tokens).
#   llama  llama-bench at the budget (N scanned up from the last measured value to the fewest CPU layers
#          whose measured peak fits the budget, per shape) and every layer on the card, peaks measured the
#          same way.
# CARRY_DIR holds bin.tar.xz (poly-engine, poly-engine-base, polystrata, the GPU test binaries),
# llama.cpp.tar.xz and llamacpp_build_cuda.sh. Results: $OUT/summary-PHASE.txt and raw files.
set -u
C=$1
PHASE=$2
OUT=${OUT:-/tmp/offload-out}
R=/tmp/ovl; mkdir -p $R "$OUT" /tmp/bin /tmp/lsrc /tmp/lcb /dev/shm/m
S=$OUT/summary-$PHASE.txt; : > "$S"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$S"; }
export POLY_KERNEL_CACHE=/tmp/pkc
E=/tmp/bin/poly-engine
LB=/tmp/lcb/build/bin/llama-bench
BUDGET=${BUDGET:-8192}
TOTAL=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
RESERVE=$(( TOTAL - BUDGET ))
MODELS=${MODELS:-"q3u q3s q35s q35u"}
# llama.cpp's --n-cpu-moe at 8 GB per model (measured 2026-12-03 on pp8000 -ub 2048: 34 for qwen3moe (33
# peaked at 8,441 MiB), 31 for qwen35moe).
ncmoe() { case $1 in q35*) echo 31 ;; q3*) echo 34 ;; esac; }

smi_start() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > $R/vram.txt 2>/dev/null & SMI=$!; }
smi_stop() { kill $SMI 2>/dev/null; wait $SMI 2>/dev/null; echo "  peak VRAM used on the card: $(sort -n $R/vram.txt | tail -1) MiB" | tee -a "$S"; }

if [ "$PHASE" = prep ]; then
    # A carry over a call's limit came as parts, unpacked into /tmp/bin by earlier calls
    # (make_gpu_carry.sh says how); llama.cpp's source likewise may come in a call of its own.
    [ -f $C/bin.tar.xz ] && tar xJf $C/bin.tar.xz -C /tmp/bin
    [ -f $C/llama.cpp.tar.xz ] && tar xJf $C/llama.cpp.tar.xz -C /tmp/lsrc
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$S"
    lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|L3)" | tee -a "$S"
    # LLAMA=0: a stay that measures ours only (no build).
    [ "${LLAMA:-1}" = 1 ] && stamp "build llama.cpp CUDA (background, its own session)" && setsid bash $C/llamacpp_build_cuda.sh /tmp/lsrc/llama.cpp /tmp/lcb/build /tmp/lcb > /tmp/lcb/llama_build.txt 2>&1 < /dev/null &
    synth() { $E synth --arch $1 --shape $2 --type Q4_K --seed 1 --route-skew $3 --out /dev/shm/m/$4.gguf > $R/synth-$4.txt 2>&1; }
    P=()
    for m in $MODELS; do
        case $m in
            q3u) synth qwen3moe qwen3-30b-a3b 0 q3u & P+=($!) ;;
            q3s) synth qwen3moe qwen3-30b-a3b 1 q3s & P+=($!) ;;
            q35s) synth qwen35moe qwen3.6-35b-a3b 1 q35s & P+=($!) ;;
            q35u) synth qwen35moe qwen3.6-35b-a3b 0 q35u & P+=($!) ;;
        esac
    done
    wait "${P[@]}"  # the writers, not the build
    grep -hE "routing|wrote" $R/synth-*.txt | tee -a "$S"
    stamp "correctness"
    # TESTS=0: a stay that measures only (the binaries' tests passed on this build before).
    # TEST_BINS: which of them (default: all).
    [ "${TESTS:-1}" = 1 ] && for t in ${TEST_BINS:-gpu_expert_cache gpu_forward cuda_layer_ops cuda_ops cuda_fused}; do
        [ -x /tmp/bin/$t ] || continue
        timeout ${TEST_TIMEOUT:-300} /tmp/bin/$t --test-threads 1 > $R/$t.txt 2>&1
        echo "$t rc=$?: $(grep -E '^test result' $R/$t.txt | tail -1)" | tee -a "$S"
        grep -E "^test .*FAILED$|panicked" $R/$t.txt | head -5 | tee -a "$S"
    done
    stamp "wait for the llama.cpp build"
    [ "${LLAMA:-1}" = 1 ] && while [ ! -e /tmp/lcb/build.done ] && [ ! -e /tmp/lcb/build.failed ]; do sleep 2; done
    tail -2 /tmp/lcb/llama_build.txt | tee -a "$S"
    # RAW=0: the raw files stay in $R (a device call brings back at most 8 files from its $OUT).
    [ "${RAW:-1}" = 1 ] && cp $R/*.txt "$OUT/" 2>/dev/null
    stamp done
fi

bench() { # label, engine, args...
    local label=$1 eng=$2; shift 2
    smi_start
    timeout 200 $eng bench "$@" > $R/b.json 2> $R/b.err
    local rc=$?
    python3 - "$label" $R/b.json >> "$S" 2>&1 <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[2]))
except Exception as e:
    print("  %s: no result (%s)" % (sys.argv[1], e)); sys.exit()
out = [sys.argv[1]]
for k in ("pp", "tg"):
    if k in d:
        out.append("%s%d %.1f t/s (%s)" % (k, d[k]["n_tokens"], d[k]["avg_ts"], ", ".join("%.1f" % x for x in d[k]["samples_ts"])))
e = d.get("experts")
if e:
    out.append("VRAM share %.3f, %s/%s in VRAM, top10 %.3f" % (e.get("vram_share") or 0, e.get("in_vram"), e.get("slots"), e.get("route_top10_share") or 0))
    out.append("decode: %s copied, %s on CPU (cpu %.0f us + %.0f us/expert, copy %.0f us/expert, card waits %.0f us + %.0f us/copy), uploads %s (on card %s), ahead %s (routed %s)" % (
        e.get("staged_decode"), e.get("cpu_experts"), e.get("cpu_us_overhead") or 0, e.get("cpu_us_per_expert") or 0,
        e.get("copy_us_per_expert") or 0, e.get("card_wait_us_base") or 0, e.get("card_wait_us_per_copy") or 0,
        e.get("uploads"), e.get("admitted_on_card", "-"),
        e.get("ahead_copied", "-"), e.get("ahead_routed", "-")))
print("  " + " | ".join(out))
PY
    [ $rc = 0 ] || { echo "  rc=$rc: $(tail -2 $R/b.err)" | tee -a "$S"; }
    smi_stop
    grep -E "expert cache:|segmented|host points|own waits|--copy-ahead:" $R/b.err | head -5 >> "$S"
    { echo "## $label"; cat $R/b.json; grep -E "POLY_GPU_PROFILE|host|decode" $R/b.err | head -20; } >> "$OUT/ours-raw.txt"
}

if [ "$PHASE" = ours ]; then
    # An answer of GEN tokens by bench at the budget, with the flags that follow (model $m, file $F).
    tg_with() { local gen=$1; shift; bench "$m ${BUDGET}MiB NEW tg$gen${*:+ $*}" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 0 --gen $gen --reps 2 --no-expert-profile "$@"; }
    stamp "ours at ${BUDGET} MiB (reserve $RESERVE of $TOTAL MiB)"
    # BENCH=0: not the budget's bench runs (a call that measures the server alone).
    for m in $( [ "${BENCH:-1}" = 1 ] && echo $MODELS ); do
        F=/dev/shm/m/$m.gguf
        # BASE_MODELS: which models the binary before the change runs for (default: all).
        case " ${BASE_MODELS:-$MODELS} " in *" $m "*) HAS_BASE=1 ;; *) HAS_BASE=0 ;; esac
        # ROUNDS: base and new alternate this many times (both unprofiled), then one profiled run of new
        # (PP_ROUNDS: this part's own count, default ROUNDS).
        for round in $(seq ${PP_ROUNDS:-${ROUNDS:-1}}); do
            [ -x /tmp/bin/poly-engine-base ] && [ $HAS_BASE = 1 ] && bench "$m ${BUDGET}MiB BASE pp512 tg64" /tmp/bin/poly-engine-base --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 512 --gen 64 --reps 2 --no-expert-profile
            bench "$m ${BUDGET}MiB NEW pp512 tg64" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 512 --gen 64 --reps 2 --no-expert-profile
        done
        # The server's context (34,000 tokens reserved at load, below): the bench figure its answers
        # are held to.
        case $m in q3u|q35s) bench "$m ${BUDGET}MiB NEW tg64 at the server's context" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 0 --gen 64 --reps 2 --no-expert-profile --max-context 34000 ;; esac
        # UPLOADS: --expert-uploads values to run besides the default (the cache's admissions per layer
        # and token; 0 freezes the cache as placed).
        for u in ${UPLOADS:-}; do tg_with 64 --expert-uploads $u; done
        # ADMISSIONS: --expert-admissions values to run besides the default (`card`: only experts copied
        # on demand are admitted, none over the bus).
        for a in ${ADMISSIONS:-}; do tg_with 64 --expert-admissions $a; done
        # VARIANTS: flag sets separated by ';' (e.g. "--expert-noise-margin 0;--expert-uploads 0"), each
        # run as a tg$VGEN (default 128) beside the default's tg$VGEN, alternating ROUNDS times.
        if [ -n "${VARIANTS:-}" ]; then
            IFS=';' read -ra VS <<< "$VARIANTS"
            for round in $(seq ${ROUNDS:-1}); do
                # VBASE=1: the base binary (bin/poly-engine-base) in each round too, at its defaults.
                [ "${VBASE:-0}" = 1 ] && [ -x /tmp/bin/poly-engine-base ] && bench "$m ${BUDGET}MiB BASE tg${VGEN:-128}" /tmp/bin/poly-engine-base --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 0 --gen ${VGEN:-128} --reps 2 --no-expert-profile
                tg_with ${VGEN:-128}
                # shellcheck disable=SC2086 # a flag set, split on purpose
                for v in "${VS[@]}"; do tg_with ${VGEN:-128} $v; done
            done
        fi
        [ "${VBASE:-0}" = 1 ] && [ -x /tmp/bin/poly-engine-base ] && POLY_GPU_PROFILE=1 bench "$m ${BUDGET}MiB BASE tg64 profiled" /tmp/bin/poly-engine-base --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 0 --gen 64 --reps 2 --no-expert-profile
        POLY_GPU_PROFILE=1 bench "$m ${BUDGET}MiB NEW tg64 profiled" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 0 --gen 64 --reps 2 --no-expert-profile
        grep -A12 "POLY_GPU_PROFILE summary" $R/b.err | grep -iE "decode|host|route|share|prepare|finish|ahead" | head -8 >> "$S"
    done
    # PROFILE=1: where a partly resident token's host time goes (the CPU share's parts by POLY_CPU_PROFILE's
    # spans), and the share's thread count halved (hyperthreads or not: lscpu in summary-prep).
    if [ "${PROFILE:-0}" = 1 ]; then
    for m in $MODELS; do
        F=/dev/shm/m/$m.gguf
        POLY_GPU_PROFILE=1 POLY_CPU_PROFILE=1 bench "$m ${BUDGET}MiB NEW tg64 profiled" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 0 --gen 64 --reps 2 --no-expert-profile
        grep -E "share |moe.decode" $R/b.err | tail -6 >> "$S"
        grep -A12 "POLY_GPU_PROFILE summary" $R/b.err | grep -iE "decode|host|route|share|prepare|finish" | head -8 >> "$S"
        bench "$m ${BUDGET}MiB NEW tg64 --threads 8" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 0 --gen 64 --reps 2 --no-expert-profile --threads 8
        bench "$m ${BUDGET}MiB NEW pp8000 one call" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 8000 --gen 0 --reps 1 --ubatch 8000 --no-expert-profile
        grep -E "lent|took back|vram:" $R/b.err | head -4 >> "$S"
    done
    fi
    # LEAN=1: the budget's before/after and the server alone (SERVER=0: not the server either).
    if [ "${LEAN:-0}" != 1 ]; then
    # EXTRAS: which of the single-token modes and the one-call pp8000 to run (default: all three).
    for m in q3u q35s; do
        F=/dev/shm/m/$m.gguf
        case " ${EXTRAS:-card rayon onecall} " in *" card "*) ;; *) continue ;; esac
        bench "$m ${BUDGET}MiB NEW tg64 --missing-experts card" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 0 --gen 64 --reps 2 --no-expert-profile --missing-experts card
    done
    for m in q3u q35s; do
        F=/dev/shm/m/$m.gguf
        case " ${EXTRAS:-card rayon onecall} " in *" rayon "*) bench "$m ${BUDGET}MiB NEW tg64 --cpu-share rayon" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 0 --gen 64 --reps 2 --no-expert-profile --cpu-share rayon ;; esac
        case " ${EXTRAS:-card rayon onecall} " in *" onecall "*) ;; *) continue ;; esac
        bench "$m ${BUDGET}MiB NEW pp8000 one call" $E --model $F --gpu 0 --vram-reserve-mib $RESERVE --prompt 8000 --gen 0 --reps 1 --ubatch 8000 --no-expert-profile
    done
    fi
    # FULL: every weight in VRAM (default: unless LEAN=1); FULL_VARIANTS: flag sets separated by ';' run
    # beside the default there, alternating ROUNDS times.
    if [ "${FULL:-$([ "${LEAN:-0}" = 1 ] && echo 0 || echo 1)}" = 1 ]; then
    stamp "ours, every weight in VRAM"
    IFS=';' read -ra FVS <<< "${FULL_VARIANTS:-}"
    for m in ${FULL_MODELS:-q3u q35s}; do
        for round in $(seq ${ROUNDS:-1}); do
            # FULL_BASE=1: the binary before the change too (bin/poly-engine-base, when carried).
            [ "${FULL_BASE:-0}" = 1 ] && [ -x /tmp/bin/poly-engine-base ] && bench "$m full BASE pp512 tg128" /tmp/bin/poly-engine-base --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 128 --reps 2
            bench "$m full pp512 tg128" $E --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 128 --reps 2
            for v in "${FVS[@]}"; do
                # shellcheck disable=SC2086 # a flag set, split on purpose
                bench "$m full pp512 tg128 $v" $E --model /dev/shm/m/$m.gguf --gpu 0 --prompt 512 --gen 128 --reps 2 $v
            done
        done
    done
    fi
    # GREEDY=1: the model's own greedy answer (`poly-engine run`, 40 prompt tokens, 128 written) at the
    # budget and the server's context beside bench's random tokens there: what the server writes.
    if [ "${GREEDY:-0}" = 1 ]; then
    for m in ${SERVER_MODELS:-q35s q3u}; do
        F=/dev/shm/m/$m.gguf
        tg_with 128 --max-context 34000
        IDS=$(seq 1000 7 1273 | paste -sd,)
        timeout 120 $E run --model $F --gpu 0 --vram-reserve-mib $RESERVE --n-ctx 34000 --no-expert-profile --prompt-tokens $IDS --max-tokens 128 --top 1 --ignore-eos > $R/run.txt 2> $R/run.err
        echo "  $m ${BUDGET}MiB poly-engine run, greedy, 40 prompt tokens, 128 written, context 34000: rc=$? $(grep -E "generated" $R/run.err | tail -2 | tr '\n' ' ')" | tee -a "$S"
        cp $R/run.err $OUT/run-$m.err
    done
    fi
    [ "${SERVER:-1}" = 1 ] || { stamp done; exit 0; }
    stamp "ours through the server (polystrata benchmark)"
    H=/tmp/home; mkdir -p $H
    # SERVER_LONG: the engine's --long-ubatch values to run the server with ("default": its own).
    for m in ${SERVER_MODELS:-q35s q3u}; do
        /tmp/bin/polystrata tokenizer --gguf /dev/shm/m/$m.gguf --out $H/packs/$m/tokenizer > /dev/null 2>&1
        for lu in ${SERVER_LONG:-default}; do
        X=""; [ "$lu" = default ] || X=", \"--long-ubatch\", \"$lu\""
        # SERVER_THREADS: the engine's --threads in the run config (the server's own threads beside the
        # CPU share's spinning workers).
        [ -n "${SERVER_THREADS:-}" ] && X="$X, \"--threads\", \"$SERVER_THREADS\""
        # SERVER_ARGS: more engine arguments for the run config, as JSON strings ('"--expert-uploads", "0"').
        [ -n "${SERVER_ARGS:-}" ] && X="$X, $SERVER_ARGS"
        cat > $H/strata-$m-8gb-$lu.json <<J
{"exe": "$E", "args": ["--model", "/dev/shm/m/$m.gguf", "--max-context", "34000", "--gpu", "0", "--vram-reserve-mib", "$RESERVE", "--no-expert-profile"$X], "tokenizer": "packs/$m/tokenizer", "model_name": "$m-8gb-$lu"}
J
        smi_start
        # SERVER_PROFILE=1: the server's engine profiled (POLY_GPU_PROFILE passes its allow-list), its
        # summary in the server's log, to set beside bench's.
        [ "${SERVER_PROFILE:-0}" = 1 ] && export POLY_GPU_PROFILE=1
        # SERVER_PROMPTS: the long prompts' lengths (default 2000,8000,30000).
        timeout 240 /tmp/bin/polystrata benchmark --home $H --model $m-8gb-$lu --prompt-tokens ${SERVER_PROMPTS:-2000,8000,30000} --answer-tokens 128 --runs ${SERVER_RUNS:-1} > $OUT/server-$m-$lu.txt 2> $R/server-$m-$lu.err
        echo "  polystrata benchmark $m-8gb (--long-ubatch $lu) rc=$?" | tee -a "$S"
        smi_stop
        cat $OUT/server-$m-$lu.txt >> "$S"; tail -3 $R/server-$m-$lu.err >> "$S"; grep -E "vram:|expert cache:" $R/server-$m-$lu.err | tail -8 >> "$S"
        grep -A12 "POLY_GPU_PROFILE summary" $R/server-$m-$lu.err | grep -iE "decode|host|route|share|finish" | head -8 >> "$S"
        unset POLY_GPU_PROFILE
        cp $R/server-$m-$lu.err $OUT/ 2>/dev/null
        done
    done
    stamp done
fi

if [ "$PHASE" = llama ]; then
    [ -x $LB ] || { echo "no llama-bench: $(tail -3 /tmp/lcb/llama_build.txt)" | tee -a "$S"; exit 1; }
    # The fewest CPU layers whose measured peak fits the budget, per shape: from the last measured N up,
    # on the largest run measured below (an 8,000-token prompt at -ub 2048, whose compute buffers peak
    # highest, and a few answer tokens), peaks by nvidia-smi with the CUDA context, at most 4 tries.
    scan() { # model
        local n=$(ncmoe $1) try peak
        for try in 1 2 3 4; do
            smi_start
            timeout 120 $LB -m /dev/shm/m/$1.gguf -ngl 99 --n-cpu-moe $n -fa 1 -p 8000 -n 16 -ub 2048 -b 8192 -r 1 -o md > /dev/null 2>&1
            kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
            peak=$(sort -n $R/vram.txt | tail -1)
            echo "  scan $1 --n-cpu-moe $n: peak $peak MiB" | tee -a "$S" >&2
            [ "${peak:-99999}" -le "$BUDGET" ] && break
            n=$(( n + 1 ))
        done
        echo $n
    }
    declare -A NSHAPE
    for m in $MODELS; do
        shape=${m%[us]}
        [ -n "${NSHAPE[$shape]:-}" ] || NSHAPE[$shape]=$(scan $m)
        N=${NSHAPE[$shape]}
        stamp "llama.cpp $m --n-cpu-moe $N"
        smi_start
        timeout 150 $LB -m /dev/shm/m/$m.gguf -ngl 99 --n-cpu-moe $N -fa 1 -p 512 -n 64 -r 2 -o md 2>&1 | grep -E "pp|tg|error" | tee -a "$S"
        case $m in q3u|q35s)
            timeout 150 $LB -m /dev/shm/m/$m.gguf -ngl 99 --n-cpu-moe $N -fa 1 -p 8000 -n 0 -ub 2048 -b 8192 -r 1 -o md 2>&1 | grep -E "pp|error" | tee -a "$S" ;;
        esac
        smi_stop
    done
    stamp "llama.cpp, every layer on the card"
    for m in q3u q35s; do
        timeout 150 $LB -m /dev/shm/m/$m.gguf -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o md 2>&1 | grep -E "pp|tg|error" | tee -a "$S"
    done
    if [ "${PP30000:-1}" = 1 ]; then
        stamp "llama.cpp q35s pp30000 at the budget"
        timeout 120 $LB -m /dev/shm/m/q35s.gguf -ngl 99 --n-cpu-moe ${NSHAPE[q35]:-31} -fa 1 -p 30000 -n 0 -ub 2048 -b 8192 -r 1 -o md 2>&1 | grep -E "pp|error" | tee -a "$S"
    fi
    stamp done
fi
