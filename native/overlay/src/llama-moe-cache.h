#pragma once

// Expert slot cache (moeplug): for MoE layers whose experts stay in host memory, copies of the
// hottest experts ("slots") live on the layer's device. build_moe_ffn then runs two passes, the
// resident experts on the slots and the others on the source tensors, each giving exact zeros
// for the experts it does not own, and adds them before the routing weights. Every expert is
// computed by the same kernels as without the cache; only which backend computes it changes.

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

struct llama_model;
struct llama_moe_cache_params;
struct llama_moe_cache_result;

// one MoE layer: a slot copy of each of its expert tensors and the maps from expert to slot
struct llama_moe_cache_layer {
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

struct llama_moe_cache {
    int32_t max_batch = 31; // larger batches run the stock graph
    bool    count     = false; // keep the slot ids of each batch and count hits (costs a read per layer)

    // key: the layer's source expert down-projection weight
    std::unordered_map<const ggml_tensor *, std::unique_ptr<llama_moe_cache_layer>> layers;

    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;

    // the layer to run with two passes for a batch of n_tokens, or nullptr for the stock graph
    const llama_moe_cache_layer * find(const ggml_tensor * down_exps, int64_t n_tokens) const;

    // graph nodes the two-pass path adds, for the graph size
    uint32_t n_extra_nodes() const;
};

// adds the slot hits of a computed graph to the counters
void llama_moe_cache_count(const llama_moe_cache & cache, ggml_cgraph * gf);

// builds model.moe_cache; on failure the model is unchanged and result.reason says why
bool llama_moe_cache_build(llama_model & model, const llama_moe_cache_params & params, llama_moe_cache_result & result);
