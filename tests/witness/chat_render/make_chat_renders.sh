#!/bin/bash
# Regenerates tests/fixtures/text/chat_renders.json: llama.cpp's own rendering (common/ Jinja engine, with
# llama-server's message handling) of every template x conversation in tests/fixtures/text/chat_cases.json.
# The server's template test (server/tests/text_template.rs) renders the same cases and compares.
# usage: make_chat_renders.sh [LLAMA_SRC] [LLAMA_BUILD]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
BIN=$(OUT=/tmp/render_chat "$HERE/build_render_chat.sh" "$@" | tail -1)
"$BIN" "$ROOT/tests/fixtures/text/chat_cases.json" > "$ROOT/tests/fixtures/text/chat_renders.json"
echo "wrote $ROOT/tests/fixtures/text/chat_renders.json"
