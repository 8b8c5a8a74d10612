"""The backends llama.cpp is built for and planned on, one record each with what its GPU path can do,
so that no caller compares names.

    CPU     no GPU: every expert on the CPU (the demo holds its slots in RAM)
    CUDA    NVIDIA GPUs: every path of the expert cache
    VULKAN  any Vulkan device (AMD, Intel, NVIDIA; Mesa's lavapipe without a GPU): the slots, static and
            dynamic, and the CPU computing a layer's misses beside them

What a backend cannot do yet is refused by the planner with its reason (`missing`), never dropped
without a word. A value compares equal to its name ("cuda" == Backend.CUDA), which is what build
manifests and installed plans store.
"""

from __future__ import annotations

from enum import Enum

from moeplug.core.errors import EXIT_USAGE, MoeplugError

# what a GPU path of the cache needs beyond the slots, and why a backend without it cannot run it: its
# native code (ggml-cuda's expert copies, patches 0021-0026, 0033) exists for CUDA alone
CAPABILITIES = {
    "stream": "streamed misses (--moe-cache-stream: the GPU copies the experts it computes from pinned RAM itself)",
    "copy_ahead": "copies ahead (a prompt batch's next expert weights copied on a second queue)",
    "copy_experts": "prompt batches through the stock pass with the GPU copying each expert from its slot",
    "read_in_place": "misses read in place (the GPU reading pinned RAM where the experts are)",
}


class Backend(str, Enum):
    CPU = "cpu"
    CUDA = "cuda"
    VULKAN = "vulkan"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def label(self) -> str:
        """As people write it: CPU, CUDA, Vulkan."""
        return {"cpu": "CPU", "cuda": "CUDA", "vulkan": "Vulkan"}[self.value]

    @property
    def gpu(self) -> bool:
        return self is not Backend.CPU

    @property
    def device_prefix(self) -> str:
        """llama.cpp's names of this backend's devices: CUDA0, Vulkan0 ('' for the CPU)."""
        return "" if self is Backend.CPU else self.label

    def can(self, capability: str) -> bool:
        """Whether this backend's GPU path has `capability` (a key of CAPABILITIES)."""
        if capability not in CAPABILITIES:
            raise KeyError(capability)
        return self is Backend.CUDA

    @property
    def can_stream(self) -> bool:
        return self.can("stream")

    @property
    def can_copy_ahead(self) -> bool:
        return self.can("copy_ahead")

    @property
    def can_copy_experts(self) -> bool:
        return self.can("copy_experts")

    def missing(self) -> list[str]:
        """What the cache's GPU paths need that this GPU backend lacks, as the plan says it."""
        if not self.gpu:
            return []
        return [CAPABILITIES[c] for c in CAPABILITIES if not self.can(c)]


def backend(name: str | Backend | None, default: Backend = Backend.CPU) -> Backend:
    """The backend of a name (a manifest's, a plan's, a flag's); `default` for None; a one-line error
    for another name."""
    if name is None:
        return default
    try:
        return Backend(name)
    except ValueError:
        raise MoeplugError(f"backend {name!r}: one of {', '.join(b.value for b in Backend)}", EXIT_USAGE) from None
