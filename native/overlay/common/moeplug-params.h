#pragma once

// moeplug's settings for one model (common_params::moeplug): what the --moe-cache-* and --moe-route-replay
// flags set (common_moeplug_add_args, common/moeplug-cache.cpp), read when the model loads
// (common_moeplug_cache_init, common_moeplug_replay_init) and handed to libllama as llama_moeplug_cache_params.
// The one place the engine's settings come from; the environment variables the engine also reads are
// debugging overrides (native/README.md, "Environment switches"; native/DESIGN.md, "Settings").

#include <cstdint>
#include <set>
#include <string>

struct common_moeplug_params {
    std::string cache_profile;                // moe profile of the model, or a folder of profiles
    std::string cache_slots;                  // resident experts per MoE layer: "N", "N0,N1,..." or "auto"
    int32_t     cache_max_batch    = 31;      // larger batches run the stock graph
    int32_t     cache_margin_mib   = 1024;    // device memory to leave free
    std::string cache_policy       = "static"; // "static" or "dynamic": slots follow the prompt
    float       cache_half_life    = 128.0f;  // dynamic: tokens over which a use count halves
    int32_t     cache_uploads      = 4;       // dynamic: slot uploads started after a batch
    float       cache_stream       = 0.0f;    // of each layer's misses, the share the device computes from host memory
    int32_t     cache_offload_min_batch = 0;  // prompt batches of the copied layers go to the device from N (0: ggml's)
    bool        cache_copy_ahead   = true;    // a prompt batch's expert copies go ahead on a second queue where the device can
    std::string cache_device;                 // "CPU": the slots in RAM with the source's buffer type; "": each layer's device
    std::string cache_plan;                   // the model's plan file (native/SLOTS-FORMAT.md): the settings not given as flags
    std::set<std::string> given;              // the settings given as flags or LLAMA_ARG_* (their plan-file keys): a plan file's yield to them
    bool        cache_record       = false;   // count the router's selections (llama-server: /moe-cache/profile)
    std::string route_replay;                 // recorded router decisions that replace the router's
};
