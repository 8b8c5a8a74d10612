#include "moeplug-expert-copy.cuh"

#include "ggml-backend-impl.h"
#include "ggml-cuda.h"

#include <cstring>
#include <mutex>
#include <unordered_map>

#define CUDA_EXPERT_COPY_BLOCK_SIZE       256
#define CUDA_EXPERT_COPY_UNROLL           4
#define CUDA_EXPERT_COPY_MAX_BLOCKS       64 // per expert
// beside compute: the bus, not the SMs, bounds the copy, and the fewer blocks, the less they take from the
// kernels they run beside. A copy ahead gets about this many blocks in all, spread over the experts its ids can
// select, and at least the minimum per expert: 2 for a prompt batch, which selects most experts, 16 for a decoded
// token's 4 (GGML_CUDA_EXPERT_COPY_AHEAD_BLOCKS: a fixed number per expert)
#define CUDA_EXPERT_COPY_AHEAD_BLOCKS     64
#define CUDA_EXPERT_COPY_AHEAD_MIN_BLOCKS 2

static __global__ void k_mark_used_experts(
        const char * __restrict__ ids, int64_t ne0, int64_t n, size_t nb0, size_t nb1,
        int32_t * __restrict__ used, int64_t n_expert) {
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const int32_t id = *(const int32_t *) (ids + (i % ne0)*nb0 + (i / ne0)*nb1);
    if (id >= 0 && id < n_expert) {
        used[id] = 1;
    }
}

// blocks (x, e) copy used expert e: its n words from its slot or from host memory, and pad words of the
// expert after it from host memory (as the host's copies do: mmq reads a little past an expert's last row)
template <typename T>
static __global__ void k_copy_used_experts(
        const T * __restrict__ host, const T * __restrict__ slots, const int32_t * __restrict__ slot_of,
        T * __restrict__ dst, const int32_t * __restrict__ used, int64_t n_expert, int64_t n, int64_t pad) {
    const int64_t e = blockIdx.y;
    if (!used[e]) {
        return;
    }
    const int32_t s   = slot_of != nullptr ? slot_of[e] : -1;
    const T *     src = s >= 0 ? slots + s*n : host + e*n;
    T *           out = dst + e*n;

    const int64_t step = (int64_t) gridDim.x*blockDim.x;
    int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    for (; i + (CUDA_EXPERT_COPY_UNROLL - 1)*step < n; i += CUDA_EXPERT_COPY_UNROLL*step) {
        T v[CUDA_EXPERT_COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < CUDA_EXPERT_COPY_UNROLL; ++u) {
            v[u] = src[i + u*step];
        }
#pragma unroll
        for (int u = 0; u < CUDA_EXPERT_COPY_UNROLL; ++u) {
            out[i + u*step] = v[u];
        }
    }
    for (; i < n; i += step) {
        out[i] = src[i];
    }

    if (e < n_expert - 1 && blockIdx.x == 0) {
        for (int64_t j = threadIdx.x; j < pad; j += blockDim.x) {
            out[n + j] = host[(e + 1)*n + j];
        }
    }
}

template <typename T>
static void copy_used_experts_cuda(const void * host, const void * slots, const int32_t * slot_of, void * dst, const int32_t * used,
        int64_t n_expert, size_t expert_size, size_t pad, int max_blocks, cudaStream_t stream) {
    const int64_t n         = (int64_t) (expert_size/sizeof(T));
    const int64_t per_block = (int64_t) CUDA_EXPERT_COPY_BLOCK_SIZE*CUDA_EXPERT_COPY_UNROLL*8;
    const dim3 grid((unsigned) std::max<int64_t>(1, std::min<int64_t>(max_blocks, (n + per_block - 1)/per_block)), (unsigned) n_expert, 1);
    const dim3 block(CUDA_EXPERT_COPY_BLOCK_SIZE, 1, 1);
    k_copy_used_experts<<<grid, block, 0, stream>>>((const T *) host, (const T *) slots, slot_of, (T *) dst, used,
        n_expert, n, (int64_t) (pad/sizeof(T)));
}

// whether the copy can run; host: src's address on the device
static bool copy_experts_supported(const ggml_tensor * src, const ggml_tensor * dst, const ggml_tensor * ids,
        const ggml_tensor * slots, const ggml_tensor * slot_of, void ** host) {
    const int     dim         = ggml_n_dims(src) - 1;
    const int64_t n_expert    = src->ne[dim];
    const size_t  expert_size = src->nb[dim];

    if (ids->type != GGML_TYPE_I32 || !ggml_are_same_shape(src, dst) || !ggml_is_contiguous(src) || !ggml_is_contiguous(dst) ||
        n_expert > 65535) {
        return false;
    }
    if (slots != nullptr && (slot_of == nullptr || slot_of->type != GGML_TYPE_I32 || ggml_nelements(slot_of) != n_expert ||
            !ggml_is_contiguous(slot_of) || !ggml_is_contiguous(slots) || slots->type != src->type ||
            slots->nb[ggml_n_dims(slots) - 1] != expert_size)) {
        return false;
    }
    if (cudaHostGetDevicePointer(host, src->data, 0) != cudaSuccess) {
        (void) cudaGetLastError();
        return false;
    }
    return true;
}

// queues the marking of the used experts into `used` and their copy on `stream`
static void copy_experts_queue(const void * host, const ggml_tensor * src, ggml_tensor * dst, const ggml_tensor * ids,
        const ggml_tensor * slots, const ggml_tensor * slot_of, int32_t * used, int max_blocks, cudaStream_t stream) {
    const int     dim         = ggml_n_dims(src) - 1;
    const int64_t n_expert    = src->ne[dim];
    const size_t  expert_size = src->nb[dim];
    const size_t  pad         = std::min<size_t>(expert_size, 512);

    CUDA_CHECK(cudaMemsetAsync(used, 0, n_expert*sizeof(int32_t), stream));

    const int64_t n_ids = ggml_nelements(ids);
    if (n_ids > 0) {
        const int n_blocks = (int) ((n_ids + CUDA_EXPERT_COPY_BLOCK_SIZE - 1) / CUDA_EXPERT_COPY_BLOCK_SIZE);
        k_mark_used_experts<<<n_blocks, CUDA_EXPERT_COPY_BLOCK_SIZE, 0, stream>>>(
            (const char *) ids->data, ids->ne[0], n_ids, ids->nb[0], ids->nb[1], used, n_expert);
    }

    const void *    slots_d   = slots != nullptr ? slots->data : nullptr;
    const int32_t * slot_of_d = slots != nullptr ? (const int32_t *) slot_of->data : nullptr;

    // the widest word that divides every address and length
    const uintptr_t a = (uintptr_t) host | (uintptr_t) dst->data | (uintptr_t) slots_d | expert_size | pad;
    if (a % 16 == 0) {
        copy_used_experts_cuda<int4>(host, slots_d, slot_of_d, dst->data, used, n_expert, expert_size, pad, max_blocks, stream);
    } else if (a % 8 == 0) {
        copy_used_experts_cuda<int2>(host, slots_d, slot_of_d, dst->data, used, n_expert, expert_size, pad, max_blocks, stream);
    } else if (a % 4 == 0) {
        copy_used_experts_cuda<int>(host, slots_d, slot_of_d, dst->data, used, n_expert, expert_size, pad, max_blocks, stream);
    } else {
        copy_used_experts_cuda<char>(host, slots_d, slot_of_d, dst->data, used, n_expert, expert_size, pad, max_blocks, stream);
    }
    CUDA_CHECK(cudaGetLastError());
}

bool ggml_cuda_copy_experts(ggml_backend_cuda_context & ctx, const ggml_tensor * src, ggml_tensor * dst, const ggml_tensor * ids,
        const ggml_tensor * slots, const ggml_tensor * slot_of) {
    void * host = nullptr;
    if (!copy_experts_supported(src, dst, ids, slots, slot_of, &host)) {
        return false;
    }

    ggml_cuda_set_device(ctx.device);
    ggml_cuda_pool_alloc<int32_t> used(ctx.pool(), src->ne[ggml_n_dims(src) - 1]);
    copy_experts_queue(host, src, dst, ids, slots, slot_of, used.get(), CUDA_EXPERT_COPY_MAX_BLOCKS, ctx.stream());
    return true;
}

// the second stream of a context and what orders it against the context's stream
struct cuda_expert_copy_ahead {
    cudaStream_t stream = nullptr;
    cudaEvent_t  queued = nullptr; // the context's stream reached the copy
    cudaEvent_t  done   = nullptr; // the last copy queued is done
    int32_t *    used   = nullptr; // the experts the copy uses (the pool follows one stream only)
    int64_t      n_used = 0;
};

// never destroyed: a backend may be freed after static destructors have run
static std::mutex & g_ahead_mutex = *new std::mutex();
static std::unordered_map<const ggml_backend_cuda_context *, cuda_expert_copy_ahead> & g_ahead =
    *new std::unordered_map<const ggml_backend_cuda_context *, cuda_expert_copy_ahead>();

static int env_int(const char * name, int def) {
    const char * v = getenv(name);
    return v != nullptr ? atoi(v) : def;
}

bool ggml_cuda_copy_experts_ahead(ggml_backend_cuda_context & ctx, const ggml_tensor * src, ggml_tensor * dst, const ggml_tensor * ids,
        const ggml_tensor * slots, const ggml_tensor * slot_of) {
    void * host = nullptr;
    if (!copy_experts_supported(src, dst, ids, slots, slot_of, &host)) {
        return false;
    }

    ggml_cuda_set_device(ctx.device);
    const int64_t n_expert = src->ne[ggml_n_dims(src) - 1];

    std::lock_guard<std::mutex> lock(g_ahead_mutex);
    cuda_expert_copy_ahead & a = g_ahead[&ctx];
    if (a.stream == nullptr) {
        // the highest priority: a block of the copy starts as soon as one of the compute kernel's ends
        // (GGML_CUDA_EXPERT_COPY_AHEAD_PRIORITY=0: the default priority)
        int lowest = 0, highest = 0;
        CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
        const int priority = env_int("GGML_CUDA_EXPERT_COPY_AHEAD_PRIORITY", 1) != 0 ? highest : 0;
        CUDA_CHECK(cudaStreamCreateWithPriority(&a.stream, cudaStreamNonBlocking, priority));
        CUDA_CHECK(cudaEventCreateWithFlags(&a.queued, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&a.done,   cudaEventDisableTiming));
    }
    if (a.n_used < n_expert) {
        CUDA_CHECK(cudaStreamSynchronize(a.stream));
        CUDA_CHECK(cudaFree(a.used));
        CUDA_CHECK(cudaMalloc((void **) &a.used, n_expert*sizeof(int32_t)));
        a.n_used = n_expert;
    }

    CUDA_CHECK(cudaEventRecord(a.queued, ctx.stream()));
    CUDA_CHECK(cudaStreamWaitEvent(a.stream, a.queued, 0));
    static const int fixed_blocks = env_int("GGML_CUDA_EXPERT_COPY_AHEAD_BLOCKS", 0);
    const int64_t n_selectable = std::max<int64_t>(1, std::min<int64_t>(n_expert, ggml_nelements(ids)));
    const int max_blocks = fixed_blocks > 0 ? fixed_blocks :
        (int) std::max<int64_t>(CUDA_EXPERT_COPY_AHEAD_MIN_BLOCKS, CUDA_EXPERT_COPY_AHEAD_BLOCKS / n_selectable);
    copy_experts_queue(host, src, dst, ids, slots, slot_of, a.used, max_blocks, a.stream);
    CUDA_CHECK(cudaEventRecord(a.done, a.stream));
    return true;
}

void ggml_cuda_copy_experts_join(ggml_backend_cuda_context & ctx) {
    std::lock_guard<std::mutex> lock(g_ahead_mutex);
    const auto it = g_ahead.find(&ctx);
    if (it != g_ahead.end()) {
        ggml_cuda_set_device(ctx.device);
        CUDA_CHECK(cudaStreamWaitEvent(ctx.stream(), it->second.done, 0));
    }
}

void ggml_cuda_copy_experts_free(const ggml_backend_cuda_context & ctx) {
    std::lock_guard<std::mutex> lock(g_ahead_mutex);
    const auto it = g_ahead.find(&ctx);
    if (it == g_ahead.end()) {
        return;
    }
    ggml_cuda_set_device(ctx.device);
    cuda_expert_copy_ahead & a = it->second;
    CUDA_CHECK(cudaStreamSynchronize(a.stream));
    CUDA_CHECK(cudaFree(a.used));
    CUDA_CHECK(cudaEventDestroy(a.queued));
    CUDA_CHECK(cudaEventDestroy(a.done));
    CUDA_CHECK(cudaStreamDestroy(a.stream));
    g_ahead.erase(it);
}

// whether the buffers suit the copy of the experts (slots and slot_of cleared where not on this device)
static bool ggml_backend_cuda_copy_experts_buffers(ggml_backend_cuda_context * cuda_ctx, const ggml_tensor * src, const ggml_tensor * dst,
        const ggml_tensor * ids, const ggml_tensor ** slots, const ggml_tensor ** slot_of) {
    ggml_backend_buffer_t src_buf = src->view_src ? src->view_src->buffer : src->buffer;
    ggml_backend_buffer_t dst_buf = dst->view_src ? dst->view_src->buffer : dst->buffer;
    ggml_backend_buffer_t ids_buf = ids->view_src ? ids->view_src->buffer : ids->buffer;
    ggml_backend_buffer_type_t dev_buft = ggml_backend_cuda_buffer_type(cuda_ctx->device);
    // CUDA_Host, the pinned host buffers (ggml-cuda.cu tells them apart by their name function, as here)
    const auto host_name = ggml_backend_cuda_host_buffer_type()->iface.get_name;
    if (src_buf == nullptr || dst_buf == nullptr || ids_buf == nullptr ||
        src_buf->buft->iface.get_name != host_name || dst_buf->buft != dev_buft || ids_buf->buft != dev_buft) {
        return false;
    }
    if (*slots != nullptr) {
        ggml_backend_buffer_t slots_buf   = (*slots)->view_src   ? (*slots)->view_src->buffer   : (*slots)->buffer;
        ggml_backend_buffer_t slot_of_buf = (*slot_of)->view_src ? (*slot_of)->view_src->buffer : (*slot_of)->buffer;
        if (slots_buf == nullptr || slot_of_buf == nullptr || slots_buf->buft != dev_buft || slot_of_buf->buft != dev_buft) {
            *slots   = nullptr; // not on this device: every expert from host memory
            *slot_of = nullptr;
        }
    }
    return true;
}

// the scheduler's copy of the experts an offloaded MUL_MAT_ID uses, queued without a host read of the ids
static bool ggml_backend_cuda_copy_experts_async(ggml_backend_t backend, const ggml_tensor * src, ggml_tensor * dst, const ggml_tensor * ids,
        const ggml_tensor * slots, const ggml_tensor * slot_of) {
    ggml_backend_cuda_context * cuda_ctx = (ggml_backend_cuda_context *) backend->context;
    return ggml_backend_cuda_copy_experts_buffers(cuda_ctx, src, dst, ids, &slots, &slot_of) &&
        ggml_cuda_copy_experts(*cuda_ctx, src, dst, ids, slots, slot_of);
}

// the same copy on a second stream, while the context's stream computes what is queued next
static bool ggml_backend_cuda_copy_experts_ahead(ggml_backend_t backend, const ggml_tensor * src, ggml_tensor * dst, const ggml_tensor * ids,
        const ggml_tensor * slots, const ggml_tensor * slot_of) {
    ggml_backend_cuda_context * cuda_ctx = (ggml_backend_cuda_context *) backend->context;
    return ggml_backend_cuda_copy_experts_buffers(cuda_ctx, src, dst, ids, &slots, &slot_of) &&
        ggml_cuda_copy_experts_ahead(*cuda_ctx, src, dst, ids, slots, slot_of);
}

// the context's stream waits for the last copy queued ahead
static void ggml_backend_cuda_copy_experts_join(ggml_backend_t backend) {
    ggml_cuda_copy_experts_join(*(ggml_backend_cuda_context *) backend->context);
}

void * ggml_cuda_moeplug_proc_address(const char * name) {
    if (strcmp(name, "ggml_backend_copy_experts_async") == 0) {
        return (void *) ggml_backend_cuda_copy_experts_async;
    }
    if (strcmp(name, "ggml_backend_copy_experts_ahead") == 0) {
        return (void *) ggml_backend_cuda_copy_experts_ahead;
    }
    if (strcmp(name, "ggml_backend_copy_experts_join") == 0) {
        return (void *) ggml_backend_cuda_copy_experts_join;
    }
    return nullptr;
}
