#!/usr/bin/env python3
"""Reference masks from pycocotools for test_detdata.c: random polygons
(convex and not, fractional and integer vertices, repeated vertices, parts
reaching past the image, several parts per object) rasterised by
pycocotools' frPyObjects + merge, as the compressed RLE strings that
kpl_mask_fill_polygon + kpl_rle_encode + kpl_rle_to_string must reproduce
byte for byte.  Also uncompressed RLEs and their strings.

    python3 tests/dataio/gen_coco_rle_refs.py > tests/dataio/data/coco_rle_ref.txt

Line format (one object a line, fields separated by ' | '):
    poly H W | x y x y ... ; x y ... | RLE_STRING
    counts H W | c0 c1 ... | RLE_STRING
"""
import random

import numpy as np
from pycocotools import mask as M


def fmt(v):
    return repr(float(v)) if v != int(v) else str(int(v))


def main():
    r = random.Random(27)
    out = []
    for i in range(300):
        h, w = r.randint(1, 48), r.randint(1, 48)
        parts = []
        for _ in range(1 if i % 4 else r.randint(2, 3)):
            k = r.randint(3, 9)
            if i % 3 == 0:  # integer vertices, sometimes on the image border
                pts = [(r.randint(-1, w + 1), r.randint(-1, h + 1)) for _ in range(k)]
            else:
                pts = [(round(r.uniform(-2, w + 2), r.choice([1, 2, 3])),
                        round(r.uniform(-2, h + 2), r.choice([1, 2, 3]))) for _ in range(k)]
            if i % 5 == 0:  # a repeated vertex
                j = r.randrange(k)
                pts.insert(j, pts[j])
            parts.append([c for p in pts for c in p])
        rles = M.frPyObjects(parts, h, w)
        rle = M.merge(rles)
        s = rle['counts'].decode('ascii')
        out.append('poly %d %d | %s | %s' % (h, w, ' ; '.join(' '.join(fmt(c) for c in p)
                                                              for p in parts), s))
    for i in range(60):
        h, w = r.randint(1, 40), r.randint(1, 40)
        m = (np.random.RandomState(i).rand(h, w) < r.choice([0.05, 0.5, 0.95])).astype(np.uint8)
        if i == 0:
            m[:] = 0
        if i == 1:
            m[:] = 1
        enc = M.encode(np.asfortranarray(m))
        # the uncompressed counts of the same mask (column-major runs from 0s)
        flat = m.flatten(order='F')
        counts, prev, run = [], 0, 0
        for v in flat:
            if v != prev:
                counts.append(run)
                run, prev = 0, v
            run += 1
        counts.append(run)
        rt = M.frPyObjects({'size': [h, w], 'counts': counts}, h, w)
        assert rt['counts'] == enc['counts']
        out.append('counts %d %d | %s | %s' % (h, w, ' '.join(map(str, counts)),
                                                enc['counts'].decode('ascii')))
    print('\n'.join(out))


if __name__ == '__main__':
    main()
