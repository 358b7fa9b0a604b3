#!/bin/bash
# A device call carries the checkout's tracked files with what it names, 64 MiB in all (counted in disk
# blocks: the tracked tree alone takes 62.7 MiB of it). Nothing compiles there, so a stay needs only the
# fixtures the card tests read, the witness references and these scripts.
#   on   takes everything else out of the index (the files stay in place) and hides it through
#        .git/info/exclude, so calls carry the binaries and llama.cpp's source whole.
#   on REGEX  keeps only the fixtures whose names match (e.g. 'qwen3moe-tiny-q4km|qwen35moe-tiny-q4km'):
#        the card tests read what is there, and 55 MiB of fixtures leave a call room for little else.
#   off  puts the index and the exclude file back as they were.
# Never commit while it is on: the index then holds the deletions. `status` says which it is.
set -euo pipefail
cd "$(dirname "$0")/.."
EXCLUDE=.git/info/exclude
MARK="# device_lean.sh"
case "${1:-status}" in
on)
    if grep -q "^$MARK" $EXCLUDE 2>/dev/null; then echo "already on"; exit 0; fi
    git diff --cached --quiet || { echo "the index has staged changes: commit or reset them first" >&2; exit 1; }
    keep_fixtures=${2:-.}
    git ls-files | grep -vE '^(tests/fixtures/models/|tests/witness/|benchmarks/[^/]+\.(sh|py)$)' > .git/device_lean.list
    # .gitignore's own exception for the fixtures outranks the exclude file, so the others wait in .git
    mkdir -p .git/device_lean_fixtures
    git ls-files tests/fixtures/models/ | grep -vE "$keep_fixtures" | tee -a .git/device_lean.list |
        xargs -r -d '\n' mv -t .git/device_lean_fixtures/ || true
    xargs -a .git/device_lean.list -d '\n' git rm -q --cached --
    { echo "$MARK on: everything below is tracked at HEAD"; sed 's|^|/|' .git/device_lean.list; echo "$MARK end"; } >> $EXCLUDE
    git ls-files -z | xargs -0 du -c --block-size=1 | tail -1 | awk '{printf "now %.1f MiB tracked\n", $1/1048576}'
    ;;
off)
    grep -q "^$MARK" $EXCLUDE 2>/dev/null || { echo "already off"; exit 0; }
    mv .git/device_lean_fixtures/* tests/fixtures/models/ 2>/dev/null || true
    rmdir .git/device_lean_fixtures 2>/dev/null || true
    xargs -a .git/device_lean.list -d '\n' git reset -q --
    sed -i "/^$MARK on/,/^$MARK end/d" $EXCLUDE
    rm -f .git/device_lean.list
    git status --short | head -5
    ;;
status) grep -q "^$MARK" $EXCLUDE 2>/dev/null && echo on || echo off ;;
esac
