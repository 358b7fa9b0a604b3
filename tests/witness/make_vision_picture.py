#!/usr/bin/env python3
"""Writes the vision witness's test pictures: deterministic RGB PNGs (stdlib only), 64x48 by default.

Gradients in each channel, a bright disc and a dark bar, so that the resize, the patches and the
position embedding all see structure.
Usage: python3 tests/witness/make_vision_picture.py OUT.png [WIDTH HEIGHT]
"""
import struct
import sys
import zlib

W, H = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) == 4 else (64, 48)


def pixel(x, y):
    r = (x * 4) % 256
    g = (y * 5) % 256
    b = (x * y) % 256
    if (x - 40) ** 2 + (y - 20) ** 2 < 100:
        r, g, b = 250, 240, 30
    if 8 <= x < 24 and 30 <= y < 36:
        r, g, b = 10, 20, 90
    return bytes((r, g, b))


def chunk(kind, data):
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def main():
    raw = b"".join(b"\x00" + b"".join(pixel(x, y) for x in range(W)) for y in range(H))
    png = b"\x89PNG\r\n\x1a\n"
    png += chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9))
    png += chunk(b"IEND", b"")
    with open(sys.argv[1], "wb") as f:
        f.write(png)


if __name__ == "__main__":
    main()
