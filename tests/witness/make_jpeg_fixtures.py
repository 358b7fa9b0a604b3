"""Writes the JPEG fixtures of tests/fixtures/vision/jpeg/ with Pillow: one picture (smooth gradients, noise,
hard edges, saturated colours, so that the IDCT clamps and the chroma filters have work) saved in the modes
the decoder has paths for; with libjpeg-turbo's cjpeg (CJPEG, e.g. /usr/bin/cjpeg of Debian's
libjpeg-turbo-progs) also the samplings Pillow does not write (4:4:0, 4:1:1, 4:1:0, chroma sampled finer
than luma), an RGB JPEG and an arithmetic-coded one (stb refuses it). Deterministic (seeded); run by
jpeg_stb_witness.sh.
    python make_jpeg_fixtures.py OUT_DIR [CJPEG]
"""
import os
import random
import subprocess
import sys
import tempfile

from PIL import Image

OUT = sys.argv[1]


def picture(w, h, seed):
    rnd = random.Random(seed)
    img = Image.new("RGB", (w, h))
    px = img.load()
    for y in range(h):
        for x in range(w):
            r = (x * 255) // max(w - 1, 1)
            g = (y * 255) // max(h - 1, 1)
            b = 255 if (x // 5 + y // 4) % 2 else 0
            if (x - w // 3) ** 2 + (y - h // 2) ** 2 < (min(w, h) // 4) ** 2:
                r, g, b = 255, 20, 200
            n = rnd.randint(-40, 40)
            px[x, y] = (max(0, min(255, r + n)), max(0, min(255, g - n)), max(0, min(255, b + n // 2)))
    return img


def save(img, name, **kw):
    img.save(f"{OUT}/{name}.jpg", "JPEG", **kw)


odd = picture(37, 23, 1)
save(odd, "odd-444", quality=90, subsampling=0)
save(odd, "odd-422", quality=90, subsampling=1)
save(odd, "odd-420", quality=90, subsampling=2)
save(odd, "odd-420-q100", quality=100, subsampling=2)
save(odd, "odd-420-q20", quality=20, subsampling=2)
save(odd.convert("L"), "odd-gray", quality=85)
save(odd, "odd-420-progressive", quality=85, subsampling=2, progressive=True)
save(odd, "odd-444-progressive", quality=95, subsampling=0, progressive=True)
save(odd.convert("L"), "odd-gray-progressive", quality=85, progressive=True)
save(odd, "odd-420-optimized", quality=75, subsampling=2, optimize=True)
save(odd.convert("CMYK"), "odd-cmyk", quality=90)
big = picture(96, 64, 2)
save(big, "big-420", quality=80, subsampling=2)
save(big, "big-420-restart", quality=80, subsampling=2, restart_marker_blocks=3)
save(big, "big-422-progressive-restart", quality=80, subsampling=1, progressive=True, restart_marker_rows=1)
thin = picture(1, 9, 3)
save(thin, "one-column-420", quality=90, subsampling=2)
save(picture(2, 1, 4), "two-pixels-420", quality=90, subsampling=2)
save(picture(17, 2, 5), "seventeen-by-two-422", quality=90, subsampling=1)

CJPEG = sys.argv[2] if len(sys.argv) > 2 else ""
if CJPEG:
    tmp = tempfile.mkdtemp()
    for img, tag in ((odd, "odd"), (big, "big")):
        ppm = os.path.join(tmp, f"{tag}.ppm")
        img.save(ppm)
        for name, flags in (
            ("cjpeg-440", ["-sample", "1x2"]),
            ("cjpeg-411", ["-sample", "4x1"]),
            ("cjpeg-410", ["-sample", "4x2"]),
            ("cjpeg-chroma-finer", ["-sample", "1x1,2x2,1x1"]),
            ("cjpeg-440-progressive", ["-sample", "1x2", "-progressive"]),
            ("cjpeg-rgb", ["-rgb"]),
            ("cjpeg-arithmetic", ["-arithmetic"]),
        ):
            if tag == "big" and name not in ("cjpeg-440", "cjpeg-411"):
                continue
            out = f"{OUT}/{tag}-{name}.jpg"
            subprocess.run([CJPEG, "-quality", "85", *flags, "-outfile", out, ppm], check=True)
