# The variant of call 1 that beat NEW's defaults on both models by 3% or more (mean of rounds), or nothing.
import re, sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"\s+(q3u|q35s) 8192MiB NEW tg64( --[^|]*?)? \| tg64 ([\d.]+) t/s", line)
    if m and "context" not in line and "profiled" not in line:
        runs[(m.group(1), (m.group(2) or "").strip())].append(float(m.group(3)))
mean = {k: sum(v) / len(v) for k, v in runs.items()}
best, gain = "", 1.03
for (model, flags) in mean:
    if model != "q3u" or not flags:
        continue
    r = [mean.get((mm, flags), 0) / mean.get((mm, ""), 1e9) for mm in ("q3u", "q35s")]
    if min(r) >= gain:
        best, gain = flags, min(r)
print(best)
