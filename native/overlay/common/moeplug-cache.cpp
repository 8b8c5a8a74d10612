#include "moeplug-cache.h"

#include "arg.h"

#include "../src/llama-moeplug-ext.h"  // llama_model_moeplug_cache_init (staging API)

#include "common.h"
#include "gguf.h"
#include "ggml-cpp.h"
#include "log.h"
#include "llama.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <iterator>
#include <sys/stat.h>
#include <unistd.h>

// FNV-1a 64 of the first n_bytes of path, as 16 hex digits
static std::string moe_meta_hash(const std::string & path, size_t n_bytes) {
    std::ifstream f(path, std::ios::binary);
    std::vector<char> data(n_bytes);
    if (!f.read(data.data(), (std::streamsize) n_bytes)) {
        throw std::runtime_error("cannot read " + path);
    }
    uint64_t h = 0xcbf29ce484222325ULL;
    for (char c : data) {
        h ^= (uint8_t) c;
        h *= 0x100000001b3ULL;
    }
    char hex[17];
    snprintf(hex, sizeof(hex), "%016llx", (unsigned long long) h);
    return hex;
}

static uint32_t moe_get_u32(const gguf_context * g, const std::string & key) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) {
        return 0;
    }
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32:  return (uint32_t) gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, id);
        case GGUF_TYPE_ARRAY: {
            // per-layer values: the largest
            uint32_t best = 0;
            if (gguf_get_arr_type(g, id) == GGUF_TYPE_UINT32 || gguf_get_arr_type(g, id) == GGUF_TYPE_INT32) {
                const auto * v = (const uint32_t *) gguf_get_arr_data(g, id);
                for (size_t i = 0; i < gguf_get_arr_n(g, id); ++i) {
                    best = std::max(best, v[i]);
                }
            }
            return best;
        }
        default: return 0;
    }
}

static bool moe_is_expert_tensor(const std::string & name) {
    return name.rfind("blk.", 0) == 0 &&
           (name.find("_exps.") != std::string::npos || name.find("_chexps.") != std::string::npos);
}

common_moeplug_fingerprint common_moeplug_fingerprint_of(const std::string & path) {
    common_moeplug_fingerprint fp;

    gguf_init_params ip = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context_ptr gp { gguf_init_from_file(path.c_str(), ip) };
    if (!gp) {
        throw std::runtime_error("cannot read the GGUF header of " + path);
    }
    const gguf_context * g = gp.get();
    const int64_t arch_id = gguf_find_key(g, "general.architecture");
    fp.arch          = arch_id < 0 ? "" : gguf_get_val_str(g, arch_id);
    fp.n_layer       = moe_get_u32(g, fp.arch + ".block_count");
    fp.n_expert      = moe_get_u32(g, fp.arch + ".expert_count");
    fp.n_expert_used = moe_get_u32(g, fp.arch + ".expert_used_count");
    fp.n_nextn       = moe_get_u32(g, fp.arch + ".nextn_predict_layers");
    fp.meta_hash     = moe_meta_hash(path, gguf_get_data_offset(g));

    const uint32_t n_split = moe_get_u32(g, "split.count");
    gp.reset();

    std::vector<std::string> paths = { path };
    if (n_split > 1) {
        char prefix[4096];
        if (llama_split_prefix(prefix, sizeof(prefix), path.c_str(), 0, n_split) == 0) {
            throw std::runtime_error("split model: name the first shard, not " + path);
        }
        for (uint32_t i = 1; i < n_split; ++i) {
            char split[4096];
            llama_split_path(split, sizeof(split), prefix, i, n_split);
            paths.push_back(split);
        }
    }

    fp.files = paths;
    for (const auto & p : paths) {
        struct stat st;
        if (stat(p.c_str(), &st) == 0) {
            fp.size += (uint64_t) st.st_size;
        }
        ggml_context * ctx_raw = nullptr;
        gguf_init_params sp = { /*.no_alloc =*/ true, /*.ctx =*/ &ctx_raw };
        gguf_context_ptr gs_ptr { gguf_init_from_file(p.c_str(), sp) };
        ggml_context_ptr ctx { ctx_raw };
        if (!gs_ptr) {
            throw std::runtime_error("cannot read the GGUF header of " + p);
        }
        const gguf_context * gs = gs_ptr.get();
        for (int64_t i = 0; i < gguf_get_n_tensors(gs); ++i) {
            const std::string name = gguf_get_tensor_name(gs, i);
            if (!moe_is_expert_tensor(name)) {
                continue;
            }
            const ggml_tensor * t = ggml_get_tensor(ctx.get(), name.c_str());
            fp.expert_tensors.push_back(name);
            for (int d = 0; d < 4; ++d) {
                fp.expert_shapes.push_back(t->ne[d]);
            }
            fp.expert_types.push_back((int32_t) gguf_get_tensor_type(gs, i));
        }
    }
    return fp;
}

void common_moeplug_set_arr_str(gguf_context * g, const char * key, const std::vector<std::string> & v) {
    std::vector<const char *> ptrs;
    for (const auto & s : v) {
        ptrs.push_back(s.c_str());
    }
    gguf_set_arr_str(g, key, ptrs.data(), ptrs.size());
}

void common_moeplug_fingerprint_write(gguf_context * g, const common_moeplug_fingerprint & fp) {
    gguf_set_val_str(g, "moe_profile.model.arch", fp.arch.c_str());
    gguf_set_val_u32(g, "moe_profile.model.n_layer", fp.n_layer);
    gguf_set_val_u32(g, "moe_profile.model.n_expert", fp.n_expert);
    gguf_set_val_u32(g, "moe_profile.model.n_expert_used", fp.n_expert_used);
    gguf_set_val_u64(g, "moe_profile.model.size", fp.size);
    gguf_set_val_str(g, "moe_profile.model.meta_hash", fp.meta_hash.c_str());
    common_moeplug_set_arr_str(g, "moe_profile.model.expert_tensors", fp.expert_tensors);
    gguf_set_arr_data(g, "moe_profile.model.expert_shapes", GGUF_TYPE_INT64, fp.expert_shapes.data(), fp.expert_shapes.size());
    gguf_set_arr_data(g, "moe_profile.model.expert_types", GGUF_TYPE_INT32, fp.expert_types.data(), fp.expert_types.size());
}

static std::vector<std::string> moe_get_arr_str(const gguf_context * g, const char * key) {
    std::vector<std::string> res;
    const int64_t id = gguf_find_key(g, key);
    if (id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_ARRAY && gguf_get_arr_type(g, id) == GGUF_TYPE_STRING) {
        for (size_t i = 0; i < gguf_get_arr_n(g, id); ++i) {
            res.push_back(gguf_get_arr_str(g, id, i));
        }
    }
    return res;
}

template <typename T>
static std::vector<T> moe_get_arr(const gguf_context * g, const char * key, gguf_type type) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != type) {
        return {};
    }
    const T * data = (const T *) gguf_get_arr_data(g, id);
    return std::vector<T>(data, data + gguf_get_arr_n(g, id));
}

static std::string moe_get_str(const gguf_context * g, const char * key) {
    const int64_t id = gguf_find_key(g, key);
    return id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_STRING ? gguf_get_val_str(g, id) : "";
}

static uint64_t moe_get_u64(const gguf_context * g, const char * key) {
    const int64_t id = gguf_find_key(g, key);
    return id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_UINT64 ? gguf_get_val_u64(g, id) : 0;
}

// a profile must hold every key the cache reads, with the type PROFILE-FORMAT.md gives it: a
// missing or mistyped key is named, never read as 0 or ""
static void moe_profile_check_keys(const gguf_context * g, const std::string & path) {
    struct key_type { const char * key; gguf_type type; gguf_type arr_type; };
    static const key_type keys[] = {
        { "moe_profile.version",               GGUF_TYPE_UINT32, GGUF_TYPE_COUNT  },
        { "moe_profile.model.arch",            GGUF_TYPE_STRING, GGUF_TYPE_COUNT  },
        { "moe_profile.model.n_layer",         GGUF_TYPE_UINT32, GGUF_TYPE_COUNT  },
        { "moe_profile.model.n_expert",        GGUF_TYPE_UINT32, GGUF_TYPE_COUNT  },
        { "moe_profile.model.n_expert_used",   GGUF_TYPE_UINT32, GGUF_TYPE_COUNT  },
        { "moe_profile.model.size",            GGUF_TYPE_UINT64, GGUF_TYPE_COUNT  },
        { "moe_profile.model.meta_hash",       GGUF_TYPE_STRING, GGUF_TYPE_COUNT  },
        { "moe_profile.model.expert_tensors",  GGUF_TYPE_ARRAY,  GGUF_TYPE_STRING },
        { "moe_profile.model.expert_shapes",   GGUF_TYPE_ARRAY,  GGUF_TYPE_INT64  },
        { "moe_profile.model.expert_types",    GGUF_TYPE_ARRAY,  GGUF_TYPE_INT32  },
        { "moe_profile.tensors",               GGUF_TYPE_ARRAY,  GGUF_TYPE_STRING },
    };
    for (const auto & k : keys) {
        const int64_t id = gguf_find_key(g, k.key);
        if (id < 0) {
            throw std::runtime_error(path + " has no key " + k.key);
        }
        const gguf_type type = gguf_get_kv_type(g, id);
        if (type != k.type || (type == GGUF_TYPE_ARRAY && gguf_get_arr_type(g, id) != k.arr_type)) {
            throw std::runtime_error(string_format("%s: key %s is %s%s%s, expected %s%s%s", path.c_str(), k.key,
                gguf_type_name(type), type == GGUF_TYPE_ARRAY ? " of " : "",
                type == GGUF_TYPE_ARRAY ? gguf_type_name(gguf_get_arr_type(g, id)) : "",
                gguf_type_name(k.type), k.type == GGUF_TYPE_ARRAY ? " of " : "",
                k.type == GGUF_TYPE_ARRAY ? gguf_type_name(k.arr_type) : ""));
        }
    }
}

std::string common_moeplug_fingerprint_diff(const gguf_context * g, const common_moeplug_fingerprint & fp) {
    std::vector<std::string> diff;
    auto check = [&](bool same, const char * key) {
        if (!same) {
            diff.push_back(key);
        }
    };
    check(moe_get_str(g, "moe_profile.model.arch") == fp.arch, "arch");
    check(moe_get_u32(g, "moe_profile.model.n_layer") == fp.n_layer, "n_layer");
    check(moe_get_u32(g, "moe_profile.model.n_expert") == fp.n_expert, "n_expert");
    check(moe_get_u32(g, "moe_profile.model.n_expert_used") == fp.n_expert_used, "n_expert_used");
    check(moe_get_u64(g, "moe_profile.model.size") == fp.size, "size");
    check(moe_get_str(g, "moe_profile.model.meta_hash") == fp.meta_hash, "meta_hash");
    check(moe_get_arr_str(g, "moe_profile.model.expert_tensors") == fp.expert_tensors, "expert_tensors");
    check(moe_get_arr<int64_t>(g, "moe_profile.model.expert_shapes", GGUF_TYPE_INT64) == fp.expert_shapes, "expert_shapes");
    check(moe_get_arr<int32_t>(g, "moe_profile.model.expert_types", GGUF_TYPE_INT32) == fp.expert_types, "expert_types");

    std::string res;
    for (const auto & key : diff) {
        res += (res.empty() ? "" : ", ") + key;
    }
    return res;
}

std::vector<int32_t> common_moeplug_parse_slots(const std::string & spec) {
    std::vector<int32_t> res;
    if (spec == "auto") {
        return res; // common_moeplug_cache_resolve decides
    }
    for (const std::string & item : string_split<std::string>(spec, ',')) {
        size_t end = 0;
        int value = -1;
        try {
            value = std::stoi(item, &end);
        } catch (const std::exception &) {
            end = 0;
        }
        if (item.empty() || end != item.size() || value < 0) {
            throw std::invalid_argument("--moe-cache-slots " + spec + ": give N or one N per layer, comma-separated");
        }
        res.push_back(value);
    }
    return res;
}

std::vector<common_moeplug_cache_choice> common_moeplug_cache_choose(
        const std::string & profile_path, const common_moeplug_fingerprint & model, const std::vector<int32_t> & n_slots) {
    ggml_context * ctx_raw = nullptr;
    gguf_init_params ip = { /*.no_alloc =*/ false, /*.ctx =*/ &ctx_raw };
    gguf_context_ptr gp { gguf_init_from_file(profile_path.c_str(), ip) };
    ggml_context_ptr ctx_ptr { ctx_raw };
    if (!gp) {
        throw std::runtime_error("cannot read the profile " + profile_path + " (missing, truncated or not GGUF)");
    }
    const gguf_context * g = gp.get();
    ggml_context * ctx = ctx_ptr.get();

    if (moe_get_str(g, "general.type") != "moe-profile") {
        throw std::runtime_error(profile_path + " is not a moe profile");
    }
    moe_profile_check_keys(g, profile_path);
    const uint32_t version = moe_get_u32(g, "moe_profile.version");
    if (version != COMMON_MOEPLUG_PROFILE_VERSION) {
        throw std::runtime_error(string_format("%s is a version %u moe profile; this build reads version %u",
            profile_path.c_str(), version, COMMON_MOEPLUG_PROFILE_VERSION));
    }
    const std::string diff = common_moeplug_fingerprint_diff(g, model);
    if (!diff.empty()) {
        throw std::runtime_error("the profile " + profile_path + " is of another model (" + diff + " differ)");
    }

    const std::vector<std::string> tensors = moe_get_arr_str(g, "moe_profile.tensors");
    const uint64_t n_tok_decode  = moe_get_u64(g, "moe_profile.tokens.decode");
    const uint64_t n_tok_prefill = moe_get_u64(g, "moe_profile.tokens.prefill");
    const ggml_tensor * decode  = ggml_get_tensor(ctx, "counts.decode");
    const ggml_tensor * prefill = ggml_get_tensor(ctx, "counts.prefill");
    if (decode == nullptr || prefill == nullptr || decode->type != GGML_TYPE_I32 || prefill->type != GGML_TYPE_I32 ||
        decode->ne[1] != (int64_t) tensors.size() || !ggml_are_same_shape(decode, prefill) || tensors.empty()) {
        throw std::runtime_error("the profile " + profile_path + " has no usable expert counts");
    }
    const int64_t n_expert = decode->ne[0];
    if (n_slots.size() != 1 && n_slots.size() != tensors.size()) {
        throw std::runtime_error(string_format("--moe-cache-slots: %zu counts given, the profile has %zu layers (give one, or one per layer)",
            n_slots.size(), tensors.size()));
    }
    if (n_slots.size() == 1 && n_slots[0] < 1) {
        throw std::runtime_error(string_format("--moe-cache-slots %d: give at least 1 slot per layer", n_slots[0]));
    }
    for (int32_t n : n_slots) {
        if (n > n_expert) {
            throw std::runtime_error(string_format("--moe-cache-slots %d: the model has %lld experts per layer", n, (long long) n_expert));
        }
    }

    std::vector<common_moeplug_cache_choice> res;
    for (size_t it = 0; it < tensors.size(); ++it) {
        const int32_t * nd = (const int32_t *) decode->data  + it*n_expert;
        const int32_t * np = (const int32_t *) prefill->data + it*n_expert;
        std::vector<int32_t> order(n_expert);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            return nd[a] != nd[b] ? nd[a] > nd[b] : np[a] > np[b];
        });
        const int32_t n = n_slots.size() == 1 ? n_slots[0] : n_slots[it];
        if (n == 0) {
            continue; // left out
        }
        order.resize(n);
        std::vector<float> rates(n_expert, 0.0f);
        for (int64_t e = 0; e < n_expert; ++e) {
            rates[e] = n_tok_decode > 0  ? (float) nd[e] / (float) n_tok_decode :
                       n_tok_prefill > 0 ? (float) np[e] / (float) n_tok_prefill : 0.0f;
        }
        res.push_back({ tensors[it], order, rates });
    }
    return res;
}

bool common_moeplug_cache_enable(llama_model * model, const std::string & model_path, const std::string & profile_path,
        const std::string & slots, int32_t max_batch, int32_t margin_mib, bool count,
        const std::string & policy, float half_life, int32_t uploads, float stream, int32_t offload_min_batch,
        bool copy_ahead, bool slots_on_cpu) {
    llama_moeplug_cache_result result = {};
    const bool dynamic = policy == "dynamic";
    try {
        const common_moeplug_fingerprint fp = common_moeplug_fingerprint_of(model_path);
        const auto choice = common_moeplug_cache_choose(profile_path, fp, common_moeplug_parse_slots(slots));
        if (choice.empty()) {
            throw std::runtime_error("--moe-cache-slots " + slots + " gives no layer a slot");
        }
        std::vector<const char *> files;
        for (const auto & f : fp.files) {
            files.push_back(f.c_str());
        }

        std::vector<llama_moeplug_cache_layer_experts> layers;
        for (const auto & c : choice) {
            layers.push_back({ c.tensor.c_str(), c.experts.data(), (int32_t) c.experts.size(), c.rates.data(), (int32_t) c.rates.size() });
        }
        llama_moeplug_cache_params mp = {};
        mp.model_files   = files.data();
        mp.n_model_files = files.size();
        mp.layers     = layers.data();
        mp.n_layers   = layers.size();
        mp.max_batch  = max_batch;
        mp.margin     = (size_t) std::max(margin_mib, 0) * 1024 * 1024;
        mp.count      = count;
        mp.policy     = dynamic ? LLAMA_MOEPLUG_CACHE_POLICY_DYNAMIC : LLAMA_MOEPLUG_CACHE_POLICY_STATIC;
        mp.half_life  = half_life;
        mp.max_uploads = uploads;
        mp.stream_share = stream;
        mp.offload_min_batch = offload_min_batch;
        mp.no_copy_ahead = !copy_ahead;
        mp.slots_on_cpu  = slots_on_cpu;
        if (!llama_model_moeplug_cache_init(model, &mp, &result)) {
            throw std::runtime_error(result.reason);
        }
    } catch (const std::exception & err) {
        LOG_WRN("moe-cache: not engaged, running without it: %s\n", err.what());
        return false;
    }

    std::string slots_desc = std::to_string(result.n_slots) + " slots";
    if (result.n_slots_min != result.n_slots) {
        slots_desc = std::to_string(result.n_slots_min) + "-" + slots_desc;
    }
    if (result.n_slots_min != result.n_slots || result.n_layers_full > 0) {
        slots_desc += string_format(" (%lld in all, %d whole layers)", (long long) result.n_slots_total, result.n_layers_full);
    }
    const std::string policy_desc = !dynamic ? "policy static" : string_format("policy dynamic (half-life %.0f tokens, %d uploads per batch)",
        (double) (half_life > 0.0f ? half_life : 128.0f), uploads > 0 ? uploads : 4);
    // prompt batches of the partly resident layers: one pass, the device copying their experts from the slots
    const std::string prompt_desc = result.n_layers_copied == 0 ? "" :
        string_format(", prompt batches in one pass on %d layers from %d tokens", result.n_layers_copied, result.offload_min_batch);
    // misses of some layers computed by the device from host memory, beside the CPU
    const std::string stream_desc = result.n_layers_streamed == 0 ? "" :
        string_format(", %d layers stream %.0f%% of their misses", result.n_layers_streamed, 100.0 * result.stream_share);
    // misses of the other partly resident layers computed by the CPU while the device computes their slots
    const std::string overlap_desc = result.n_layers_overlapped == 0 ? "" :
        string_format(", %d layers compute slots and misses at once", result.n_layers_overlapped);
    // misses of the partly resident layers computed by the device, read from host memory in place
    const std::string direct_desc = result.n_layers_direct == 0 ? "" :
        string_format(", %d layers read their misses in place", result.n_layers_direct);
    LOG_INF("moe-cache: %d layers x %s, %.2f MiB uploaded to %s in %.2f s, %s%s%s%s%s\n",
        result.n_layers, slots_desc.c_str(), result.n_bytes / (1024.0 * 1024.0), result.device, result.t_upload_s,
        policy_desc.c_str(), prompt_desc.c_str(), stream_desc.c_str(), overlap_desc.c_str(), direct_desc.c_str());
    return true;
}

// the settings as the engine takes them, in the plan file's keys, in one order for the log line and /metrics
static std::vector<std::pair<std::string, std::string>> moe_settings_pairs(const common_moeplug_params & mp, bool stock,
        const std::string & plan) {
    return {
        { "placement",         stock ? "stock" : "moeplug" },
        { "slots",             stock || mp.cache_slots.empty() ? "none" : mp.cache_slots },
        { "max-batch",         std::to_string(mp.cache_max_batch) },
        { "margin",            std::to_string(mp.cache_margin_mib) },
        { "policy",            mp.cache_policy },
        { "half-life",         string_format("%g", (double) mp.cache_half_life) },
        { "uploads",           std::to_string(mp.cache_uploads) },
        { "stream",            string_format("%g", (double) mp.cache_stream) },
        { "offload-min-batch", std::to_string(mp.cache_offload_min_batch) },
        { "copy-ahead",        mp.cache_copy_ahead ? "on" : "off" },
        { "device",            mp.cache_device.empty() ? "auto" : mp.cache_device },
        { "plan",              plan.empty() ? "none" : plan },
    };
}

// the settings each loaded model took (moe_cache_start), for /metrics; a model is never looked through
static std::mutex moe_settings_mutex;
static std::map<const llama_model *, std::vector<std::pair<std::string, std::string>>> moe_settings_of;

static void moe_settings_keep(const llama_model * model, std::vector<std::pair<std::string, std::string>> pairs) {
    std::lock_guard<std::mutex> lock(moe_settings_mutex);
    moe_settings_of[model] = std::move(pairs);
}

// llamacpp:moe_cache_settings{placement="moeplug",slots="8",...,plan="FILE"} 1: the settings line as an info gauge
static std::string moe_settings_metric(const llama_model * model) {
    std::lock_guard<std::mutex> lock(moe_settings_mutex);
    const auto it = moe_settings_of.find(model);
    if (it == moe_settings_of.end()) {
        return "";
    }
    std::string labels;
    for (const auto & [key, value] : it->second) {
        std::string name = key, escaped;
        std::replace(name.begin(), name.end(), '-', '_');
        for (const char c : value) {
            escaped += c == '\\' ? "\\\\" : c == '"' ? "\\\"" : c == '\n' ? "\\n" : std::string(1, c);
        }
        labels += (labels.empty() ? "" : ",") + name + "=\"" + escaped + "\"";
    }
    return "# HELP llamacpp:moe_cache_settings The expert cache's settings as the model took them (labels; placement=stock: no cache).\n"
           "# TYPE llamacpp:moe_cache_settings gauge\n"
           "llamacpp:moe_cache_settings{" + labels + "} 1\n";
}

// the cache as the settings ask (a plan file's taken where no flag gave them), the settings line logged
static bool moe_cache_start(llama_model * model, const std::string & model_path, common_moeplug_params mp, bool count) {
    std::string plan_path;
    bool stock = false;
    try {
        if (!mp.cache_plan.empty()) {
            const common_moeplug_plan_file plan = common_moeplug_read_plan_file(mp.cache_plan, common_moeplug_fingerprint_of(model_path));
            common_moeplug_apply_plan(mp, plan);
            plan_path = plan.path;
            stock     = plan.stock;
        }
    } catch (const std::exception & err) {
        LOG_WRN("moe-cache: not engaged, running without it: %s\n", err.what());
        return false;
    }
    if (mp.cache_profile.empty() && !stock) {
        if (!mp.cache_slots.empty()) {
            LOG_WRN("moe-cache: not engaged, running without it: --moe-cache-slots needs --moe-cache-profile\n");
        }
        return false;
    }
    const bool on_cpu = mp.cache_device == "CPU";
    common_moeplug_cache_source src;
    if (!stock) {
        src = common_moeplug_cache_resolve(model_path, mp.cache_profile, mp.cache_slots, mp.cache_margin_mib, on_cpu);
        if (!src.reason.empty()) {
            LOG_WRN("moe-cache: not engaged, running without it: %s\n", src.reason.c_str());
            return false;
        }
        if (!src.plan.path.empty()) { // the plan file beside the profile
            common_moeplug_apply_plan(mp, src.plan);
            plan_path = src.plan.path;
            stock     = src.plan.stock;
        }
        mp.cache_slots = src.slots;
    }
    LOG_INF("moe-settings: %s\n", common_moeplug_settings(mp, stock, plan_path).c_str());
    moe_settings_keep(model, moe_settings_pairs(mp, stock, plan_path));
    if (stock) {
        LOG_INF("moe-cache: not engaged: the plan %s places this model as stock llama.cpp does\n", plan_path.c_str());
        return false;
    }
    return common_moeplug_cache_enable(model, model_path, src.profile, src.slots, mp.cache_max_batch, mp.cache_margin_mib,
        count, mp.cache_policy, mp.cache_half_life, mp.cache_uploads, mp.cache_stream, mp.cache_offload_min_batch,
        mp.cache_copy_ahead, mp.cache_device == "CPU");
}

bool common_moeplug_cache_init(llama_model * model, const common_params & params) {
    const bool engaged = moe_cache_start(model, params.model.path, params.moeplug, params.endpoint_metrics);
    if (params.moeplug.cache_record) {
        if (llama_model_moeplug_record_init(model)) {
            LOG_INF("moe-cache: recording the router's selections of %zu layers\n",
                llama_model_moeplug_record_read(model, nullptr, nullptr, 0, 0, nullptr, false));
        } else {
            LOG_WRN("moe-cache: not recording: the model has no routed-expert layers\n");
        }
    }
    return engaged;
}

std::string common_moeplug_record_profile(const llama_model * model, const std::string & model_path, bool reset,
        std::string & err) {
    const size_t n_layers = llama_model_moeplug_record_read(model, nullptr, nullptr, 0, 0, nullptr, false);
    if (n_layers == 0) {
        err = "not recording (start the server with --moe-cache-record)";
        return "";
    }
    common_moeplug_fingerprint fp;
    try {
        fp = common_moeplug_fingerprint_of(model_path);
    } catch (const std::exception & e) {
        err = e.what();
        return "";
    }
    const int32_t n_expert = (int32_t) fp.n_expert;
    std::vector<llama_moeplug_record_layer> layers(n_layers);
    std::vector<uint64_t> counts(2*n_layers*(size_t) n_expert);
    uint64_t n_tokens[2] = { 0, 0 };
    llama_model_moeplug_record_read(model, layers.data(), counts.data(), n_expert, n_layers, n_tokens, reset);

    ggml_init_params cp = { /*.mem_size =*/ 2*n_layers*n_expert*sizeof(int32_t) + 4*ggml_tensor_overhead(), /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ false };
    ggml_context_ptr ctx_ptr { ggml_init(cp) };
    gguf_context_ptr g_ptr { gguf_init_empty() };
    gguf_context * g = g_ptr.get();

    std::vector<std::string> names;
    for (const auto & l : layers) {
        names.push_back(l.tensor);
    }
    gguf_set_val_str(g, "general.type", "moe-profile");
    gguf_set_val_u32(g, "moe_profile.version", COMMON_MOEPLUG_PROFILE_VERSION);
    common_moeplug_fingerprint_write(g, fp);
    common_moeplug_set_arr_str(g, "moe_profile.tensors", names);
    gguf_set_val_u64(g, "moe_profile.tokens.prefill", n_tokens[0]);
    gguf_set_val_u64(g, "moe_profile.tokens.decode", n_tokens[1]);
    common_moeplug_set_arr_str(g, "moe_profile.sources", { "live" });
    gguf_set_val_u32(g, "moe_profile.source.0.n_predict", 0);
    gguf_set_val_u32(g, "moe_profile.source.0.seed", 0);
    gguf_set_val_f32(g, "moe_profile.source.0.temp", 0.0f);
    const char * tnames[2] = { "counts.prefill", "counts.decode" };
    for (int ph = 0; ph < 2; ++ph) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx_ptr.get(), GGML_TYPE_I32, n_expert, (int64_t) n_layers);
        ggml_set_name(t, tnames[ph]);
        for (size_t il = 0; il < n_layers; ++il) {
            for (int32_t e = 0; e < n_expert; ++e) {
                const uint64_t v = counts[il*2*n_expert + ph*n_expert + e];
                ((int32_t *) t->data)[il*n_expert + e] = (int32_t) std::min<uint64_t>(v, INT32_MAX);
            }
        }
        gguf_add_tensor(g, t);
    }

    char path[] = "/tmp/moe-record-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) {
        err = "cannot create a temporary file for the profile";
        return "";
    }
    close(fd);
    std::string bytes;
    if (gguf_write_to_file(g, path, false)) {
        std::ifstream f(path, std::ios::binary);
        bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
    std::remove(path);
    if (bytes.empty()) {
        err = "cannot write the profile";
    }
    return bytes;
}

//
// --moe-cache-profile DIR, --moe-cache-slots auto (native/SLOTS-FORMAT.md)
//

std::string common_moeplug_slots_path(const std::string & profile_path) {
    const std::string ext = ".gguf";
    const bool has_ext = profile_path.size() > ext.size() &&
        profile_path.compare(profile_path.size() - ext.size(), ext.size(), ext) == 0;
    return (has_ext ? profile_path.substr(0, profile_path.size() - ext.size()) : profile_path) + ".slots";
}

static std::string moe_trim(const std::string & s) {
    const size_t b = s.find_first_not_of(" \t\r");
    const size_t e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// the settings a plan file may hold, each the name of its flag without "--moe-cache-"
static const char * const MOE_PLAN_SETTINGS[] = {
    "slots", "max-batch", "margin", "policy", "half-life", "uploads", "stream", "offload-min-batch", "copy-ahead", "device",
};

static int32_t moe_parse_int(const std::string & value, int32_t min) {
    size_t end = 0;
    const long v = std::stol(value, &end); // std::invalid_argument, std::out_of_range: common_moeplug_set's message
    if (end != value.size() || v < min || v > INT32_MAX) {
        throw std::invalid_argument("invalid value");
    }
    return (int32_t) v;
}

static float moe_parse_float(const std::string & value, float min, float max) {
    size_t end = 0;
    const float v = std::stof(value, &end);
    if (end != value.size() || !(v >= min && v <= max)) {
        throw std::invalid_argument("invalid value");
    }
    return v;
}

void common_moeplug_set(common_moeplug_params & mp, const std::string & key, const std::string & value) {
    if (key == "slots") {
        common_moeplug_parse_slots(value); // its own message: what --moe-cache-slots takes
        mp.cache_slots = value;
        return;
    }
    try {
        if (key == "max-batch") {
            mp.cache_max_batch = moe_parse_int(value, 1);
        } else if (key == "margin") {
            mp.cache_margin_mib = moe_parse_int(value, 0);
        } else if (key == "policy") {
            if (value != "static" && value != "dynamic") {
                throw std::invalid_argument("invalid value");
            }
            mp.cache_policy = value;
        } else if (key == "half-life") {
            mp.cache_half_life = moe_parse_float(value, 1.0f, 1e6f);
        } else if (key == "uploads") {
            mp.cache_uploads = moe_parse_int(value, 1);
        } else if (key == "stream") {
            mp.cache_stream = moe_parse_float(value, 0.0f, 1.0f);
        } else if (key == "offload-min-batch") {
            mp.cache_offload_min_batch = moe_parse_int(value, 0);
        } else if (key == "copy-ahead") {
            if (value != "on" && value != "off") {
                throw std::invalid_argument("invalid value");
            }
            mp.cache_copy_ahead = value == "on";
        } else if (key == "device") {
            if (value != "CPU" && value != "auto") {
                throw std::invalid_argument("invalid value");
            }
            mp.cache_device = value == "auto" ? "" : value;
        } else {
            throw std::invalid_argument("no such setting: " + key);
        }
    } catch (const std::exception &) { // std::stol/stof's own, out of range, or the checks above
        throw std::invalid_argument(key == "stream" ? "invalid value: give a share from 0 to 1" :
            key == "offload-min-batch" ? "invalid value: give 0 or more tokens" : "invalid value");
    }
}

common_moeplug_plan_file common_moeplug_read_plan_file(const std::string & path, const common_moeplug_fingerprint & fp) {
    std::ifstream f(path);
    if (!f) {
        throw std::runtime_error("cannot read the slots file " + path);
    }
    common_moeplug_plan_file res;
    res.path = path;
    std::map<std::string, std::string> & kv = res.kv;
    std::string line;
    for (int n = 1; std::getline(f, line); ++n) {
        line = moe_trim(line);
        if (line.empty() || line[0] == '#') {
            continue;
        }
        const size_t eq = line.find('=');
        if (eq == std::string::npos) {
            throw std::runtime_error(string_format("the slots file %s is corrupt: line %d is not KEY = VALUE", path.c_str(), n));
        }
        kv[moe_trim(line.substr(0, eq))] = moe_trim(line.substr(eq + 1));
    }
    for (const char * key : { "version", "model.meta_hash", "model.size" }) {
        if (kv.find(key) == kv.end()) {
            throw std::runtime_error(string_format("the slots file %s is corrupt: no %s", path.c_str(), key));
        }
    }
    if (kv["version"] != "1" && kv["version"] != "2") {
        throw std::runtime_error("the slots file " + path + " is version " + kv["version"] + "; this build reads versions 1 and 2");
    }
    if (kv["model.meta_hash"] != fp.meta_hash || kv["model.size"] != std::to_string(fp.size)) {
        throw std::runtime_error("the slots file " + path + " was planned for another model (model.meta_hash or model.size differ)");
    }
    const std::string placement = kv.count("placement") ? kv["placement"] : "moeplug";
    if (placement != "moeplug" && placement != "stock") {
        throw std::runtime_error("the slots file " + path + " is corrupt: placement = " + placement + " is not moeplug or stock");
    }
    res.stock = placement == "stock";
    if (!res.stock && kv.find("slots") == kv.end()) {
        throw std::runtime_error("the slots file " + path + " is corrupt: no slots");
    }
    if (kv.count("slots") && (kv["slots"] == "auto" || kv["slots"].empty())) {
        throw std::runtime_error("the slots file " + path + " is corrupt: slots = " + kv["slots"] + " is not N or N0,N1,...");
    }
    // version 1 holds the slots alone; version 2 may hold every setting (unknown keys are skipped)
    common_moeplug_params check;
    for (const char * key : MOE_PLAN_SETTINGS) {
        const auto it = kv.find(key);
        if (it == kv.end()) {
            continue;
        }
        if (kv["version"] == "1" && it->first != "slots") {
            continue;
        }
        try {
            common_moeplug_set(check, it->first, it->second);
        } catch (const std::invalid_argument &) {
            throw std::runtime_error("the slots file " + path + " is corrupt: " + it->first + " = " + it->second +
                (it->first == "slots" ? " is not N or N0,N1,..." : " is not a value --moe-cache-" + it->first + " takes"));
        }
        res.settings[it->first] = it->second;
    }
    if (kv.count("profile") && !kv["profile"].empty()) {
        const std::filesystem::path profile(kv["profile"]);
        res.profile = profile.is_absolute() ? profile.string() : (std::filesystem::path(path).parent_path() / profile).string();
    }
    return res;
}

void common_moeplug_apply_plan(common_moeplug_params & mp, const common_moeplug_plan_file & plan) {
    for (const auto & [key, value] : plan.settings) {
        if (!mp.given.count(key) || (key == "slots" && mp.cache_slots == "auto")) {
            common_moeplug_set(mp, key, value); // read_plan_file checked every value
        }
    }
    if (mp.cache_profile.empty()) {
        mp.cache_profile = plan.profile;
    }
}

std::string common_moeplug_settings(const common_moeplug_params & mp, bool stock, const std::string & plan) {
    std::string out;
    for (const auto & [key, value] : moe_settings_pairs(mp, stock, plan)) {
        out += (out.empty() ? "" : " ") + key + "=" + value;
    }
    return out;
}

// bytes of one expert of every routed-expert tensor of the block of `down` (the profile's layer)
static uint64_t moe_slot_bytes(const common_moeplug_fingerprint & fp, const std::string & down) {
    const std::string prefix = "blk." + down.substr(4, down.find('.', 4) - 4) + ".";
    uint64_t bytes = 0;
    for (size_t i = 0; i < fp.expert_tensors.size(); ++i) {
        if (fp.expert_tensors[i].rfind(prefix, 0) != 0) {
            continue;
        }
        const int64_t * ne = &fp.expert_shapes[4*i];
        const uint64_t n = ggml_row_size((ggml_type) fp.expert_types[i], ne[0]) * ne[1] * ne[2] * ne[3];
        bytes += fp.n_expert > 0 ? n / fp.n_expert : 0;
    }
    return bytes;
}

std::string common_moeplug_auto_slots(const std::string & profile_path, const common_moeplug_fingerprint & fp,
        int32_t margin_mib, bool slots_on_cpu, std::string & origin) {
    gguf_init_params ip = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context_ptr gp { gguf_init_from_file(profile_path.c_str(), ip) };
    if (!gp) {
        throw std::runtime_error("cannot read the profile " + profile_path + " (missing, truncated or not GGUF)");
    }
    const std::vector<std::string> tensors = moe_get_arr_str(gp.get(), "moe_profile.tensors");
    uint64_t per_slot = 0; // one slot in every profiled layer
    for (const auto & t : tensors) {
        per_slot += moe_slot_bytes(fp, t);
    }
    if (tensors.empty() || per_slot == 0 || fp.n_expert == 0) {
        throw std::runtime_error("--moe-cache-slots auto: the profile " + profile_path + " lists no expert layer of this model");
    }
    const uint64_t margin = (uint64_t) std::max(margin_mib, 0) * 1024 * 1024;

    const char * dev_env = getenv("LLAMA_MOE_CACHE_DEVICE"); // the debugging override
    const bool on_cpu = slots_on_cpu || (dev_env != nullptr && strcmp(dev_env, "CPU") == 0);
    uint64_t room = 0;
    std::string where;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const auto type = ggml_backend_dev_type(dev);
        if (on_cpu ? type != GGML_BACKEND_DEVICE_TYPE_CPU : (type != GGML_BACKEND_DEVICE_TYPE_GPU && type != GGML_BACKEND_DEVICE_TYPE_IGPU)) {
            continue;
        }
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        room  += free > margin ? free - margin : 0;
        where += (where.empty() ? "" : "+") + std::string(ggml_backend_dev_name(dev));
        if (on_cpu) {
            break;
        }
    }
    if (where.empty()) {
        throw std::runtime_error("--moe-cache-slots auto: no GPU to hold slots (--moe-cache-device CPU holds them in RAM)");
    }
    const uint64_t fit = room / per_slot;
    const uint64_t want = on_cpu ? std::max<uint64_t>(1, fp.n_expert / 4) : fp.n_expert;
    const uint64_t n = std::min(fit, want);
    if (n < 1) {
        throw std::runtime_error(string_format("--moe-cache-slots auto: %.2f MiB free on %s less a %d MiB margin holds no slot (%.2f MiB per slot across %zu layers)",
            room / 1048576.0 + margin_mib, where.c_str(), margin_mib, per_slot / 1048576.0, tensors.size()));
    }
    origin = string_format("auto, %.2f MiB free on %s less a %d MiB margin, %.2f MiB per slot across %zu layers%s",
        (room + margin) / 1048576.0, where.c_str(), margin_mib, per_slot / 1048576.0, tensors.size(),
        on_cpu ? "; slots in RAM: a quarter of the experts" : "");
    return std::to_string(n);
}

common_moeplug_cache_source common_moeplug_cache_resolve(const std::string & model_path, const std::string & profile,
        const std::string & slots, int32_t margin_mib, bool slots_on_cpu) {
    namespace fs = std::filesystem;
    common_moeplug_cache_source res;
    std::error_code ec;
    const bool is_dir = fs::is_directory(profile, ec);
    const bool is_auto = slots == "auto" || (slots.empty() && is_dir);
    if (!is_dir && !is_auto) {
        res.profile = profile; // a profile file and counts: as given
        res.slots   = slots;
        return res;
    }
    try {
        const common_moeplug_fingerprint fp = common_moeplug_fingerprint_of(model_path);
        res.profile = profile;
        if (is_dir) {
            std::vector<std::string> matches;
            std::vector<fs::path> entries;
            for (const auto & e : fs::directory_iterator(profile, ec)) {
                entries.push_back(e.path());
            }
            std::sort(entries.begin(), entries.end());
            for (const auto & p : entries) {
                const std::string name = p.filename().string();
                if (p.extension() != ".gguf" || name[0] == '.') {
                    continue;
                }
                gguf_init_params ip = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
                gguf_context_ptr g { gguf_init_from_file(p.string().c_str(), ip) };
                if (g && moe_get_str(g.get(), "general.type") == "moe-profile" && common_moeplug_fingerprint_diff(g.get(), fp).empty()) {
                    matches.push_back(p.string());
                }
            }
            if (ec) {
                throw std::runtime_error("cannot list " + profile + ": " + ec.message());
            }
            if (matches.empty()) {
                throw std::runtime_error("no profile for this model in " + profile);
            }
            if (matches.size() > 1) {
                std::string names;
                for (const auto & m : matches) {
                    names += (names.empty() ? "" : ", ") + fs::path(m).filename().string();
                }
                throw std::runtime_error(string_format("%zu profiles for this model in %s (%s): keep one",
                    matches.size(), profile.c_str(), names.c_str()));
            }
            res.profile = matches[0];
        }
        if (!is_auto) {
            res.slots = slots;
        } else if (fs::exists(common_moeplug_slots_path(res.profile), ec)) {
            res.origin = common_moeplug_slots_path(res.profile);
            res.plan   = common_moeplug_read_plan_file(res.origin, fp);
            res.slots  = res.plan.stock ? "" : res.plan.settings.at("slots");
        } else {
            res.slots = common_moeplug_auto_slots(res.profile, fp, margin_mib, slots_on_cpu, res.origin);
        }
    } catch (const std::exception & err) {
        res.reason = err.what();
        return res;
    }
    LOG_INF("moe-cache: profile %s, slots %s%s%s\n", res.profile.c_str(), res.plan.stock ? "none (stock's placement)" : res.slots.c_str(),
        res.origin.empty() ? "" : " from ", res.origin.c_str());
    return res;
}

std::string common_moeplug_cache_metrics(const llama_model * model) {
    std::vector<llama_moeplug_cache_layer_stats> stats(llama_model_moeplug_cache_stats(model, nullptr, 0));
    if (stats.empty()) {
        return moe_settings_metric(model);
    }
    llama_model_moeplug_cache_stats(model, stats.data(), stats.size());

    uint64_t selected = 0, resident = 0, cpu_bytes = 0, swaps = 0, upload_bytes = 0;
    std::string layers_selected, layers_resident, layers_swaps;
    std::map<std::string, std::pair<uint64_t, uint64_t>> on_device; // device -> (selections, hits)
    for (const auto & s : stats) {
        selected     += s.n_selected;
        resident     += s.n_resident;
        cpu_bytes    += (s.n_selected - s.n_resident) * s.bytes_per_expert;
        swaps        += s.n_swaps;
        upload_bytes += s.n_swaps * s.bytes_per_expert;
        on_device[s.device].first  += s.n_selected;
        on_device[s.device].second += s.n_resident;
        layers_selected += string_format("llamacpp:moe_cache_layer_selections_total{layer=\"%d\"} %llu\n", s.il, (unsigned long long) s.n_selected);
        layers_resident += string_format("llamacpp:moe_cache_layer_hits_total{layer=\"%d\"} %llu\n", s.il, (unsigned long long) s.n_resident);
        layers_swaps    += string_format("llamacpp:moe_cache_layer_swaps_total{layer=\"%d\"} %llu\n", s.il, (unsigned long long) s.n_swaps);
    }
    std::string devices_selected, devices_resident;
    for (const auto & [dev, n] : on_device) {
        devices_selected += string_format("llamacpp:moe_cache_device_selections_total{device=\"%s\"} %llu\n", dev.c_str(), (unsigned long long) n.first);
        devices_resident += string_format("llamacpp:moe_cache_device_hits_total{device=\"%s\"} %llu\n", dev.c_str(), (unsigned long long) n.second);
    }
    auto counter = [](const char * name, const char * help, uint64_t value) {
        return string_format("# HELP llamacpp:%s %s\n# TYPE llamacpp:%s counter\nllamacpp:%s %llu\n",
            name, help, name, name, (unsigned long long) value);
    };
    return moe_settings_metric(model) +
           counter("moe_cache_selections_total", "Expert selections in batches that ran the expert cache.", selected) +
           counter("moe_cache_hits_total", "Of them, experts computed from resident slots.", resident) +
           counter("moe_cache_cpu_experts_total", "Of them, experts computed from host memory.", selected - resident) +
           counter("moe_cache_cpu_bytes_total", "Expert bytes read from host memory for them.", cpu_bytes) +
           counter("moe_cache_swaps_total", "Experts uploaded into a slot after start-up (dynamic policy).", swaps) +
           counter("moe_cache_upload_bytes_total", "Expert bytes uploaded into slots after start-up.", upload_bytes) +
           "# HELP llamacpp:moe_cache_layer_selections_total Expert selections per MoE layer.\n"
           "# TYPE llamacpp:moe_cache_layer_selections_total counter\n" + layers_selected +
           "# HELP llamacpp:moe_cache_layer_hits_total Resident-slot hits per MoE layer.\n"
           "# TYPE llamacpp:moe_cache_layer_hits_total counter\n" + layers_resident +
           "# HELP llamacpp:moe_cache_layer_swaps_total Experts uploaded into a slot per MoE layer.\n"
           "# TYPE llamacpp:moe_cache_layer_swaps_total counter\n" + layers_swaps +
           "# HELP llamacpp:moe_cache_device_selections_total Expert selections of the layers whose slots live on a device.\n"
           "# TYPE llamacpp:moe_cache_device_selections_total counter\n" + devices_selected +
           "# HELP llamacpp:moe_cache_device_hits_total Of them, resident-slot hits.\n"
           "# TYPE llamacpp:moe_cache_device_hits_total counter\n" + devices_resident;
}

bool common_moeplug_replay_load(llama_model * model, const std::string & path) {
    llama_moeplug_replay_result result = {};
    if (!llama_model_moeplug_replay_init(model, path.c_str(), &result)) {
        LOG_ERR("moe-replay: %s\n", result.reason);
        // the callers exit on this; the log's worker thread would otherwise lose the line
        common_log_flush(common_log_main());
        return false;
    }
    LOG_INF("moe-replay: %s, %d prompts, %lld tokens, %d layers x %d of %d%s\n", path.c_str(),
        result.n_prompts, (long long) result.n_tokens, result.n_layer, result.n_expert_used, result.n_expert,
        result.has_weights ? ", with weights" : "");
    return true;
}

bool common_moeplug_replay_init(llama_model * model, const common_params & params) {
    return params.moeplug.route_replay.empty() || common_moeplug_replay_load(model, params.moeplug.route_replay);
}

void common_moeplug_replay_reset(const llama_model * model) {
    llama_model_moeplug_replay_reset(model);
}

// a setting given on the command line (or its LLAMA_ARG_* variable): checked, and kept over a plan file's
static void moe_set_given(common_params & params, const char * key, const std::string & value) {
    common_moeplug_set(params.moeplug, key, value);
    params.moeplug.given.insert(key);
}

void common_moeplug_add_args(const common_params & params, const std::function<void(common_arg)> & add_opt) {
    add_opt(common_arg(
        {"--moe-cache-profile"}, "FNAME|DIR",
        "expert slot cache: moe profile of the model (llama-moe-profile) that picks the resident experts,\n"
        "or a directory of profiles: the one whose fingerprint is the model's (and its slots file)",
        [](common_params & params, const std::string & value) {
            params.moeplug.cache_profile = value;
        }
    ).set_env("LLAMA_ARG_MOE_CACHE_PROFILE"));
    add_opt(common_arg(
        {"--moe-cache-slots"}, "N|N0,N1,...|auto",
        "expert slot cache: experts of each MoE layer kept on the layer's device, one count for every layer\n"
        "or one per layer of the profile (0 leaves a layer out; all of a layer's experts run it without a host pass);\n"
        "auto: the slots file beside the profile, else what the free device memory holds",
        [](common_params & params, const std::string & value) { moe_set_given(params, "slots", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_SLOTS"));
    add_opt(common_arg(
        {"--moe-cache-max-batch"}, "N",
        string_format("expert slot cache: larger batches run without it (default: %d)", params.moeplug.cache_max_batch),
        [](common_params & params, const std::string & value) { moe_set_given(params, "max-batch", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_MAX_BATCH"));
    add_opt(common_arg(
        {"--moe-cache-margin"}, "MiB",
        string_format("expert slot cache: device memory to leave free (default: %d)", params.moeplug.cache_margin_mib),
        [](common_params & params, const std::string & value) { moe_set_given(params, "margin", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_MARGIN"));
    add_opt(common_arg(
        {"--moe-cache-policy"}, "static|dynamic",
        "expert slot cache: 'static' keeps the profile's experts in the slots; 'dynamic' swaps a cold\n"
        "resident expert for a hot missed one between batches (use counts decayed over tokens, seeded\n"
        "from the profile; uploads never stall a batch) (default: static)",
        [](common_params & params, const std::string & value) { moe_set_given(params, "policy", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_POLICY"));
    add_opt(common_arg(
        {"--moe-cache-half-life"}, "N",
        string_format("expert slot cache, dynamic policy: tokens over which an expert's use count halves (default: %.0f)",
            (double) params.moeplug.cache_half_life),
        [](common_params & params, const std::string & value) { moe_set_given(params, "half-life", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_HALF_LIFE"));
    add_opt(common_arg(
        {"--moe-cache-uploads"}, "N",
        string_format("expert slot cache, dynamic policy: slot uploads started after a batch, all layers (default: %d)",
            params.moeplug.cache_uploads),
        [](common_params & params, const std::string & value) { moe_set_given(params, "uploads", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_UPLOADS"));
    add_opt(common_arg(
        {"--moe-cache-stream"}, "F",
        string_format("expert slot cache: of each layer's experts without a slot, the hottest carrying this share of their "
            "selections are copied by the GPU from host memory and computed there, beside the CPU computing the others "
            "(0 to 1; needs the slots on the first GPU and --load-mode none; default: %.1f)", (double) params.moeplug.cache_stream),
        [](common_params & params, const std::string & value) { moe_set_given(params, "stream", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_STREAM"));
    add_opt(common_arg(
        {"--moe-cache-offload-min-batch"}, "N",
        "expert slot cache: prompt batches of N tokens or more go to the GPU for the layers whose GPU copies their "
        "experts from the slots, whatever GGML_OP_OFFLOAD_MIN_BATCH says for the rest of the model (0: that "
        "threshold, 32 by default; default: 0)",
        [](common_params & params, const std::string & value) { moe_set_given(params, "offload-min-batch", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_OFFLOAD_MIN_BATCH"));
    add_opt(common_arg(
        {"--moe-cache-copy-ahead"}, "on|off",
        "expert slot cache: a prompt batch's expert weights copied on a second queue while the split before computes,\n"
        "where the device can (default: on)",
        [](common_params & params, const std::string & value) { moe_set_given(params, "copy-ahead", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_COPY_AHEAD"));
    add_opt(common_arg(
        {"--moe-cache-device"}, "CPU|auto",
        "expert slot cache: CPU keeps the slots in RAM with the weights' own buffer type (the whole mechanism on a CPU,\n"
        "same kernels); auto: on each layer's device (default: auto)",
        [](common_params & params, const std::string & value) { moe_set_given(params, "device", value); }
    ).set_env("LLAMA_ARG_MOE_CACHE_DEVICE"));
    add_opt(common_arg(
        {"--moe-cache-plan"}, "FNAME",
        "expert slot cache: the model's plan file (moeplug writes one per model): its profile, slots and settings,\n"
        "each where no flag gives it; placement = stock runs the model without the cache",
        [](common_params & params, const std::string & value) {
            params.moeplug.cache_plan = value;
        }
    ).set_env("LLAMA_ARG_MOE_CACHE_PLAN"));
    add_opt(common_arg(
        {"--moe-cache-record"},
        "count the router's selections per MoE layer and expert, prompt and generated tokens apart\n"
        "(llama-server: GET /moe-cache/profile serves them as a moe profile; no text is kept)",
        [](common_params & params) {
            params.moeplug.cache_record = true;
        }
    ).set_env("LLAMA_ARG_MOE_CACHE_RECORD"));
    add_opt(common_arg(
        {"--moe-route-replay"}, "FNAME",
        "replay recorded router decisions (moeplug trace convert) instead of the router's: each sequence\n"
        "takes the next prompt of the file; refuses a file of another MoE layout",
        [](common_params & params, const std::string & value) {
            params.moeplug.route_replay = value;
        }
    ).set_env("LLAMA_ARG_MOE_ROUTE_REPLAY"));
}

void common_moeplug_bench_usage() {
    const common_moeplug_params d;
    printf("  --moe-cache-profile <file>                        expert slot cache: moe profile of the model\n");
    printf("  --moe-cache-slots <n|n0,n1,...>                   expert slot cache: slots per MoE layer, or one count per layer\n");
    printf("  --moe-cache-max-batch <n>                         expert slot cache: larger batches run without it (default: %d)\n", d.cache_max_batch);
    printf("  --moe-route-replay <file>                         replay recorded router decisions: each test takes the next prompt\n");
    printf("  --moe-cache-policy <static|dynamic>               expert slot cache: slots fixed, or following the prompt (default: %s)\n", d.cache_policy.c_str());
    printf("  --moe-cache-half-life <n>                         expert slot cache, dynamic: tokens after which a count weighs half (default: 128)\n");
    printf("  --moe-cache-uploads <n>                           expert slot cache, dynamic: experts uploaded per layer and batch at most (default: 4)\n");
}

bool common_moeplug_bench_arg(const std::string & arg, int argc, char ** argv, int & i, common_moeplug_params & mp, bool & invalid) {
    static const char * const names[] = {
        "--moe-cache-profile", "--moe-cache-slots", "--moe-cache-max-batch", "--moe-route-replay",
        "--moe-cache-policy", "--moe-cache-half-life", "--moe-cache-uploads",
    };
    if (std::find(std::begin(names), std::end(names), arg) == std::end(names)) {
        return false;
    }
    if (++i >= argc) {
        invalid = true;
        return true;
    }
    const std::string value = argv[i];
    if (arg == "--moe-cache-profile") {
        mp.cache_profile = value;
    } else if (arg == "--moe-cache-slots") {
        mp.cache_slots = value;
    } else if (arg == "--moe-cache-max-batch") {
        mp.cache_max_batch = std::stoi(value);
    } else if (arg == "--moe-route-replay") {
        mp.route_replay = value;
    } else if (arg == "--moe-cache-policy") {
        mp.cache_policy = value;
        invalid = value != "static" && value != "dynamic";
    } else if (arg == "--moe-cache-half-life") {
        mp.cache_half_life = std::stof(value);
    } else {
        mp.cache_uploads = std::stoi(value);
    }
    return true;
}

bool common_moeplug_bench_load(llama_model * model, const std::string & model_path, const common_moeplug_params & mp) {
    if (!mp.cache_profile.empty()) {
        common_moeplug_cache_enable(model, model_path, mp.cache_profile, mp.cache_slots, mp.cache_max_batch, 1024, false,
            mp.cache_policy, mp.cache_half_life, mp.cache_uploads);
    }
    return mp.route_replay.empty() || common_moeplug_replay_load(model, mp.route_replay);
}

std::string common_moeplug_profile_answer(const common_params & params, const llama_model * model, const std::string & reset,
        std::string & err, bool & not_found) {
    not_found = !params.moeplug.cache_record || model == nullptr;
    if (not_found) {
        err = !params.moeplug.cache_record ?
            "This server does not record expert selections. Start it with `--moe-cache-record`" : "The model is not loaded";
        return "";
    }
    return common_moeplug_record_profile(model, params.model.path, reset == "1" || reset == "true", err);
}
