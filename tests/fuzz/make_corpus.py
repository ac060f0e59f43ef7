#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into corpus/<target>/ (run from anywhere).

A few valid files and a few broken ones per target, each under a kilobyte, so a fuzzer starts
from every branch of the parser rather than discovering the formats from nothing."""
import gzip
import json
import os
import struct
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))


def idx(magic, dims, data):
    return struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in dims) + bytes(data)


IMAGES = idx(2051, [2, 3, 4], [(i * 37 + 255) % 256 for i in range(24)])
LABELS = idx(2049, [5], [3, 0, 9, 1, 7])


def gz(b):
    return gzip.compress(b, mtime=0)


def safetensors(tensors, metadata=None, checksum=True, pad=True):
    """tensors: [(name, dtype, shape, bytes)] in file order."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    meta = dict(metadata or {"format": "pt"})
    if checksum:
        meta["tandem.checksum"] = "crc32:%08x" % (zlib.crc32(data) & 0xffffffff)
    text = json.dumps({"__metadata__": meta, **header}).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def f32(n, start=0.5):
    return struct.pack("<%df" % n, *[start + i for i in range(n)])


# The fuzz_safetensors module: Linear(2, 3) then BatchNorm2d(3).
MODULE = [("0.weight", "F32", [3, 2], f32(6)), ("0.bias", "F32", [3], f32(3)),
          ("1.weight", "F32", [3], f32(3)), ("1.bias", "F32", [3], f32(3)),
          ("1.running_mean", "F32", [3], f32(3)), ("1.running_var", "F32", [3], f32(3, 1.0)),
          ("1.num_batches_tracked", "I64", [], struct.pack("<q", 7))]


def raw_header(text, data=b""):
    return struct.pack("<Q", len(text)) + text + data


CORPUS = {
    "idx_raw": {
        "images.idx3": IMAGES,
        "labels.idx1": LABELS,
        "truncated_data.idx3": IMAGES[:-3],
        "too_long.idx1": LABELS + b"\x00",
        "zero_dim.idx3": idx(2051, [2, 0, 4], []),
        "huge_dims.idx3": idx(2051, [0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF], [1, 2, 3]),
        "short_header.idx3": IMAGES[:9],
        "bad_label.idx1": idx(2049, [3], [1, 200, 2]),
        "bad_magic": struct.pack(">I", 0x0D03) + IMAGES[4:],
    },
    "idx_gzip": {
        "images.idx3.gz": gz(IMAGES),
        "labels.idx1.gz": gz(LABELS),
        "two_members.idx3.gz": gz(IMAGES[:10]) + gz(IMAGES[10:]),
        "truncated.idx3.gz": gz(IMAGES)[:-9],
        "trailing_garbage.idx1.gz": gz(LABELS) + b"garbage",
        "bad_crc.idx1.gz": gz(LABELS)[:-8] + b"\x00\x00\x00\x00" + gz(LABELS)[-4:],
        "bomb_header.idx3.gz": gz(idx(2051, [60000, 28, 28], [0] * 64)),
        "too_long.idx1.gz": gz(LABELS + b"\x01\x02"),
        # Not gzip: the target compresses these itself (first byte: where the second member starts).
        "plain_images": b"\x07" + IMAGES,
        "plain_labels": b"\x03" + LABELS,
    },
    "safetensors": {
        "module.safetensors": safetensors(MODULE),
        "module_no_checksum.safetensors": safetensors(MODULE, checksum=False),
        "other.safetensors": safetensors([("w", "F64", [2, 2], struct.pack("<4d", 1, 2, 3, 4)),
                                          ("e", "U8", [0, 5], b""), ("i", "I64", [1], struct.pack("<q", -1))]),
        "wrong_shape.safetensors": safetensors([("0.weight", "F32", [2, 3], f32(6))] + MODULE[1:]),
        "wrong_dtype.safetensors": safetensors([("0.weight", "F64", [3, 2], struct.pack("<6d", *range(6)))] + MODULE[1:]),
        "bad_checksum.safetensors": safetensors(MODULE)[:-1] + b"\x08",
        "overlap.safetensors": raw_header(b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                                          b'"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}', b"abcd"),
        "gap.safetensors": raw_header(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"ab"),
        "huge_shape.safetensors": raw_header(b'{"a":{"dtype":"F32","shape":[4294967296,4294967296],'
                                             b'"data_offsets":[0,4]}}', b"abcd"),
        "duplicate_key.safetensors": raw_header(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                                b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
        "deep.safetensors": raw_header(b'{"a":{"shape":[[[1]]]}}'),
        "bad_json.safetensors": raw_header(b'{"a":{"dtype":"U8",'),
        "header_too_long.safetensors": struct.pack("<Q", 1 << 40) + b"{}",
        "bf16.safetensors": raw_header(b'{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}', b"ab"),
    },
}


def main():
    for target, files in CORPUS.items():
        folder = os.path.join(HERE, "corpus", target)
        os.makedirs(folder, exist_ok=True)
        for old in os.listdir(folder):
            os.remove(os.path.join(folder, old))
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        print("%s: %d files, %d bytes" % (target, len(files), sum(len(d) for d in files.values())))


if __name__ == "__main__":
    main()
