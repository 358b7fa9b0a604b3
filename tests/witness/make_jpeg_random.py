"""Random JPEGs for the differential check of the JPEG decoder against stb_image (jpeg_stb_diff.sh):
N pictures of random sizes (1..120 × 1..90), contents (noise, patterns, gradients with specks), qualities,
samplings (Pillow's three, gray, CMYK; cjpeg's 4:4:0, 4:1:1, 4:1:0, 1×4, 2×4, chroma finer, RGB),
progressive, optimized tables and restart intervals; then, with `--damage`, each of the first 250 cut
short at a random point and with 1-3 bits flipped after its last SOS.
    python make_jpeg_random.py OUT SEED N [--damage DAMAGED_OUT]
"""
import glob
import os
import random
import subprocess
import sys

from PIL import Image
out = sys.argv[1]
rnd = random.Random(int(sys.argv[2]))
os.makedirs(out, exist_ok=True)
for i in range(int(sys.argv[3])):
    w, h = rnd.randint(1, 120), rnd.randint(1, 90)
    img = Image.new("RGB", (w, h))
    px = img.load()
    mode = rnd.randint(0, 2)
    for y in range(h):
        for x in range(w):
            if mode == 0:
                px[x, y] = (rnd.randint(0,255), rnd.randint(0,255), rnd.randint(0,255))
            elif mode == 1:
                px[x, y] = ((x*7+y*3)%256, (x*x+y)%256, 255 if (x//3+y//2)%2 else 0)
            else:
                v = rnd.randint(0, 255) if rnd.random() < 0.1 else (x*255)//max(w-1,1)
                px[x, y] = (v, 255-v, (v*3)%256)
    kw = dict(quality=rnd.choice([5, 20, 50, 75, 90, 95, 100]))
    kind = rnd.randint(0, 9)
    if kind == 0:
        img = img.convert("L")
    elif kind == 1:
        img = img.convert("CMYK")
    else:
        kw["subsampling"] = rnd.randint(0, 2)
    if rnd.random() < 0.4: kw["progressive"] = True
    if rnd.random() < 0.3: kw["optimize"] = True
    if rnd.random() < 0.3: kw["restart_marker_blocks"] = rnd.randint(1, 5)
    name = f"{out}/r{i:04d}.jpg"
    img.save(name, "JPEG", **kw)
    if rnd.random() < 0.3 and w*h > 16:
        ppm = f"{out}/t.ppm"; img.convert("RGB").save(ppm)
        s = rnd.choice(["1x2", "4x1", "4x2", "1x1,2x2,1x1", "2x1", "1x4", "2x4"])
        flags = ["-sample", s]
        if rnd.random() < 0.4: flags.append("-progressive")
        if rnd.random() < 0.2: flags.append("-rgb")
        subprocess.run(["cjpeg", "-quality", str(rnd.randint(10, 100)), *flags, "-outfile", f"{out}/c{i:04d}.jpg", ppm], check=True)

if len(sys.argv) > 5 and sys.argv[4] == "--damage":
    bad = sys.argv[5]
    os.makedirs(bad, exist_ok=True)
    rnd = random.Random(3)
    for i, f in enumerate(sorted(glob.glob(f"{out}/*.jpg"))[:250]):
        b = open(f, "rb").read()
        cut = rnd.randint(len(b) // 3, len(b) - 1)
        open(f"{bad}/t{i:04d}.jpg", "wb").write(b[:cut])
        sos = b.rfind(b"\xff\xda")
        bb = bytearray(b)
        for _ in range(rnd.randint(1, 3)):
            at = rnd.randint(max(sos, 2), len(b) - 3)
            bb[at] ^= 1 << rnd.randint(0, 7)
        open(f"{bad}/c{i:04d}.jpg", "wb").write(bytes(bb))
