#pragma once

// Expert slot cache (moeplug), the common side: the model fingerprint that ties a moe profile
// to one model, and the start-up call that reads a profile, picks each layer's hottest experts
// and asks libllama to keep them resident (llama_model_moeplug_cache_init).

#include "moeplug-params.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

// the profile format this build reads and writes (native/PROFILE-FORMAT.md)
#define COMMON_MOEPLUG_PROFILE_VERSION 1u

struct common_arg;
struct common_params;
struct gguf_context;
struct llama_model;

// what a moe profile records of the model it was made with (native/PROFILE-FORMAT.md)
struct common_moeplug_fingerprint {
    std::string              arch;
    uint32_t                 n_layer       = 0;
    uint32_t                 n_expert      = 0;
    uint32_t                 n_expert_used = 0;
    uint32_t                 n_nextn       = 0;  // MTP (NextN) blocks, counted in n_layer
    uint64_t                 size          = 0;  // bytes of every file of the model
    std::string              meta_hash;          // FNV-1a 64 of the first file's bytes before its tensor data
    std::vector<std::string> expert_tensors;     // every routed-expert tensor, in file order
    std::vector<int64_t>     expert_shapes;      // 4 ne per tensor
    std::vector<int32_t>     expert_types;       // ggml_type per tensor
    std::vector<std::string> files;              // the model's files, first shard first (not part of the match)
};

// reads the fingerprint of the model whose (first) file is path; throws std::runtime_error
common_moeplug_fingerprint common_moeplug_fingerprint_of(const std::string & path);

// writes the fingerprint keys (moe_profile.model.*) into a profile
void common_moeplug_fingerprint_write(gguf_context * profile, const common_moeplug_fingerprint & fp);

// gguf_set_arr_str for a vector of strings
void common_moeplug_set_arr_str(gguf_context * g, const char * key, const std::vector<std::string> & v);

// "" when the profile's fingerprint is fp, else which key differs
std::string common_moeplug_fingerprint_diff(const gguf_context * profile, const common_moeplug_fingerprint & fp);

// the slots each profiled layer asks for: "N" (every layer) or "N0,N1,..." (one per layer of the
// profile, in its order; 0 leaves a layer out); "auto" gives an empty list (resolved by
// common_moeplug_cache_resolve); throws std::invalid_argument
std::vector<int32_t> common_moeplug_parse_slots(const std::string & spec);

// reads the profile, checks it against the model's fingerprint and picks the slots of each layer:
// the experts with the most decode selections (then prefill, then the lower id); n_slots holds one
// count for every layer or one per layer (common_moeplug_parse_slots); throws std::runtime_error
struct common_moeplug_cache_choice {
    std::string          tensor;  // the layer's expert down weight
    std::vector<int32_t> experts; // hottest first
    std::vector<float>   rates;   // selections per token of every expert (decode, or prefill without decode)
};
std::vector<common_moeplug_cache_choice> common_moeplug_cache_choose(
        const std::string & profile_path, const common_moeplug_fingerprint & model, const std::vector<int32_t> & n_slots);

// sets up the cache with the hottest experts of each layer from the profile (slots: as
// common_moeplug_parse_slots reads it); logs one line:
//   moe-cache: L layers x N slots, X MiB uploaded to DEV in T s       (DEV: "CUDA0", "CUDA0, CUDA1", ...)
//   moe-cache: L layers x N0-N1 slots (S in all, F whole layers), X MiB uploaded to DEV in T s
// (the part in parentheses when layers differ or some hold every expert, N0- when they differ)
// or, when it cannot engage (the model then runs without it):
//   moe-cache: not engaged, running without it: REASON
// followed by ", policy static" or ", policy dynamic (half-life H tokens, U uploads per batch)";
// returns whether it engaged. policy: "static" or "dynamic" (--moe-cache-policy); half_life and
// uploads: the dynamic policy's (<= 0: the defaults); stream: of each layer's misses, the share the device
// computes from host memory (--moe-cache-stream), named in the line where it engages on some layer;
// offload_min_batch: the prompt batches of the layers whose device copies their experts go to it from this
// many tokens (--moe-cache-offload-min-batch; 0: the device's threshold), named in the line with those layers:
// ", prompt batches in one pass on L layers from N tokens"
bool common_moeplug_cache_enable(llama_model * model, const std::string & model_path, const std::string & profile_path,
        const std::string & slots, int32_t max_batch, int32_t margin_mib, bool count = false,
        const std::string & policy = "static", float half_life = 0.0f, int32_t uploads = 0, float stream = 0.0f,
        int32_t offload_min_batch = 0, bool copy_ahead = true, bool slots_on_cpu = false);

// common_moeplug_cache_enable from params.moeplug (common/moeplug-params.h), when a profile is given (through
// common_moeplug_cache_resolve) or a plan file (--moe-cache-plan, or the one beside the profile), its settings
// taken where no flag gave them; counts slot hits when the server's metrics endpoint is on. Logs the settings
// it took, in the plan file's keys (common_moeplug_settings):
//   moe-settings: placement=moeplug slots=8 max-batch=31 ... device=auto plan=FILE|none
// and, where the plan places the model as stock does (placement = stock), runs it without the cache. Then,
// with --moe-cache-record, starts recording and logs
//   moe-cache: recording the router's selections of L layers
bool common_moeplug_cache_init(llama_model * model, const common_params & params);

// what --moe-cache-record counted so far, as a moe profile (native/PROFILE-FORMAT.md: the model's
// fingerprint, counts.prefill and counts.decode, one source "live" without sequences): the file's
// bytes, or "" with err set (not recording, or the profile cannot be written); reset: zero the counts
std::string common_moeplug_record_profile(const llama_model * model, const std::string & model_path, bool reset,
        std::string & err);

// what --moe-cache-profile FILE|DIR and --moe-cache-slots N|N0,N1,...|auto come to for one model
// (native/SLOTS-FORMAT.md): the profile file, the slots spec, and where the spec came from; or,
// when the cache cannot apply, only the reason (the model then runs without it)
// a plan file (native/SLOTS-FORMAT.md, "the slots file"): what it sets, checked
struct common_moeplug_plan_file {
    std::string path;
    std::map<std::string, std::string> kv;       // every key
    std::map<std::string, std::string> settings; // the settings' keys (slots, max-batch, ..., device), values checked
    std::string profile;                         // its profile key, relative to the file's folder resolved ("" none)
    bool        stock = false;                   // placement = stock: the model runs without the cache
};

struct common_moeplug_cache_source {
    std::string profile; // the profile file
    std::string slots;   // a spec common_moeplug_parse_slots reads ("auto" resolved; "" where the plan is stock's)
    std::string origin;  // "" (as given), the slots file's path, or how auto chose
    std::string reason;  // set: not engaged, why
    common_moeplug_plan_file plan; // the slots file read (path "": none)
};

// A DIR holds profiles (moeplug names them <arch>-<meta_hash>.gguf) and, beside each, its slots
// file <name>.slots; the one profile whose fingerprint is the model's is taken (none, or more than
// one: a reason). Slots "auto", or none with a DIR: the slots file beside the profile, else
// common_moeplug_auto_slots.
common_moeplug_cache_source common_moeplug_cache_resolve(const std::string & model_path, const std::string & profile,
        const std::string & slots, int32_t margin_mib, bool slots_on_cpu = false);

// the slots file beside a profile: P.gguf -> P.slots
std::string common_moeplug_slots_path(const std::string & profile_path);

// reads a slots file (native/SLOTS-FORMAT.md, versions 1 and 2) planned for the model fp, every setting's value
// checked; throws std::runtime_error naming the file and the key
common_moeplug_plan_file common_moeplug_read_plan_file(const std::string & path, const common_moeplug_fingerprint & fp);

// one setting by its plan-file key (the flag's name without "--moe-cache-": slots, max-batch, margin, policy,
// half-life, uploads, stream, offload-min-batch, copy-ahead, device), as the flag takes it; throws
// std::invalid_argument on a value the flag refuses. The flags and the plan files go through here
void common_moeplug_set(common_moeplug_params & mp, const std::string & key, const std::string & value);

// the plan file's settings into mp, each where its flag was not given (mp.given; slots given as auto yield too),
// and its profile where none was given
void common_moeplug_apply_plan(common_moeplug_params & mp, const common_moeplug_plan_file & plan);

// the settings as the engine takes them, in the plan file's keys: "placement=moeplug slots=... plan=FILE"
std::string common_moeplug_settings(const common_moeplug_params & mp, bool stock, const std::string & plan);

// --moe-cache-slots auto without a slots file: one count for every profiled layer, the device
// memory free now (after the model loaded) less the margin, divided by the bytes of one slot in
// every profiled layer, at most the layer's experts; summed over the GPUs. With the slots on the
// CPU (--moe-cache-device CPU, or LLAMA_MOE_CACHE_DEVICE=CPU): a quarter of the experts (at least 1), as moeplug's demo
// plans, within the host memory free less the margin. Sets how it chose in origin; throws
// std::runtime_error when no slot fits or there is no device to hold one.
std::string common_moeplug_auto_slots(const std::string & profile_path, const common_moeplug_fingerprint & fp,
        int32_t margin_mib, bool slots_on_cpu, std::string & origin);

// the cache's counters in the Prometheus text format of llama-server's /metrics, after the settings the model took
// as an info gauge, llamacpp:moe_cache_settings{placement="moeplug",slots="8",...,plan="FILE"} 1 (the keys of the
// settings line, '-' as '_'; placement="stock" where the plan runs the model without the cache); "" where neither is
std::string common_moeplug_cache_metrics(const llama_model * model);

// llama-server's GET /moe-cache/profile (?reset=1): the recording as a profile file's bytes
// (common_moeplug_record_profile); or "" with err set, not_found telling a server that does not record,
// or has no model loaded, from a profile that cannot be written
std::string common_moeplug_profile_answer(const common_params & params, const llama_model * model, const std::string & reset,
        std::string & err, bool & not_found);

// route replay (src/llama-moeplug-replay.h): loads the replay file into the model and logs
//   moe-replay: FILE, P prompts, T tokens, L layers x K of E[, with weights]
// or, refusing a file that cannot be read or does not match the model (a benchmark switch must
// never fall back silently):
//   moe-replay: REASON
// returns false when the file was refused
bool common_moeplug_replay_load(llama_model * model, const std::string & path);

// common_moeplug_replay_load of params.moeplug.route_replay, when given (true when not)
bool common_moeplug_replay_init(llama_model * model, const common_params & params);

// forgets which prompt each sequence replays (after the warm-up run)
void common_moeplug_replay_reset(const llama_model * model);

// moeplug's flags (--moe-cache-*, --moe-route-replay; each also read from its LLAMA_ARG_* variable), added to
// common's parser where common_params_parser_init calls this; they set params.moeplug
void common_moeplug_add_args(const common_params & params, const std::function<void(common_arg)> & add_opt);

// llama-bench's side (it parses its own flags): the usage lines of moeplug's flags; whether argv[i] is one
// of them (consumed with its value into mp, i advanced; invalid set on a missing or bad value); and, once a
// model is loaded, the cache (a profile given) and route replay (a file given): false when the replay file
// is refused (the benchmark stops)
void common_moeplug_bench_usage();
bool common_moeplug_bench_arg(const std::string & arg, int argc, char ** argv, int & i, common_moeplug_params & mp, bool & invalid);
bool common_moeplug_bench_load(llama_model * model, const std::string & model_path, const common_moeplug_params & mp);
