# Two `run --json --top 4` answers: "equal" when every line is the same, else how far they agree (the
# tokens' common prefix, and over it the largest difference of a chosen token's logprob).
import json, sys
a = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
b = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
if a == b:
    print("equal (%d lines)" % len(a))
    sys.exit()
def tok(d):
    return d.get("token", d.get("id"))
same = 0
for x, y in zip(a, b):
    if tok(x) != tok(y):
        break
    same += 1
dl = [abs(x.get("logprob", 0) - y.get("logprob", 0)) for x, y in zip(a[:same], b[:same])]
print("DIFFER: %d of %d/%d tokens the same before the first difference; max |d logprob| %.2e" % (same, len(a), len(b), max(dl) if dl else 0))
