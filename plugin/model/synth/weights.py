"""Random tensor data for synthetic models, written straight in its storage format.

Quantized tensors are never materialised as F32: random bytes fill the quant blocks, then the
scale fields of every block are overwritten with fixed valid values chosen so that the
dequantized weights have zero mean and the requested standard deviation. This writes the
16 GiB benchmark shape in about a minute and keeps memory to one tensor at a time.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from moeplug.model.synth.archs import TensorPlan

_STD_U4 = math.sqrt((16**2 - 1) / 12.0)  # std of a uniform 4-bit code
_STD_I8 = math.sqrt((256**2 - 1) / 12.0)  # std of a uniform int8 code
_Q4K_SUB = 32  # the 6-bit sub-block scale and min written into every Q4_K block
# ggml's E2M1 code values (kvalues_mxfp4, doubled: the E8M0 scale is read as half its power of two)
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float64)
_STD_MXFP4 = float(np.sqrt(np.mean(_MXFP4_VALUES**2)))  # std of a uniform 4-bit code (its mean is 0)


def _f16_bytes(value: float) -> np.ndarray:
    return np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)


def _q4k_scale_bytes(sc: int, m: int) -> np.ndarray:
    """The 12-byte packed (scale, min) pairs of a Q4_K block with every sub-block equal."""
    low = [sc | ((sc >> 4) << 6)] * 4 + [m | ((m >> 4) << 6)] * 4
    high = [(sc & 0xF) | ((m & 0xF) << 4)] * 4
    return np.array(low + high, dtype=np.uint8)


def random_quant(rng: np.random.Generator, qtype: QT, n_elements: int, std: float) -> np.ndarray:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_elements // block
    data = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == QT.Q8_0:  # w = d * q, q int8
        data[:, 0:2] = _f16_bytes(std / _STD_I8)
    elif qtype == QT.Q4_0:  # w = d * (q - 8), q in 0..15
        data[:, 0:2] = _f16_bytes(std / _STD_U4)
    elif qtype == QT.Q4_K:  # w = d * sc * q - dmin * m; zero mean when dmin * m = 7.5 * d * sc
        d = std / (_Q4K_SUB * _STD_U4)
        data[:, 0:2] = _f16_bytes(d)
        data[:, 2:4] = _f16_bytes(7.5 * d)
        data[:, 4:16] = _q4k_scale_bytes(_Q4K_SUB, _Q4K_SUB)
    elif qtype == QT.MXFP4:  # w = kvalues[q] * 2^(e - 128), one power-of-two scale per block of 32
        data[:, 0] = int(np.clip(round(math.log2(std / _STD_MXFP4)) + 128, 2, 254))
    else:
        raise ValueError(f"no random generator for {qtype.name}")
    return data.reshape(-1)


def tensor_data(t: TensorPlan, seed: int, index: int) -> np.ndarray:
    """The bytes (or floats) of one planned tensor, deterministic in (seed, index)."""
    rng = np.random.default_rng([seed, index])
    n = math.prod(t.ne)
    shape = tuple(reversed(t.ne))  # numpy order
    if t.kind == "norm":
        return (1.0 + 0.05 * rng.standard_normal(n, dtype=np.float32)).reshape(shape)
    if t.kind == "scale":
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).reshape(shape)
    if t.qtype == QT.F32:
        return (rng.standard_normal(n, dtype=np.float32) * np.float32(t.std)).reshape(shape)
    if t.qtype == QT.F16:
        return (rng.standard_normal(n, dtype=np.float32) * np.float32(t.std)).astype(np.float16).reshape(shape)
    return random_quant(rng, t.qtype, n, t.std)
