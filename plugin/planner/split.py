"""llama.cpp's layer split: which device each block (and the output layer) of a model lands on.

With `-sm layer` (the default split mode) llama.cpp gives every repeating block, and the output
layer as one more, to a device by `--tensor-split` (src/llama-model.cpp,
llama_model_base::load_tensors): the proportions are summed into cumulative split points and
normalised by their sum, in float32; of the n_layer + 1 layers (blocks, then the output layer)
the first `n_layer + 1 - ngl` stay on the CPU, and layer `il` of the others goes to the first
device whose split point is greater than `float(il - i_gpu_start) / act_gpu_layers`
(`std::upper_bound`). The input layer (token embeddings) always stays on the CPU. Without
`--tensor-split` (all zero) the proportions are each device's free memory.

`layer_devices` reproduces that arithmetic, float32 rounding included (numpy float32 rounds each
operation as C++ `float` does), so that the split moeplug plans is the one llama.cpp loads.
`split_for` gives the `--tensor-split` integers that put exactly the first k layers on the first
device: with integer proportions k and n_layer + 1 - k both the split point and the position of
layer k are the float32 of k / (n_layer + 1), and upper_bound sends layer k to the next device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def split_points(proportions: Sequence[float]) -> np.ndarray:
    """float32 cumulative split points, normalised by their sum, as load_tensors computes them."""
    f32 = np.float32
    points = np.zeros(len(proportions), dtype=f32)
    total = f32(0.0)
    for i, p in enumerate(proportions):
        total = f32(total + f32(p))
        points[i] = total
    if total == 0:  # all zero: llama.cpp splits by free memory instead
        raise ValueError("tensor split proportions must not all be zero")
    for i in range(len(points)):
        points[i] = f32(points[i] / total)
    return points


def layer_devices(n_layer: int, proportions: Sequence[float], n_gpu_layers: int = -1) -> list[int | None]:
    """The device index (into proportions) of each of the n_layer + 1 layers, blocks in order and the
    output layer last; None where the layer stays on the CPU. n_layer: the GGUF block count (NextN
    blocks included); n_gpu_layers: -ngl (-1: all, as llama.cpp's default; moeplug passes 99)."""
    if n_layer <= 0 or not proportions:
        raise ValueError("layer_devices needs a positive block count and at least one device")
    if any(p < 0 for p in proportions):
        raise ValueError("tensor split proportions must not be negative")
    f32 = np.float32
    n_all = n_layer + 1
    ngl = n_all if n_gpu_layers < 0 else n_gpu_layers
    i_gpu_start = max(n_all - ngl, 0)
    act_gpu_layers = min(ngl, n_all)
    points = split_points(proportions)
    out: list[int | None] = []
    for il in range(n_all):
        if il < i_gpu_start or il - i_gpu_start >= act_gpu_layers:
            out.append(None)
            continue
        x = f32(f32(il - i_gpu_start) / f32(act_gpu_layers))
        out.append(int(np.searchsorted(points, x, side="right")))  # std::upper_bound
    return out


def split_for(n_layer: int, first: int) -> list[int]:
    """--tensor-split proportions (two devices, -ngl covering every layer) that put layers [0, first)
    on the first device and the rest, output layer included, on the second."""
    if not 0 <= first <= n_layer + 1:
        raise ValueError(f"the first device's layer count must be 0..{n_layer + 1}")
    return split_counts(n_layer, [first, n_layer + 1 - first])


def split_counts(n_layer: int, counts: list[int]) -> list[int]:
    """--tensor-split proportions (-ngl covering every layer) that put counts[d] of the n_layer + 1
    layers on device d, in order (blocks first, the output layer last): the counts themselves, as
    for two devices (split_for), checked against llama.cpp's arithmetic."""
    if sum(counts) != n_layer + 1 or min(counts) < 0:
        raise ValueError(f"the layer counts must be 0 or more and add up to {n_layer + 1}")
    want = [d for d, c in enumerate(counts) for _ in range(c)]
    assert layer_devices(n_layer, counts) == want, (n_layer, counts)
    return list(counts)
