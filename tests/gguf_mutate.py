"""A seeded mutation fuzzer for GGUF files (issue 24, item 2): the test modules import it.

`layout(data)` walks a GGUF v3 file's header and records where every field starts, which fields
are counts or lengths (u64), and which are type codes (u32); `mutants(data, rng)` yields mutated
copies: bit flips in the header, truncation at every field boundary, huge and negative counts,
and wrong type codes. Deterministic per seed.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

# GGUF value types (ggml's gguf.h): size of a fixed-size value, or None for string (8) and array (9)
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9

HUGE_U64 = (2**63 - 1, 2**64 - 1, 2**62, 2**40, 2**32, 2**32 - 1, 2**31, 10**12)
NEGATIVE_U64 = tuple((-v) & (2**64 - 1) for v in (1, 2, 2**31, 2**32, 2**63))  # -1, -2, ... as int64
BAD_TYPES = (12, 13, 14, 15, 31, 39, 40, 255, 2**31 - 1, 2**31, 2**32 - 1)


@dataclass
class Layout:
    boundaries: list[int] = field(default_factory=list)  # offsets where a field starts
    counts: list[int] = field(default_factory=list)  # offsets of u64 counts and lengths
    types: list[int] = field(default_factory=list)  # offsets of u32 type codes (value, array, tensor)
    header_end: int = 0  # end of the tensor infos (the data section starts after the padding)


def layout(data: bytes) -> Layout:
    out = Layout()
    pos = 0

    def u32() -> int:
        nonlocal pos
        out.boundaries.append(pos)
        (v,) = struct.unpack_from("<I", data, pos)
        pos += 4
        return int(v)

    def u64(count: bool = True) -> int:
        nonlocal pos
        out.boundaries.append(pos)
        if count:
            out.counts.append(pos)
        (v,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        return int(v)

    def string() -> None:
        nonlocal pos
        n = u64()
        out.boundaries.append(pos)
        pos += n

    def value(t: int) -> None:
        nonlocal pos
        if t == STRING:
            string()
        elif t == ARRAY:
            out.types.append(pos)
            at = u32()
            n = u64()
            for _ in range(n):
                value(at)
        else:
            out.boundaries.append(pos)
            pos += FIXED[t]

    u32()  # magic
    u32()  # version
    n_tensors = u64()
    n_kv = u64()
    for _ in range(n_kv):
        string()
        out.types.append(pos)
        value(u32())
    for _ in range(n_tensors):
        string()
        n_dims = u32()
        for _ in range(n_dims):
            u64()
        out.types.append(pos)
        u32()
        u64()  # offset into the data section
    out.header_end = pos
    out.boundaries.append(pos)
    return out


def put_u64(data: bytearray, at: int, v: int) -> None:
    struct.pack_into("<Q", data, at, v)


def put_u32(data: bytearray, at: int, v: int) -> None:
    struct.pack_into("<I", data, at, v)


def truncations(data: bytes) -> Iterator[tuple[str, bytes]]:
    """The file cut at every field boundary of its header, and at the start of the data section."""
    lay = layout(data)
    for at in sorted(set(lay.boundaries)):
        yield f"truncate@{at}", data[:at]
    yield "truncate@data+1", data[: lay.header_end + 1]


def mutants(data: bytes, rng: random.Random, n: int, data_too: bool = False) -> Iterator[tuple[str, bytes]]:
    """n random mutants: bit flips (in the header, or anywhere with data_too), huge and negative
    counts, wrong type codes, and a few of them combined."""
    lay = layout(data)
    span = len(data) if data_too else lay.header_end
    kinds = ("flip", "huge", "negative", "type", "combo")
    for i in range(n):
        kind = kinds[i % len(kinds)]
        buf = bytearray(data)
        steps = [kind] if kind != "combo" else [rng.choice(kinds[:-1]) for _ in range(rng.randint(2, 4))]
        what = []
        for step in steps:
            if step == "flip":
                at = rng.randrange(span)
                bit = rng.randrange(8)
                buf[at] ^= 1 << bit
                what.append(f"flip@{at}.{bit}")
            elif step == "huge":
                at = rng.choice(lay.counts)
                v = rng.choice(HUGE_U64)
                put_u64(buf, at, v)
                what.append(f"u64@{at}={v}")
            elif step == "negative":
                at = rng.choice(lay.counts)
                v = rng.choice(NEGATIVE_U64)
                put_u64(buf, at, v)
                what.append(f"u64@{at}=-{2**64 - v}")
            else:
                at = rng.choice(lay.types)
                v = rng.choice(BAD_TYPES + tuple(range(13)))
                put_u32(buf, at, v)
                what.append(f"type@{at}={v}")
        yield "+".join(what), bytes(buf)
