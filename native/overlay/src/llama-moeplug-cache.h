#pragma once

// Expert slot cache (moeplug): for MoE layers whose experts stay in host memory, copies of the
// hottest experts ("slots") live on the layer's device. build_moe_ffn then runs two passes, the
// resident experts on the slots and the others on the source tensors, each giving exact zeros
// for the experts it does not own, and adds them before the routing weights (three with
// --moe-cache-stream: some misses on the device, copied from host memory). Every expert is
// computed by the same kernels as without the cache; only which backend computes it changes.
//
// The code is ours and lives in this file and its .cpp; upstream files only call into it. Every
// call site (the patch that adds it in parentheses):
//   src/llama-model.h      llama_model::moeplug_cache, the cache of a loaded model        (0005)
//   src/llama-graph.h      llm_graph_params::moeplug_cache, llm_graph_context::moeplug_cache (0005)
//   src/llama-context.cpp  graph_params(): passes model.moeplug_cache to the graph         (0005)
//                          graph_max_nodes(): + llama_moeplug_cache::n_extra_nodes()      (0005)
//                          process_ubatch(): llama_moeplug_cache_after_compute() after a graph (0011)
//                          sched_reserve(): llama_moeplug_cache_init_sched() for each new scheduler (0020)
//   src/llama-graph.cpp    build_moe_ffn(): llama_moeplug_cache::build_experts()          (0005)
//   src/CMakeLists.txt     this file's .cpp in libllama                                   (0005)
// The C API (llama_model_moeplug_cache_init/_stats, _record_*) is ours too, in src/llama-moeplug-ext.h;
// common/moeplug-cache.{h,cpp} read profiles and call it from common_init (0006).

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include "llama-graph.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

struct llama_model;
struct llama_moeplug_cache_params;
struct llama_ubatch;

// batches above this many tokens run the stock graph unless the layer is whole (--moe-cache-max-batch)
constexpr int32_t  MOEPLUG_CACHE_MAX_BATCH_DEFAULT     = 31;
// graph nodes the two-pass path adds to a layer (remaps, the second pass, the merge): an upper bound
constexpr uint32_t MOEPLUG_CACHE_EXTRA_NODES_PER_LAYER = 64;
// tensor headers per layer in a slot context: the slot copies of every expert tensor and the maps
constexpr size_t   MOEPLUG_CACHE_TENSORS_PER_LAYER     = 64;
// dynamic policy: half-life of the use counts in tokens, slot uploads started after a batch, and
// how many more (decayed) selections a missed expert needs than the coldest resident one to swap in
constexpr float    MOEPLUG_CACHE_HALF_LIFE_DEFAULT     = 128.0f;
constexpr int32_t  MOEPLUG_CACHE_UPLOADS_DEFAULT       = 4;
constexpr float    MOEPLUG_CACHE_SWAP_MARGIN           = 2.0f;
struct llama_moeplug_cache_result;

// one MoE layer: a slot copy of each of its expert tensors and the maps from expert to slot
struct llama_moeplug_cache_layer {
    int     il       = -1;
    int64_t n_expert = 0;

    std::vector<int32_t> experts; // the expert held by each slot

    // every expert resident, slot i holding expert i: the layer runs on the slots alone, like a
    // layer whose experts were loaded on the device, at any batch size
    bool full = false;

    // prompt batches (those the device computes with the experts copied over: GGML_OP_OFFLOAD_MIN_BATCH
    // tokens and more, 32 by default) run the stock pass, and the device copies each expert they use
    // from its slot or from host memory (ggml_backend_sched_set_expert_slots): one pass, no expert
    // uploaded twice. Where the layer's device is the one prompt batches go to, its experts are in
    // pinned memory and its backend can copy them; LLAMA_MOE_CACHE_DEVICE_COPY=0 turns it off.
    bool device_copy = false;

    // source expert tensor (gate, up, gate_up, down, their biases and scales) -> slot copy
    std::unordered_map<const ggml_tensor *, ggml_tensor *> slots;

    ggml_tensor * map_src          = nullptr; // I32 [1, n_expert]: the expert, or -1 when resident
    ggml_tensor * map_slot         = nullptr; // I32 [1, n_expert]: its slot, or -1 when not resident
    ggml_tensor * map_slot_clamped = nullptr; // I32 [1, n_expert]: its slot, or 0 (per-expert scale rows)

    // misses the device computes (--moe-cache-stream): batches that run the two passes run a third, on the
    // device, for the experts with streamed[e] set and no slot, the device copying each from host memory (as it
    // does for prompt batches) while the CPU computes the other misses; map_src leaves them out
    bool                 stream  = false;
    std::vector<char>    streamed;
    ggml_tensor *        map_str = nullptr; // I32 [1, n_expert]: the expert when streamed and not resident, or -1
    // full device copies of the layer's small expert tensors (biases, scales), which the streamed pass reads
    std::unordered_map<const ggml_tensor *, ggml_tensor *> mirrors;
    // slots on a device, misses on the CPU, nothing streamed: for a batch the scheduler leaves on the CPU, the CPU's
    // inputs are copied to the host first and the device's pass is queued before the CPU computes the misses, so
    // that both run at once (LLAMA_MOE_CACHE_OVERLAP=0: the device's pass after the CPU's, as before)
    bool overlap = false;
    // slots on a device whose own host memory holds every expert tensor of the layer (pinned CUDA_Host memory, loaded
    // with --load-mode none): for a batch the scheduler leaves on the CPU, the device computes the misses too,
    // reading their rows where they are (ggml_set_read_in_place), so the layer makes no round trip to the host
    // (LLAMA_MOE_CACHE_DIRECT=1; in place of stream and overlap)
    bool direct = false;

    mutable std::atomic<bool> warned { false }; // the layer already logged why a graph ran it stock

    // runtime counters (when counting is on): expert selections in two-pass batches, and how many
    // of them a slot served
    mutable std::atomic<uint64_t> n_selected { 0 };
    mutable std::atomic<uint64_t> n_resident { 0 };
    mutable std::atomic<uint64_t> n_swaps    { 0 }; // experts uploaded into a slot after start-up
    size_t bytes_per_expert = 0; // of the source tensors: what the CPU reads per non-resident selection
    ggml_backend_dev_t dev  = nullptr; // where the slots live (the layer's device)

    // the slot of each expert (-1: not resident), from which write_maps() makes the maps the graphs read
    std::vector<int32_t> slot_of;

    // dynamic policy: selections per expert, decayed over tokens (seeded from the profile), and
    // the upload in flight: pending_expert goes into pending_slot once `uploaded` has fired
    std::vector<float>   score;
    int32_t              pending_slot   = -1;
    int32_t              pending_expert = -1;
    ggml_backend_t       upload         = nullptr; // where uploads queue (nullptr: synchronous copies)
    ggml_backend_event_t uploaded       = nullptr;

    // slot tensors whose buffer only takes whole tensors (CPU_REPACK): their bytes in source layout
    std::unordered_map<const ggml_tensor *, std::vector<uint8_t>> shadow;

    // the slot copy of a source tensor; nullptr for nullptr and for a tensor without a copy
    ggml_tensor * slot(const ggml_tensor * src) const;

    // map_src, map_slot, map_slot_clamped and map_str from slot_of and streamed (while no graph runs)
    void write_maps() const;

    // streamed: the experts without a slot, hottest (score) first, that carry about `share` of the selections of
    // the experts without a slot (by count where no score is known)
    void choose_streamed(float share);
};

// the router's selections of one MoE layer, prompt and generated tokens apart (--moe-cache-record)
struct llama_moeplug_record_layer_state {
    int                   il = -1;
    std::string           tensor; // the layer's expert down-projection weight
    std::vector<uint64_t> prefill;
    std::vector<uint64_t> decode;
};

// where a tensor's data is in the model's files
struct llama_moeplug_file_slice {
    std::string path;
    size_t      offset = 0;
};

struct llama_moeplug_cache {
    int32_t max_batch = MOEPLUG_CACHE_MAX_BATCH_DEFAULT; // larger batches run the stock graph
    bool    count     = false; // count slot hits (reads each layer's selections after a batch)
    bool    dynamic   = false; // slots follow the prompt (--moe-cache-policy dynamic)
    bool    record    = false; // count every MoE layer's selections per expert (--moe-cache-record)
    float   half_life = MOEPLUG_CACHE_HALF_LIFE_DEFAULT;
    int32_t max_uploads = MOEPLUG_CACHE_UPLOADS_DEFAULT;
    float   stream_share = 0.0f; // of a layer's misses, computed by the device from host memory (0: none)

    // dynamic policy: a backend of the slots' device whose queue is not the graphs' one, and where
    // the sources of buffers that cannot be read back are in the files
    std::vector<ggml_backend_ptr> upload_backends;
    std::vector<std::string> model_files;
    std::unordered_map<std::string, llama_moeplug_file_slice> file_slices;
    std::vector<ggml_backend_event_t> events;

    // --moe-cache-record: every MoE layer; tokens counted per phase
    std::mutex record_mutex;
    std::map<int, llama_moeplug_record_layer_state> recorded; // by layer index
    uint64_t n_record_prefill = 0;
    uint64_t n_record_decode  = 0;

    ~llama_moeplug_cache();

    // key: the layer's source expert down-projection weight
    std::unordered_map<const ggml_tensor *, std::unique_ptr<llama_moeplug_cache_layer>> layers;

    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;

    // prompt batches of this many tokens or more go to the device with their experts (GGML_OP_OFFLOAD_MIN_BATCH)
    int32_t offload_min_batch = 32;
    // ... those of the layers whose device copies their experts (device_copy) from this many, their weights named to
    // the scheduler (ggml_backend_sched_set_expert_offload); 0: offload_min_batch
    int32_t copy_min_batch = 0;
    // a prompt batch's expert copies go ahead, on a second queue, where the device can (llama_moeplug_cache_params)
    bool copy_ahead = true;

    int32_t min_batch(const llama_moeplug_cache_layer & layer) const {
        return layer.device_copy && copy_min_batch > 0 ? copy_min_batch : offload_min_batch;
    }

    // the layer to run with two passes (or a whole layer on its slots) for a batch of n_tokens, or
    // nullptr for the stock graph; *stock_on_slots: the stock graph, the device copying its experts
    // from the slots (where the context offloads prompt batches to the device: `offload`)
    const llama_moeplug_cache_layer * find(const ggml_tensor * down_exps, int64_t n_tokens, bool offload = false,
            bool * stock_on_slots = nullptr) const;

    // graph nodes the two-pass path adds, for the graph size
    uint32_t n_extra_nodes() const;

    // The experts of layer il for the graph g, through the cache: the two passes, or the stock
    // pass on the slots of a whole layer. nullptr when the layer has no cache or the batch is
    // too large: the caller builds the stock pass.
    ggml_tensor * build_experts(
            const llm_graph_context & g,
                    ggml_tensor * cur,
                    ggml_tensor * selected_experts,
          const llm_moe_experts & w,
                llm_ffn_op_type   type_op,
                            int   il) const;
};

// whether the buffer of t only takes whole tensors (CPU_REPACK)
bool llama_moeplug_whole_tensors_only(const ggml_tensor * t);

// the bytes of expert e of the expert tensor src, from memory or, where its buffer cannot be read
// back, from the model's files; throws std::runtime_error
void llama_moeplug_read_expert(llama_moeplug_cache & cache, const ggml_tensor * src, int32_t e, uint8_t * dst);

// a context's scheduler, once created: where the cache is on, backends that can copy the experts a
// prompt batch uses from host memory themselves do so, without the host reading each layer's ids
void llama_moeplug_cache_init_sched(const llama_moeplug_cache * cache, ggml_backend_sched_t sched);

// after a graph ran: reads the selections it observed, counts hits and records, and (dynamic
// policy) commits finished uploads and starts new ones (src/llama-moeplug-policy.cpp)
void llama_moeplug_cache_after_compute(llama_moeplug_cache & cache, ggml_backend_sched_t sched, ggml_cgraph * gf,
        const llama_ubatch & ubatch);

// the name of a graph's copy of a layer's selected experts, read after the graph: "moeplug_obs-IL-K"
// with K 's' (the two passes ran), 'p' (the stock pass ran, the experts copied from the slots where
// resident), 'w' (a whole layer ran its slots) or 'n' (the stock pass ran)
constexpr const char * MOEPLUG_OBS_PREFIX = "moeplug_obs-";

// builds model.moeplug_cache; on failure the model is unchanged and result.reason says why
bool llama_moeplug_cache_build(llama_model & model, const llama_moeplug_cache_params & params, llama_moeplug_cache_result & result);
