#pragma once

// moeplug's additions to ggml's backend scheduler (defined in ggml/src/ggml-moeplug-sched.inc, which
// ggml-backend.cpp includes), and the entry points a backend may offer for them through
// ggml_backend_reg_get_proc_address (CUDA: ggml/src/ggml-cuda/moeplug-expert-copy.cu).
//
// The settings come from the caller (llama.cpp's expert slot cache, src/llama-moeplug-cache.cpp);
// the environment variables named below are debugging overrides, read once per scheduler.

#include "ggml-backend.h"

#ifdef  __cplusplus
extern "C" {
#endif

    // Copy the experts of src (host memory) that the expert ids select into dst (the backend's copy of src), queued on the
    // backend without a host read of the ids; those with slot_of[e] >= 0 from slot slot_of[e] of slots, a copy of some of
    // src's experts in the backend's memory (slots and slot_of may be NULL); false if the backend cannot read src this way
    // (proc address "ggml_backend_copy_experts_async")
    typedef bool (*ggml_backend_copy_experts_async_t)(ggml_backend_t backend, const struct ggml_tensor * src, struct ggml_tensor * dst,
                                                      const struct ggml_tensor * ids, const struct ggml_tensor * slots, const struct ggml_tensor * slot_of);
    // The same copy queued on a second queue of the backend, behind the work queued so far on the backend, so that it runs
    // while the backend computes what is queued next ("ggml_backend_copy_experts_ahead"); ggml_backend_copy_experts_join_t
    // makes the backend's own queue wait for it ("ggml_backend_copy_experts_join")
    typedef bool (*ggml_backend_copy_experts_ahead_t)(ggml_backend_t backend, const struct ggml_tensor * src, struct ggml_tensor * dst,
                                                      const struct ggml_tensor * ids, const struct ggml_tensor * slots, const struct ggml_tensor * slot_of);
    typedef void (*ggml_backend_copy_experts_join_t)(ggml_backend_t backend);

    // Offloaded MUL_MAT_IDs: backends that can copy the experts in use themselves do, without the host reading the ids
    // (off by default; GGML_SCHED_DEVICE_EXPERT_COPY=0|1 overrides); where the ids are known a split earlier (a layer's gate
    // and down weights, its up weights' split having run), those that can copy ahead copy while the split before computes
    // (GGML_SCHED_EXPERT_COPY_AHEAD=0 turns that part off)
    GGML_API void ggml_backend_sched_set_device_expert_copy(ggml_backend_sched_t sched, bool enable);
    // ... whether those copies go ahead where they can (on by default; call before
    // ggml_backend_sched_set_device_expert_copy; GGML_SCHED_EXPERT_COPY_AHEAD=0|1 overrides)
    GGML_API void ggml_backend_sched_set_expert_copy_ahead(ggml_backend_sched_t sched, bool enable);
    // ... and copy the experts of `weights` with slot_of[e] >= 0 from their slot in `slots`, on the backend's device
    // (slot_of: I32, one per expert, read on the device when the copy runs; slots NULL: forget `weights`)
    GGML_API void ggml_backend_sched_set_expert_slots(ggml_backend_sched_t sched, const struct ggml_tensor * weights,
                                                      const struct ggml_tensor * slots, const struct ggml_tensor * slot_of);

    // A split on a CPU backend with no inputs starts without waiting for the splits before it on other backends, where
    // none of them read memory of the CPU backend's buffers other than weights: the CPU computes while those run (off by
    // default; GGML_SCHED_HOST_OVERLAP=0 keeps it off)
    GGML_API void ggml_backend_sched_set_host_overlap(ggml_backend_sched_t sched, bool enable);

    // An op that reads `weights` from host memory (expert weights: a MUL_MAT_ID's or an ADD_ID's) is offloaded to the first
    // backend that supports it from min_batch tokens (the op's ne[2]) on, in place of that backend's own threshold
    // (GGML_OP_OFFLOAD_MIN_BATCH on CUDA); min_batch 0: the backend's threshold again
    GGML_API void ggml_backend_sched_set_expert_offload(ggml_backend_sched_t sched, const struct ggml_tensor * weights, int min_batch);

    // opt-in for ggml_mul_mat_id and ggml_add_id results: the op reads its expert weights (src[0] of
    // ggml_mul_mat_id, src[1] of ggml_add_id) where they are, when they sit in the host memory of the
    // device that computes the op (ggml_backend_dev_host_buffer_type, e.g. pinned CUDA_Host memory the
    // GPU can address): the scheduler copies nothing of them, and the device's kernels read only the
    // rows of the experts the ids name, over the bus. Elsewhere the weights are copied as before.
    GGML_API void ggml_set_read_in_place(struct ggml_tensor * a);
    GGML_API bool ggml_get_read_in_place(const struct ggml_tensor * a);

#ifdef  __cplusplus
}
#endif
