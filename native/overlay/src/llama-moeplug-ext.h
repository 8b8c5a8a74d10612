#pragma once

// moeplug's C API in libllama: the expert slot cache (src/llama-moeplug-cache.cpp, llama-moeplug-policy.cpp)
// and route replay (src/llama-moeplug-replay.cpp). Called from common/moeplug-cache.cpp and the tests;
// staging like llama-ext.h beside it, C++ callers only.

#include "llama.h"

#include <cstddef>
#include <cstdint>

//
// expert slot cache (src/llama-moeplug-cache.h)
//

// the experts one MoE layer keeps resident
struct llama_moeplug_cache_layer_experts {
    const char    * tensor;    // the layer's expert down-projection weight, e.g. "blk.3.ffn_down_exps.weight"
    const int32_t * experts;   // the experts to keep, one per slot
    int32_t         n_experts;
    const float   * rates;     // selections per token of each of the layer's experts (the profile's),
    int32_t         n_rates;   // seeding the dynamic policy's use counts; NULL, 0: none
};

enum llama_moeplug_cache_policy {
    LLAMA_MOEPLUG_CACHE_POLICY_STATIC  = 0, // the slots keep the experts they start with
    LLAMA_MOEPLUG_CACHE_POLICY_DYNAMIC = 1, // between batches, a hot missed expert replaces a cold resident one
};

struct llama_moeplug_cache_params {
    const char * const * model_files; // every file of the model (all shards): slices of weights memory cannot give back
    size_t       n_model_files;
    const struct llama_moeplug_cache_layer_experts * layers;
    size_t       n_layers;
    int32_t      max_batch;    // larger batches run the stock graph
    size_t       margin;       // device bytes to leave free
    bool         count;        // count slot hits (llama_model_moeplug_cache_stats); costs a read per layer and batch
    enum llama_moeplug_cache_policy policy;
    float        half_life;    // dynamic: tokens over which a use count halves (<= 0: the default)
    int32_t      max_uploads;  // dynamic: slot uploads started after a batch, all layers (<= 0: the default)
    float        stream_share; // of each layer's misses, the share the device copies from host memory and computes beside
                               // the CPU (0: none; where the device copies experts itself, or the slots are on the CPU)
    int32_t      offload_min_batch; // prompt batches of the layers whose device copies their experts go to the device from
                                    // this many tokens (0: the device's threshold, GGML_OP_OFFLOAD_MIN_BATCH or 32)
    bool         no_copy_ahead; // a prompt batch's expert copies wait for the split before them (false: they go ahead where the
                                // device can copy on a second queue)
    bool         slots_on_cpu;  // the slots in RAM with the source's buffer type (false: on each layer's device)
};

struct llama_moeplug_cache_result {
    int32_t  n_layers;         // layers with slots
    int32_t  n_slots;          // slots per layer (the largest)
    int32_t  n_slots_min;      // the smallest
    int64_t  n_slots_total;    // of all layers
    int32_t  n_layers_full;    // layers with every expert resident (no host pass)
    int32_t  n_layers_copied;  // layers whose prompt batches run one pass, the device copying their experts from the slots
    int32_t  n_layers_streamed; // layers whose device computes some misses
    float    stream_share;     // the share of their misses it computes (LLAMA_MOE_CACHE_STREAM overrides the params')
    int32_t  n_layers_overlapped; // layers whose device computes their slots while the CPU computes their misses
    int32_t  n_layers_direct;  // layers whose device computes their misses too, reading them from host memory in place
    int32_t  offload_min_batch;   // the prompt batches of the n_layers_copied go to the device from this many tokens
    uint64_t n_bytes;          // bytes copied into slots
    double   t_upload_s;
    char     device[64];       // where the slots are
    char     reason[512];      // why the cache did not engage
};

struct llama_moeplug_cache_layer_stats {
    int32_t  il;
    uint64_t n_selected;       // expert selections in batches that ran the two passes
    uint64_t n_resident;       // of them, served by a slot
    uint64_t bytes_per_expert; // read from host memory for each selection a slot did not serve
    uint64_t n_swaps;          // experts uploaded into a slot after start-up (dynamic policy)
    char     device[32];       // where the layer's slots live
};

// Fills up to n_max layers' counters (in layer order); returns the number of cached layers.
LLAMA_API size_t llama_model_moeplug_cache_stats(
        const struct llama_model * model,
        struct llama_moeplug_cache_layer_stats * out,
        size_t n_max);

// Builds the cache; call after loading the model and before creating a context.
// Returns false, with the model unchanged and the reason in result, when it cannot engage.
LLAMA_API bool llama_model_moeplug_cache_init(
        struct llama_model * model,
        const struct llama_moeplug_cache_params * params,
        struct llama_moeplug_cache_result * result);

// Counts, from now on, the router's selections of every MoE layer per expert, prompt and generated
// tokens apart (a token whose logits are asked for counts as generated); works with or without
// slots. Call after loading the model and before creating a context.
LLAMA_API bool llama_model_moeplug_record_init(struct llama_model * model);

struct llama_moeplug_record_layer {
    int32_t      il;
    const char * tensor;       // the layer's expert down-projection weight (valid while the model lives)
    int32_t      n_expert;
};

// Copies what was recorded: up to n_max layers (in layer order) into layers and, when counts is not
// NULL, 2*n_expert_max counts per layer (prefill then decode); n_tokens (when not NULL) gets the
// prompt and the generated tokens recorded. reset zeroes everything after the copy. Returns the
// number of layers recorded (0 when not recording).
LLAMA_API size_t llama_model_moeplug_record_read(
        const struct llama_model * model,
        struct llama_moeplug_record_layer * layers,
        uint64_t * counts,
        int32_t n_expert_max,
        size_t n_max,
        uint64_t * n_tokens,
        bool reset);

//
// route replay (src/llama-moeplug-replay.h): recorded router decisions replace the router's
//

struct llama_moeplug_replay_result {
    int32_t n_prompts;
    int64_t n_tokens;
    int32_t n_layer;           // MoE layers replayed
    int32_t n_expert;
    int32_t n_expert_used;
    bool    has_weights;       // the file's routing weights replace the model's
    char    reason[512];       // why the file was refused
};

// Reads a replay file (native/REPLAY-FORMAT.md in moeplug); call after loading the model and
// before creating a context. Returns false, with the model unchanged and the reason in result,
// when the file cannot be read or does not match the model's MoE layers.
LLAMA_API bool llama_model_moeplug_replay_init(
        struct llama_model * model,
        const char * path,
        struct llama_moeplug_replay_result * result);

// Forgets which prompt each sequence replays: the next sequence takes the file's first prompt.
LLAMA_API void llama_model_moeplug_replay_reset(const struct llama_model * model);
