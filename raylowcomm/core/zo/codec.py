"""What crosses the network per SPSA sample: a projected gradient g as a code of one byte (or
four), decoded to the same float on every node."""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Sequence


class Codec:
    """g ↔ an unsigned code of `nbytes` bytes. Decoding is the same on every node; the
    sender must apply decode(encode(g)), like everyone else."""

    nbytes: int
    _fmt: str

    def encode(self, g: float) -> int:
        raise NotImplementedError

    def decode(self, code: int) -> float:
        raise NotImplementedError

    def _check(self, g: float) -> float:
        g = float(g)
        if not math.isfinite(g):
            raise ValueError(f"projected gradient is not finite: {g}")
        return g

    def pack(self, codes: Sequence[int]) -> bytes:
        return struct.pack(f"<{len(codes)}{self._fmt}", *codes)

    def unpack(self, data: bytes) -> list[int]:
        return list(struct.unpack(f"<{len(data) // self.nbytes}{self._fmt}", data))

    def to_bytes(self, gs: Sequence[float]) -> bytes:
        return self.pack([self.encode(g) for g in gs])

    def from_bytes(self, data: bytes) -> list[float]:
        return [self.decode(c) for c in self.unpack(data)]


def _nth_root(x: float, n: int) -> float:
    """x^(1/n) for x > 1 by bisection with only correctly rounded ops (×, +, /2), so the result is
    bitwise the same on every machine, which libm's exp/log/pow do not promise."""

    def power(b: float) -> float:
        result, e = 1.0, n
        while e:
            if e & 1:
                result *= b
            b *= b
            e >>= 1
        return result

    lo, hi = 1.0, x
    while True:
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            return lo
        if power(mid) < x:
            lo = mid
        else:
            hi = mid


class LogCodec(Codec):
    """Sign bit + 7-bit log-magnitude index: code = sign·128 + k.

    k = 0 is zero; k = 1..127 decode to m_k = g_min·r^(k−1), r = (g_max/g_min)^(1/126), so
    m_127 ≈ g_max. Encoding picks the nearest level in log scale (|g| < g_min/2 → 0), clipping
    |g| > g_max to g_max. For g_min ≤ |g| ≤ g_max the relative error is ≤ √r − 1
    (`max_rel_error`, 5.6% for the default 1e-3..1e3); below g_min the absolute error is
    ≤ g_min/2. Levels are built by repeated multiplication from an exactly computed r, so
    every node decodes a byte to the same float.
    """

    nbytes = 1
    _fmt = "B"

    def __init__(self, g_min: float = 1e-3, g_max: float = 1e3) -> None:
        if not 0 < g_min < g_max:
            raise ValueError(f"need 0 < g_min < g_max, got {g_min}, {g_max}")
        r = _nth_root(g_max / g_min, 126)
        self.levels = [float(g_min)]
        for _ in range(126):
            self.levels.append(self.levels[-1] * r)
        self._bounds = [g_min / 2] + [math.sqrt(a * b) for a, b in zip(self.levels, self.levels[1:])]
        self.max_rel_error = math.sqrt(r) - 1

    def encode(self, g: float) -> int:
        g = self._check(g)
        k = bisect.bisect_right(self._bounds, abs(g))
        return k | (128 if g < 0 and k else 0)

    def decode(self, code: int) -> float:
        k = code & 127
        value = self.levels[k - 1] if k else 0.0
        return -value if code & 128 else value


class LinearCodec(Codec):
    """Clipped uniform grid: code = 128 + clamp(round(g/scale), −127, 127), value = (code−128)·scale.

    Absolute error ≤ scale/2 (`max_abs_error`) for |g| ≤ 127.5·scale; beyond, g clips to
    ±127·scale. Code 0 is never produced.
    """

    nbytes = 1
    _fmt = "B"

    def __init__(self, scale: float = 1 / 16) -> None:
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale = float(scale)
        self.max_abs_error = self.scale / 2

    def encode(self, g: float) -> int:
        g = self._check(g)
        return 128 + max(-127, min(127, round(g / self.scale)))

    def decode(self, code: int) -> float:
        return (code - 128) * self.scale


class Float32Codec(Codec):
    """The IEEE float32 bit pattern (4 bytes): the uncompressed reference."""

    nbytes = 4
    _fmt = "I"

    def encode(self, g: float) -> int:
        g = self._check(g)
        try:
            return struct.unpack("<I", struct.pack("<f", g))[0]
        except OverflowError:
            raise ValueError(f"projected gradient {g} overflows float32") from None

    def decode(self, code: int) -> float:
        return struct.unpack("<f", struct.pack("<I", code))[0]


_CODECS = {"log": LogCodec, "linear": LinearCodec, "float32": Float32Codec}


def codec_for(name: str, **params: float) -> Codec:
    """ "log" (g_min, g_max), "linear" (scale) or "float32"."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {sorted(_CODECS)}")
    return _CODECS[name](**params)
