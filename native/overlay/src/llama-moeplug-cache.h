#pragma once

// Expert slot cache (moeplug): for MoE layers whose experts stay in host memory, copies of the
// hottest experts ("slots") live on the layer's device. build_moe_ffn then runs two passes, the
// resident experts on the slots and the others on the source tensors, each giving exact zeros
// for the experts it does not own, and adds them before the routing weights. Every expert is
// computed by the same kernels as without the cache; only which backend computes it changes.
//
// The code is ours and lives in this file and its .cpp; upstream files only call into it. Every
// call site (the patch that adds it in parentheses):
//   src/llama-model.h      llama_model::moeplug_cache, the cache of a loaded model        (0005)
//   src/llama-graph.h      llm_graph_params::moeplug_cache, llm_graph_context::moeplug_cache (0005)
//   src/llama-context.cpp  graph_params(): passes model.moeplug_cache to the graph         (0005)
//                          graph_max_nodes(): + llama_moeplug_cache::n_extra_nodes()      (0005)
//                          process_ubatch(): llama_moeplug_cache_count() after a graph    (0011)
//   src/llama-graph.cpp    build_moe_ffn(): llama_moeplug_cache::build_experts()          (0005)
//   src/llama-ext.h        the C API: llama_model_moeplug_cache_init/_stats               (0005, 0011)
//   src/CMakeLists.txt     this file's .cpp in libllama                                   (0005)
// common/moeplug-cache.{h,cpp} read profiles and call the C API from common_init (0006).

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include "llama-graph.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

struct llama_model;
struct llama_moeplug_cache_params;

// batches above this many tokens run the stock graph unless the layer is whole (--moe-cache-max-batch)
constexpr int32_t  MOEPLUG_CACHE_MAX_BATCH_DEFAULT     = 31;
// graph nodes the two-pass path adds to a layer (remaps, the second pass, the merge): an upper bound
constexpr uint32_t MOEPLUG_CACHE_EXTRA_NODES_PER_LAYER = 64;
// tensor headers per layer in a slot context: the slot copies of every expert tensor and the maps
constexpr size_t   MOEPLUG_CACHE_TENSORS_PER_LAYER     = 64;
struct llama_moeplug_cache_result;

// one MoE layer: a slot copy of each of its expert tensors and the maps from expert to slot
struct llama_moeplug_cache_layer {
    int     il       = -1;
    int64_t n_expert = 0;

    std::vector<int32_t> experts; // the expert held by each slot

    // every expert resident, slot i holding expert i: the layer runs on the slots alone, like a
    // layer whose experts were loaded on the device, at any batch size
    bool full = false;

    // source expert tensor (gate, up, gate_up, down, their biases and scales) -> slot copy
    std::unordered_map<const ggml_tensor *, ggml_tensor *> slots;

    ggml_tensor * map_src          = nullptr; // I32 [1, n_expert]: the expert, or -1 when resident
    ggml_tensor * map_slot         = nullptr; // I32 [1, n_expert]: its slot, or -1 when not resident
    ggml_tensor * map_slot_clamped = nullptr; // I32 [1, n_expert]: its slot, or 0 (per-expert scale rows)

    mutable std::atomic<bool> warned { false }; // the layer already logged why a graph ran it stock

    // runtime counters (when counting is on): expert selections in two-pass batches, and how many
    // of them a slot served
    mutable std::atomic<uint64_t> n_selected { 0 };
    mutable std::atomic<uint64_t> n_resident { 0 };
    size_t bytes_per_expert = 0; // of the source tensors: what the CPU reads per non-resident selection

    // the slot copy of a source tensor; nullptr for nullptr and for a tensor without a copy
    ggml_tensor * slot(const ggml_tensor * src) const;
};

struct llama_moeplug_cache {
    int32_t max_batch = MOEPLUG_CACHE_MAX_BATCH_DEFAULT; // larger batches run the stock graph
    bool    count     = false; // keep the slot ids of each batch and count hits (costs a read per layer)

    // key: the layer's source expert down-projection weight
    std::unordered_map<const ggml_tensor *, std::unique_ptr<llama_moeplug_cache_layer>> layers;

    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;

    // the layer to run with two passes for a batch of n_tokens, or nullptr for the stock graph
    const llama_moeplug_cache_layer * find(const ggml_tensor * down_exps, int64_t n_tokens) const;

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

// adds the slot hits of a computed graph to the counters
void llama_moeplug_cache_count(const llama_moeplug_cache & cache, ggml_cgraph * gf);

// builds model.moeplug_cache; on failure the model is unchanged and result.reason says why
bool llama_moeplug_cache_build(llama_model & model, const llama_moeplug_cache_params & params, llama_moeplug_cache_result & result);
