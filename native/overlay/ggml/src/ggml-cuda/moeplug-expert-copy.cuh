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

// The same copy queued on a second stream of ctx, behind the work queued so far on ctx's stream, so that it
// runs while ctx computes what is queued next; ggml_cuda_copy_experts_join makes ctx's stream wait for the
// last copy queued ahead. ggml_cuda_copy_experts_free releases the second stream when ctx is freed.
bool ggml_cuda_copy_experts_ahead(ggml_backend_cuda_context & ctx, const ggml_tensor * src, ggml_tensor * dst, const ggml_tensor * ids,
        const ggml_tensor * slots, const ggml_tensor * slot_of);
void ggml_cuda_copy_experts_join(ggml_backend_cuda_context & ctx);
void ggml_cuda_copy_experts_free(const ggml_backend_cuda_context & ctx);

// The entry points above as the scheduler asks for them (ggml-moeplug.h: "ggml_backend_copy_experts_async",
// "ggml_backend_copy_experts_ahead", "ggml_backend_copy_experts_join"), for the CUDA registry's get_proc_address;
// nullptr for any other name.
void * ggml_cuda_moeplug_proc_address(const char * name);
