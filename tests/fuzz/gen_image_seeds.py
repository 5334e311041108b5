#!/usr/bin/python3
"""Writes the seed corpus of fuzz_image (tests/fuzz/fuzz_image.c).

Each seed is the harness's 12 settings bytes, then an image, and for some a
mask after the separator "@KPL@".  JPEGs come from PIL (python3-pil): gray,
RGB at 4:4:4, 4:2:2 and 4:2:0, CMYK (Adobe), progressive, optimized, with
restart markers.  PNGs are written by the small encoder below, because PIL
cannot write every kind: every color type (gray, RGB, palette, gray+alpha,
RGBA) at every allowed bit depth (1 to 16), palette with tRNS, and Adam7
interlaced.  Images are small and of odd sizes (a few KB each).

    /usr/bin/python3 tests/fuzz/gen_image_seeds.py tests/fuzz/corpus/image
"""
import io
import os
import struct
import sys
import zlib

from PIL import Image

SEP = b"@KPL@"


def settings(crop=0, three=True, u8=False, feature=0, boxes=False, mask=False, oh=16, ow=16,
             shorter=4, flip=128, jitter=0, scale_ratio=0x35, enc=0, denom=0, dchan=True,
             example=0, win=(0, 0, 255, 255)):
    s0 = (crop & 3) | (4 if three else 0) | (8 if u8 else 0) | ((feature & 3) << 4) \
        | (64 if boxes else 0) | (128 if mask else 0)
    s7 = (enc & 3) | ((denom & 3) << 2) | (16 if dchan else 0) | ((example & 7) << 5)
    return bytes([s0, (oh - 1) % 256, (ow - 1) % 256, shorter, flip, jitter, scale_ratio, s7,
                  *win])


def pattern(w, h, mode):
    """A picture with edges and gradients, so that decoding has work to do."""
    img = Image.new("RGB", (w, h))
    px = img.load()
    for y in range(h):
        for x in range(w):
            px[x, y] = ((x * 255) // max(w - 1, 1), (y * 255) // max(h - 1, 1),
                        255 if (x // 4 + y // 4) % 2 else 30)
    return img.convert(mode)


def jpeg(w, h, mode="RGB", **kw):
    b = io.BytesIO()
    pattern(w, h, mode).save(b, "JPEG", **kw)
    return b.getvalue()


# ---- a PNG encoder for every color type, bit depth and interlace ----

def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def pack_row(samples, depth):
    if depth == 16:
        return b"".join(struct.pack(">H", v) for v in samples)
    if depth == 8:
        return bytes(samples)
    out, acc, n = bytearray(), 0, 0
    for v in samples:
        acc = (acc << depth) | v
        n += depth
        if n == 8:
            out.append(acc)
            acc, n = 0, 0
    if n:
        out.append(acc << (8 - n))
    return bytes(out)


ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
         (0, 1, 1, 2)]
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def png(w, h, color, depth, interlace=False, palette=None, trns=None, filt=0):
    """pixel (x, y, channel) is a deterministic function; palette images use
    indices below the palette size."""
    nch = CHANNELS[color]
    top = (1 << depth) - 1
    ncol = len(palette) if palette else top + 1

    def sample(x, y, c):
        if color == 3:
            return (x + 2 * y) % ncol
        return ((x * 37 + y * 11 + c * 71) * top // 97) % (top + 1)

    def rows(xs, ys):
        raw = b""
        for y in ys:
            samples = [sample(x, y, c) for x in xs for c in range(nch)]
            raw += bytes([filt]) + filter_row(pack_row(samples, depth), filt,
                                              max(1, nch * depth // 8))
        return raw

    if interlace:
        raw = b""
        for x0, y0, dx, dy in ADAM7:
            xs, ys = list(range(x0, w, dx)), list(range(y0, h, dy))
            if xs and ys:
                raw += rows(xs, ys)
    else:
        raw = rows(range(w), range(h))
    out = b"\x89PNG\r\n\x1a\n"
    out += chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color, 0, 0, 1 if interlace else 0))
    if palette:
        out += chunk(b"PLTE", b"".join(bytes(c) for c in palette))
    if trns is not None:
        out += chunk(b"tRNS", trns)
    out += chunk(b"IDAT", zlib.compress(raw, 9))
    out += chunk(b"IEND", b"")
    return out


def filter_row(row, filt, bpp):
    """Filter 1 (Sub) only, so that the unfiltering code runs; others as is."""
    if filt != 1:
        return row
    return bytes((row[i] - (row[i - bpp] if i >= bpp else 0)) & 255 for i in range(len(row)))


def main(out):
    os.makedirs(out, exist_ok=True)
    seeds = {}
    # JPEG
    seeds["jpeg-rgb420"] = settings() + jpeg(33, 17, quality=80)
    seeds["jpeg-rgb444-rrc"] = settings(crop=1, oh=8, ow=12) + jpeg(40, 24, subsampling=0)
    seeds["jpeg-rgb422-center"] = settings(crop=2, oh=10, ow=10, shorter=6, denom=1) + \
        jpeg(48, 31, subsampling=1)
    seeds["jpeg-gray"] = settings(three=False, u8=True, enc=1) + jpeg(21, 19, "L")
    seeds["jpeg-cmyk"] = settings(jitter=0x15, enc=1, dchan=False) + jpeg(24, 16, "CMYK")
    seeds["jpeg-progressive"] = settings(crop=1, denom=2, win=(40, 30, 100, 200)) + \
        jpeg(64, 48, progressive=True, quality=70)
    seeds["jpeg-progressive-gray"] = settings(three=False, jitter=0x3f) + \
        jpeg(30, 40, "L", progressive=True)
    seeds["jpeg-optimized-restart"] = settings(denom=3, oh=4, ow=4) + \
        jpeg(64, 64, optimize=True, restart_marker_blocks=2)
    seeds["jpeg-boxes"] = settings(crop=1, boxes=True, flip=255) + jpeg(32, 32) + SEP + SEP + \
        struct.pack("<8f", 1, 2, 20, 30, -5, 4, 40, 9) + SEP + struct.pack("<2q", 3, 7)
    # PNG: every color type and depth
    seeds["png-gray1"] = settings(three=False) + png(13, 7, 0, 1)
    seeds["png-gray2-sub"] = settings() + png(9, 9, 0, 2, filt=1)
    seeds["png-gray4"] = settings(u8=True) + png(11, 5, 0, 4)
    seeds["png-gray8-trns"] = settings(enc=2) + png(8, 8, 0, 8, trns=struct.pack(">H", 5))
    seeds["png-gray16"] = settings(three=False, enc=2) + png(10, 6, 0, 16)
    seeds["png-rgb8"] = settings(crop=1) + png(17, 12, 2, 8, filt=1)
    seeds["png-rgb16"] = settings(crop=2, shorter=3) + png(12, 9, 2, 16)
    pal = [(i * 40 % 256, 255 - i * 30 % 256, i * 90 % 256) for i in range(6)]
    seeds["png-pal2-trns"] = settings() + png(9, 7, 3, 2, palette=pal[:4], trns=b"\x00\x80")
    seeds["png-pal4"] = settings(three=False) + png(14, 6, 3, 4, palette=pal)
    seeds["png-pal8"] = settings(u8=True) + png(7, 9, 3, 8, palette=pal)
    seeds["png-graya8"] = settings() + png(6, 6, 4, 8)
    seeds["png-graya16"] = settings(three=False) + png(5, 8, 4, 16)
    seeds["png-rgba8"] = settings(jitter=0x2a) + png(16, 10, 6, 8)
    seeds["png-rgba16"] = settings(crop=1) + png(9, 11, 6, 16)
    seeds["png-interlaced-rgb"] = settings() + png(19, 13, 2, 8, interlace=True)
    seeds["png-interlaced-gray1"] = settings(three=False) + png(11, 9, 0, 1, interlace=True)
    seeds["png-interlaced-pal4"] = settings() + png(10, 10, 3, 4, interlace=True, palette=pal)
    # masks beside the image (gray 8-bit, palette 4-bit)
    seeds["png-mask"] = settings(crop=1, mask=True) + png(12, 8, 2, 8) + SEP + png(12, 8, 0, 8)
    seeds["jpeg-mask-pal"] = settings(crop=2, mask=True, shorter=2) + jpeg(16, 12) + SEP + \
        png(16, 12, 3, 4, palette=pal)
    # raw features: (6, 5, 3), (7, 4, 1), (5, 6)
    seeds["raw-hwc3"] = settings(feature=1, enc=3) + bytes(range(90))
    seeds["raw-hwc1-mask"] = settings(feature=2, mask=True, three=False) + bytes(range(28)) + \
        SEP + bytes(28)
    seeds["raw-hw"] = settings(feature=3, crop=1, u8=True) + bytes(range(30))
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fuzz/corpus/image")
