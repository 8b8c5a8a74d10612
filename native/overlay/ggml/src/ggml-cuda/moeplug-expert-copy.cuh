#pragma once

#include "common.cuh"

// The scheduler's copy of the experts an offloaded MUL_MAT_ID uses (moeplug), queued on ctx's stream
// without the host reading the ids: src is a [.., .., n_expert] expert tensor in pinned host memory
// the device can read (CUDA_Host), dst its copy on the device, ids the I32 expert ids on the device
// (negative ids select nothing). Experts with slot_of[e] >= 0 come from slot slot_of[e] of `slots`,
// a copy of some of src's experts on the device (slots and slot_of may be nullptr), the others from
// host memory over the bus. Returns false, having queued nothing, where src cannot be read this way.
bool ggml_cuda_copy_experts(ggml_backend_cuda_context & ctx, const ggml_tensor * src, ggml_tensor * dst, const ggml_tensor * ids,
        const ggml_tensor * slots, const ggml_tensor * slot_of);
