"""Writes the JPEG fixtures of tests/fixtures/vision/jpeg/ with Pillow: one picture (smooth gradients, noise,
hard edges, saturated colours, so that the IDCT clamps and the chroma filters have work) saved in the modes
the decoder has paths for. Deterministic (seeded); run by jpeg_stb_witness.sh.
    python make_jpeg_fixtures.py OUT_DIR
"""
import random
import sys

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
