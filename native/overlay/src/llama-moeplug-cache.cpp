#include "llama-moeplug-cache.h"

#include "llama-adapter.h"
#include "llama-cparams.h"
#include "llama-ext.h"
#include "llama-moeplug-ext.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "gguf.h"
#include "ggml-cpp.h"
#include "ggml-moeplug.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_set>

ggml_tensor * llama_moeplug_cache_layer::slot(const ggml_tensor * src) const {
    if (src == nullptr) {
        return nullptr;
    }
    const auto it = slots.find(src);
    return it == slots.end() ? nullptr : it->second;
}

void llama_moeplug_cache_layer::write_maps() const {
    std::vector<int32_t> src(n_expert);     // the expert, or -1 when resident or streamed
    std::vector<int32_t> clamped(n_expert); // its slot, or 0
    std::vector<int32_t> str(n_expert);     // the expert when streamed and not resident, or -1
    for (int32_t e = 0; e < n_expert; ++e) {
        const bool on_device = stream && streamed[e] && slot_of[e] < 0;
        src[e]     = slot_of[e] >= 0 || on_device ? -1 : e;
        clamped[e] = std::max(slot_of[e], 0);
        str[e]     = on_device ? e : -1;
    }
    ggml_backend_tensor_set(map_src,          src.data(),     0, ggml_nbytes(map_src));
    ggml_backend_tensor_set(map_slot,         slot_of.data(), 0, ggml_nbytes(map_slot));
    ggml_backend_tensor_set(map_slot_clamped, clamped.data(), 0, ggml_nbytes(map_slot_clamped));
    if (map_str != nullptr) {
        ggml_backend_tensor_set(map_str, str.data(), 0, ggml_nbytes(map_str));
    }
}

void llama_moeplug_cache_layer::choose_streamed(float share) {
    streamed.assign(n_expert, 0);
    if (!stream) {
        return;
    }
    std::vector<int32_t> missed;
    double total = 0.0;
    for (int32_t e = 0; e < n_expert; ++e) {
        if (slot_of[e] < 0) {
            missed.push_back(e);
            total += score[e];
        }
    }
    std::stable_sort(missed.begin(), missed.end(), [&](int32_t a, int32_t b) { return score[a] > score[b]; });
    // an expert is streamed while the mass taken, half of it included, stays within the share
    const bool by_count = total <= 0.0;
    const double want = share * (by_count ? (double) missed.size() : total);
    double taken = 0.0;
    for (int32_t e : missed) {
        const double w = by_count ? 1.0 : score[e];
        if (taken + 0.5*w > want) {
            break;
        }
        streamed[e] = 1;
        taken += w;
    }
}

bool llama_moeplug_whole_tensors_only(const ggml_tensor * t) {
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(t->buffer);
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    return !ggml_backend_buft_is_host(buft) && (dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU);
}

void llama_moeplug_read_expert(llama_moeplug_cache & cache, const ggml_tensor * src, int32_t e, uint8_t * dst) {
    const size_t slice = src->nb[ggml_n_dims(src) - 1];
    if (ggml_backend_buffer_is_host(src->buffer)) {
        memcpy(dst, (const uint8_t *) src->data + e*slice, slice);
        return;
    }
    if (cache.file_slices.empty()) {
        for (const auto & p : cache.model_files) {
            gguf_init_params ip = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
            gguf_context_ptr g { gguf_init_from_file(p.c_str(), ip) };
            if (!g) {
                throw std::runtime_error("cannot read the GGUF header of " + p);
            }
            for (int64_t i = 0; i < gguf_get_n_tensors(g.get()); ++i) {
                cache.file_slices[gguf_get_tensor_name(g.get(), i)] = { p, gguf_get_data_offset(g.get()) + gguf_get_tensor_offset(g.get(), i) };
            }
        }
    }
    const auto it = cache.file_slices.find(src->name);
    if (it == cache.file_slices.end()) {
        throw std::runtime_error(std::string("tensor ") + src->name + " is in none of the model's files");
    }
    std::ifstream f(it->second.path, std::ios::binary);
    f.seekg((std::streamoff) (it->second.offset + e*slice));
    if (!f.read((char *) dst, (std::streamsize) slice)) {
        throw std::runtime_error("cannot read " + std::string(src->name) + " from " + it->second.path);
    }
}

const llama_moeplug_cache_layer * llama_moeplug_cache::find(const ggml_tensor * down_exps, int64_t n_tokens, bool offload,
        bool * stock_on_slots) const {
    const auto it = layers.find(down_exps);
    if (it == layers.end()) {
        return nullptr;
    }
    const llama_moeplug_cache_layer * layer = it->second.get();
    if (layer->full) {
        return layer;
    }
    if (layer->device_copy && offload && n_tokens >= min_batch(*layer)) {
        if (stock_on_slots != nullptr) {
            *stock_on_slots = true;
        }
        return nullptr;
    }
    return n_tokens > max_batch ? nullptr : layer;
}

size_t llama_model_moeplug_cache_stats(const llama_model * model, llama_moeplug_cache_layer_stats * out, size_t n_max) {
    if (!model->moeplug_cache) {
        return 0;
    }
    std::vector<const llama_moeplug_cache_layer *> layers;
    for (const auto & [down, layer] : model->moeplug_cache->layers) {
        layers.push_back(layer.get());
    }
    std::sort(layers.begin(), layers.end(), [](auto * a, auto * b) { return a->il < b->il; });
    for (size_t i = 0; i < layers.size() && i < n_max; ++i) {
        out[i] = { layers[i]->il, layers[i]->n_selected.load(), layers[i]->n_resident.load(), layers[i]->bytes_per_expert,
                   layers[i]->n_swaps.load(), {} };
        snprintf(out[i].device, sizeof(out[i].device), "%s", layers[i]->dev ? ggml_backend_dev_name(layers[i]->dev) : "");
    }
    return layers.size();
}

void llama_moeplug_cache_init_sched(const llama_moeplug_cache * cache, ggml_backend_sched_t sched) {
    if (cache == nullptr) {
        return;
    }
    ggml_backend_sched_set_expert_copy_ahead(sched, cache->copy_ahead);
    ggml_backend_sched_set_device_expert_copy(sched, true);
    bool overlap = false;
    for (const auto & [down, layer] : cache->layers) {
        overlap = overlap || layer->stream || layer->overlap;
    }
    // the CPU computes its misses while the device computes the streamed or resident ones
    ggml_backend_sched_set_host_overlap(sched, overlap);
    for (const auto & [down, layer] : cache->layers) {
        if (!layer->device_copy) {
            continue;
        }
        for (const auto & [src, dst] : layer->slots) {
            if (ggml_n_dims(src) == 3) { // the weights of a MUL_MAT_ID, each copied by the scheduler
                ggml_backend_sched_set_expert_slots(sched, src, dst, layer->map_slot);
            }
            if (cache->copy_min_batch > 0) { // the layer's prompt batches go to the device from their own batch size
                ggml_backend_sched_set_expert_offload(sched, src, cache->copy_min_batch);
            }
        }
    }
}

uint32_t llama_moeplug_cache::n_extra_nodes() const {
    // a third pass and the CPU's copies where the device computes some misses; and a copy of the selections of
    // every recorded layer
    uint32_t n = 0;
    for (const auto & [down, layer] : layers) {
        n += (layer->stream || layer->overlap ? 2 : 1) * MOEPLUG_CACHE_EXTRA_NODES_PER_LAYER;
    }
    return n + 2 * (uint32_t) recorded.size();
}

namespace {

// flags every MUL_MAT_ID and ADD_ID between out and the pass's inputs with ggml_set_skip_neg_ids (a negative id
// contributes an exact zero) and, where in_place, ggml_set_read_in_place (the device reads the expert weights where
// they are)
void moe_flag_expert_ops(ggml_tensor * t, bool in_place, const std::unordered_set<const ggml_tensor *> & inputs,
        std::unordered_set<const ggml_tensor *> & seen) {
    if (t == nullptr || inputs.count(t) || !seen.insert(t).second) {
        return;
    }
    if (t->op == GGML_OP_MUL_MAT_ID || t->op == GGML_OP_ADD_ID) {
        ggml_set_skip_neg_ids(t);
        if (in_place) {
            ggml_set_read_in_place(t);
        }
    }
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        moe_flag_expert_ops(t->src[i], in_place, inputs, seen);
    }
}

// the backend of sched on dev, or nullptr
ggml_backend_t moe_sched_backend(ggml_backend_sched_t sched, ggml_backend_dev_t dev) {
    if (sched == nullptr || dev == nullptr) {
        return nullptr;
    }
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(b) == dev) {
            return b;
        }
    }
    return nullptr;
}

// runs every node between t and the pass's inputs on backend, where it supports the node (the weights in host
// memory then become inputs the scheduler copies, only the experts the ids use)
void moe_set_backend(ggml_backend_sched_t sched, ggml_backend_t backend, ggml_tensor * t,
        const std::unordered_set<const ggml_tensor *> & inputs, std::unordered_set<const ggml_tensor *> & seen) {
    if (t == nullptr || t->op == GGML_OP_NONE || inputs.count(t) || !seen.insert(t).second) {
        return;
    }
    const bool view = t->op == GGML_OP_VIEW || t->op == GGML_OP_RESHAPE || t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE;
    if (!view && ggml_backend_supports_op(backend, t)) {
        ggml_backend_sched_set_tensor_backend(sched, t, backend);
    }
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        moe_set_backend(sched, backend, t->src[i], inputs, seen);
    }
}

// whether graph g can run the layer on its cache (the layer logs once why not)
bool moe_cache_usable(const llm_graph_context & g, const llm_moe_experts & w, const llama_moeplug_cache_layer & cache, int il) {
    const char * why = nullptr;
    for (ggml_tensor * t : { w.up, w.up_b, w.up_s, w.gate, w.gate_b, w.gate_s, w.gate_up, w.gate_up_b, w.down, w.down_b, w.down_s }) {
        if (t == nullptr) {
            continue;
        }
        if (cache.slot(t) == nullptr) {
            why = "an expert tensor has no slot copy";
        }
        for (const auto & lora : *g.loras) {
            if (lora.first->get_weight(t) != nullptr) {
                why = "a LoRA adapter changes its experts";
            }
        }
    }
    if (why != nullptr && !cache.warned.exchange(true)) {
        LLAMA_LOG_WARN("moe-cache: layer %d runs without the cache: %s\n", il, why);
    }
    return why == nullptr;
}

// a copy of the layer's selected experts that outlives the graph, read by llama_moeplug_cache_after_compute
void moe_observe(const llm_graph_context & g, ggml_tensor * selected_experts, int il, char kind) {
    ggml_tensor * obs = ggml_cont(g.ctx0, selected_experts);
    ggml_format_name(obs, "%s%d-%c", MOEPLUG_OBS_PREFIX, il, kind);
    ggml_set_output(obs);
    ggml_build_forward_expand(g.gf, obs);
}

} // namespace

llama_moeplug_cache::~llama_moeplug_cache() {
    // no upload may still be writing a slot when the slots' buffers go
    for (auto & b : upload_backends) {
        ggml_backend_synchronize(b.get());
    }
    for (ggml_backend_event_t ev : events) {
        ggml_backend_event_free(ev);
    }
}

ggml_tensor * llama_moeplug_cache::build_experts(
        const llm_graph_context & g,
                ggml_tensor * cur,
                ggml_tensor * selected_experts,
      const llm_moe_experts & w,
            llm_ffn_op_type   type_op,
                        int   il) const {
    bool stock_on_slots = false;
    const llama_moeplug_cache_layer * cache = find(w.down, selected_experts->ne[1], g.cparams.op_offload, &stock_on_slots);
    if (stock_on_slots) {
        // the stock pass, the device copying the experts it uses from the slots where resident
        if (record || count || dynamic) {
            moe_observe(g, selected_experts, il, 'p');
        }
        return nullptr;
    }
    if (cache == nullptr || !moe_cache_usable(g, w, *cache, il)) {
        if (record) {
            moe_observe(g, selected_experts, il, 'n');
        }
        return nullptr;
    }
    if (record || count || (dynamic && !cache->full)) {
        moe_observe(g, selected_experts, il, cache->full ? 'w' : 's');
    }

    ggml_context * ctx0 = g.ctx0;
    ggml_cgraph  * gf   = g.gf;

    const llm_moe_experts ws = {
        /*.up        =*/ cache->slot(w.up),
        /*.up_b      =*/ cache->slot(w.up_b),
        /*.up_s      =*/ cache->slot(w.up_s),
        /*.gate      =*/ cache->slot(w.gate),
        /*.gate_b    =*/ cache->slot(w.gate_b),
        /*.gate_s    =*/ cache->slot(w.gate_s),
        /*.gate_up   =*/ cache->slot(w.gate_up),
        /*.gate_up_b =*/ cache->slot(w.gate_up_b),
        /*.down      =*/ cache->slot(w.down),
        /*.down_b    =*/ cache->slot(w.down_b),
        /*.down_s    =*/ cache->slot(w.down_s),
    };

    if (cache->full) {
        // slot i holds expert i: the stock expert pass on the slots
        return g.build_moe_experts(cur, selected_experts, nullptr, ws, type_op, il);
    }

    const int64_t n_used   = selected_experts->ne[0];
    const int64_t n_tokens = selected_experts->ne[1];

    ggml_tensor * sel = ggml_is_contiguous(selected_experts) ? selected_experts : ggml_cont(ctx0, selected_experts);
    sel = ggml_reshape_1d(ctx0, sel, n_used*n_tokens);

    auto remap = [&](ggml_tensor * map, const char * name) {
        ggml_tensor * rows = ggml_get_rows(ctx0, map, sel);
        ggml_tensor * ids = ggml_reshape_2d(ctx0, rows, n_used, n_tokens); // [n_expert_used, n_tokens]
        g.cb(ids, name, il);
        ggml_build_forward_expand(gf, ids);
        return ids;
    };

    const bool has_scales = w.up_s || w.gate_s || w.down_s;

    ggml_tensor * ids_src    = remap(cache->map_src,  "ffn_moe_ids_src");
    ggml_tensor * ids_slot   = remap(cache->map_slot, "ffn_moe_ids_slot");
    ggml_tensor * ids_slot_s = has_scales ? remap(cache->map_slot_clamped, "ffn_moe_ids_slot_clamped") : nullptr;

    // one pass: the experts the ids name (a negative id contributes an exact zero) on weights ew; on `backend`
    // where given, reading the weights in place where in_place
    auto pass = [&](ggml_tensor * x, ggml_tensor * ids, ggml_tensor * ids_s, const llm_moe_experts & ew, const char * name,
            ggml_backend_t backend, bool in_place = false) {
        ggml_tensor * e = g.build_moe_experts(x, ids, ids_s, ew, type_op, il);
        std::unordered_set<const ggml_tensor *> seen;
        moe_flag_expert_ops(e, in_place, { x, ids, ids_s }, seen);
        if (backend != nullptr) {
            seen.clear();
            moe_set_backend(g.sched, backend, e, { x, ids, ids_s }, seen);
        }
        g.cb(e, name, il);
        return e;
    };

    // where the slots are on a device, the CPU's inputs can be copied to the host before the device's passes are
    // queued, so that the CPU computes while those run (ggml_backend_sched_set_host_overlap)
    ggml_backend_t dev_backend = moe_sched_backend(g.sched, cache->dev);
    const bool on_device = dev_backend != nullptr && ggml_backend_dev_type(cache->dev) != GGML_BACKEND_DEVICE_TYPE_CPU &&
        g.backend_cpu != nullptr;
    const bool on_host_batch = !g.cparams.op_offload || n_tokens < min_batch(*cache);
    ggml_tensor * cur_h = cur;
    ggml_tensor * ids_h = ids_src;
    ggml_tensor * sel_h = selected_experts;
    auto inputs_to_host = [&]() {
        auto to_host = [&](ggml_tensor * t, const char * name) {
            ggml_tensor * h = ggml_cont(ctx0, t);
            g.cb(h, name, il);
            ggml_backend_sched_set_tensor_backend(g.sched, h, g.backend_cpu);
            ggml_build_forward_expand(gf, h);
            return h;
        };
        cur_h = to_host(cur, "ffn_moe_cur_host");
        ids_h = to_host(ids_src, "ffn_moe_ids_src_host");
        sel_h = has_scales ? to_host(selected_experts, "ffn_moe_selected_host") : selected_experts;
    };

    if (!cache->stream) {
        ggml_tensor * e_src  = nullptr;
        ggml_tensor * e_slot = nullptr;
        // only for a batch whose misses the scheduler leaves on the CPU (it sends larger ones to the device): with
        // direct, the misses on the device too, read from host memory where they are, so the layer runs on the device
        // alone; with overlap, the misses on the CPU beside the device's pass on the slots
        const bool direct  = cache->direct && on_device && on_host_batch;
        const bool overlap = !direct && cache->overlap && on_device && on_host_batch;
        if (overlap) {
            // the resident experts on their slots, queued on the device, then the others on the CPU beside them
            inputs_to_host();
            e_slot = pass(cur, ids_slot, ids_slot_s, ws, "ffn_moe_experts_slot", nullptr);
            ggml_build_forward_expand(gf, e_slot);
            e_src = pass(cur_h, ids_h, sel_h, w, "ffn_moe_experts_src", nullptr);
            ggml_build_forward_expand(gf, e_src);
        } else {
            // the experts that are not resident, on the source weights (scale rows by the real ids), then the
            // resident ones on their slots
            e_src = pass(cur, ids_src, selected_experts, w, "ffn_moe_experts_src", direct ? dev_backend : nullptr, direct);
            ggml_build_forward_expand(gf, e_src);
            e_slot = pass(cur, ids_slot, ids_slot_s, ws, "ffn_moe_experts_slot", nullptr);
            ggml_build_forward_expand(gf, e_slot);
        }

        // each (expert, token) is exactly zero in one of the two: the sum is the stock value
        ggml_tensor * experts = ggml_add(ctx0, e_slot, e_src);
        g.cb(experts, "ffn_moe_experts_merged", il);
        if (overlap || direct) {
            ggml_backend_sched_set_tensor_backend(g.sched, experts, dev_backend);
        }

        return experts;
    }

    // three passes: the streamed misses on the device, the resident experts on their slots, the other misses on
    // the CPU; with slots on the CPU every pass runs there
    ggml_tensor * ids_str = remap(cache->map_str, "ffn_moe_ids_str");
    if (on_device) {
        inputs_to_host();
    }

    // the streamed misses: the source weights, copied to the device by the scheduler (only the experts in ids_str),
    // and the device's full copies of the small tensors
    llm_moe_experts wm = w;
    for (ggml_tensor ** t : { &wm.up_b, &wm.up_s, &wm.gate_b, &wm.gate_s, &wm.gate_up_b, &wm.down_b, &wm.down_s }) {
        if (*t != nullptr) {
            const auto it = cache->mirrors.find(*t);
            GGML_ASSERT(it != cache->mirrors.end());
            *t = it->second;
        }
    }
    ggml_tensor * e_str = pass(cur, ids_str, selected_experts, wm, "ffn_moe_experts_str", dev_backend);
    ggml_build_forward_expand(gf, e_str);

    ggml_tensor * e_slot = pass(cur, ids_slot, ids_slot_s, ws, "ffn_moe_experts_slot", nullptr);
    ggml_tensor * e_dev = ggml_add(ctx0, e_slot, e_str);
    g.cb(e_dev, "ffn_moe_experts_dev", il);
    if (dev_backend != nullptr) {
        ggml_backend_sched_set_tensor_backend(g.sched, e_dev, dev_backend);
    }
    ggml_build_forward_expand(gf, e_dev);

    ggml_tensor * e_src = pass(cur_h, ids_h, sel_h, w, "ffn_moe_experts_src", nullptr);
    ggml_build_forward_expand(gf, e_src);

    // each (expert, token) is exactly zero in all but one of the three: the sum is the stock value
    ggml_tensor * experts = ggml_add(ctx0, e_dev, e_src);
    g.cb(experts, "ffn_moe_experts_merged", il);
    if (dev_backend != nullptr) {
        ggml_backend_sched_set_tensor_backend(g.sched, experts, dev_backend);
    }

    return experts;
}

namespace {

// what the cache does on one layer before anything is allocated
struct moe_layer_plan {
    const ggml_tensor *              down = nullptr;
    int                              il   = -1;
    std::vector<int32_t>             experts;
    std::vector<float>               rates;    // the profile's selections per token of each expert, or empty
    std::vector<const ggml_tensor *> sources;  // every expert tensor of the layer
    std::vector<ggml_backend_buffer_type_t> bufts; // where each source's slot copy goes
    ggml_backend_dev_t               dev  = nullptr;
};

// the debugging overrides the cache reads (native/README.md, "Environment switches"), all of them here, once
// per cache built; the settings themselves are the caller's (llama_moeplug_cache_params)
struct moe_overrides {
    bool         slots_on_cpu      = false;   // LLAMA_MOE_CACHE_DEVICE=CPU: the slots on the CPU, the source's buffer type
                                              // (as llama_moeplug_cache_params::slots_on_cpu asks)
    bool         no_resident       = false;   // LLAMA_MOE_CACHE_NO_RESIDENT=1: every expert mapped to its source
    bool         device_copy       = true;    // LLAMA_MOE_CACHE_DEVICE_COPY=0: prompt batches keep the two passes
    bool         overlap           = true;    // LLAMA_MOE_CACHE_OVERLAP=0: a layer's device pass waits for its CPU pass
    bool         direct            = false;   // LLAMA_MOE_CACHE_DIRECT=1: the device reads a layer's misses in place
    const char * stream            = nullptr; // LLAMA_MOE_CACHE_STREAM=F: over the caller's stream share
    int          offload_min_batch = 0;       // GGML_OP_OFFLOAD_MIN_BATCH (llama.cpp's own threshold, as CUDA reads it)
};

moe_overrides moe_read_overrides() {
    auto set = [](const char * v) { return v != nullptr && strcmp(v, "0") != 0 && v[0] != '\0'; };
    moe_overrides o;
    const char * device = getenv("LLAMA_MOE_CACHE_DEVICE");
    o.slots_on_cpu = device != nullptr && strcmp(device, "CPU") == 0;
    o.no_resident  = set(getenv("LLAMA_MOE_CACHE_NO_RESIDENT"));
    const char * copy = getenv("LLAMA_MOE_CACHE_DEVICE_COPY");
    o.device_copy  = copy == nullptr || strcmp(copy, "0") != 0;
    const char * overlap = getenv("LLAMA_MOE_CACHE_OVERLAP");
    o.overlap      = overlap == nullptr || strcmp(overlap, "0") != 0;
    o.direct       = set(getenv("LLAMA_MOE_CACHE_DIRECT"));
    o.stream       = getenv("LLAMA_MOE_CACHE_STREAM");
    if (const char * v = getenv("GGML_OP_OFFLOAD_MIN_BATCH")) {
        o.offload_min_batch = std::max(1, atoi(v));
    }
    return o;
}

// the dimension that counts experts: the last one (weights [k, n, E], biases [n, E], scales [E])
int moe_expert_dim(const ggml_tensor * t) {
    return ggml_n_dims(t) - 1;
}

// can dev compute a MUL_MAT_ID with negative ids on a weight of type `type` in buft?
bool moe_dev_supports_skip_neg(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft, const ggml_tensor * w) {
    ggml_init_params params = {
        /*.mem_size   =*/ ggml_tensor_overhead()*8,
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr ctx { ggml_init(params) };

    ggml_tensor * as  = ggml_new_tensor_3d(ctx.get(), w->type, w->ne[0], w->ne[1], 2);
    ggml_tensor * b   = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, w->ne[0], 1, 1);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, 1, 1);
    ggml_tensor * op  = ggml_mul_mat_id(ctx.get(), as, b, ids);
    ggml_set_skip_neg_ids(op);

    ggml_backend_buffer_ptr buf { ggml_backend_buft_alloc_buffer(buft, 0) };
    as->buffer = buf.get();
    return ggml_backend_dev_supports_op(dev, op);
}

bool moe_is_cpu_dev(ggml_backend_dev_t dev) {
    return dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
}

// whether every expert tensor of the layer is in the pinned host memory of the slots' device (a device, not the CPU)
bool moe_sources_in_device_host(const moe_layer_plan & plan) {
    ggml_backend_buffer_type_t host = moe_is_cpu_dev(plan.dev) ? nullptr : ggml_backend_dev_host_buffer_type(plan.dev);
    for (const ggml_tensor * src : plan.sources) {
        if (host == nullptr || src->buffer == nullptr || ggml_backend_buffer_get_type(src->buffer) != host) {
            return false;
        }
    }
    return true;
}

// whether prompt batches of the layer can run the stock pass with the device copying each expert from
// its slot or from host memory: the slots are on the device the scheduler sends prompt batches to (the
// model's first), every expert tensor is in that device's pinned host memory, and its backend copies
bool moe_device_copies(const llama_model & model, const moe_layer_plan & plan, bool enabled) {
    if (!enabled || moe_is_cpu_dev(plan.dev) || model.devices.empty() || model.devices[0].dev != plan.dev ||
            !moe_sources_in_device_host(plan)) {
        return false;
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(plan.dev);
    return reg != nullptr && ggml_backend_reg_get_proc_address(reg, "ggml_backend_copy_experts_async") != nullptr;
}

// N of a "blk.N.*" tensor name, or -1
int moe_block_index(const std::string & name) {
    int il = -1;
    int n  = 0;
    if (sscanf(name.c_str(), "blk.%d.%n", &il, &n) != 1 || n == 0 || il < 0) {
        return -1;
    }
    return il;
}

// the layer's expert tensors: blk.N.ffn_{gate,up,gate_up,down}_exps.* (or _chexps.*, after down)
std::vector<const ggml_tensor *> moe_layer_sources(const llama_model & model, const std::string & down_name) {
    const std::string prefix = format("blk.%d.ffn_", moe_block_index(down_name));
    const std::string infix  = down_name.find("_chexps.") != std::string::npos ? "_chexps." : "_exps.";

    std::vector<const ggml_tensor *> res;
    for (const auto & [name, t] : model.tensors_by_name) {
        for (const char * kind : { "gate", "up", "gate_up", "down" }) {
            if (name.rfind(prefix + kind + infix, 0) == 0) {
                res.push_back(t);
            }
        }
    }
    return res;
}

// fills plan from one layer of the request; returns "" or why the layer is left stock
using moe_support_cache = std::map<std::pair<ggml_backend_buffer_type_t, ggml_type>, bool>;

std::string moe_plan_layer(const llama_model & model, const llama_moeplug_cache_layer_experts & req, bool debug_cpu,
        moe_support_cache & supported, moe_layer_plan & plan) {
    const std::string name = req.tensor ? req.tensor : "";
    const ggml_tensor * down = model.get_tensor(name.c_str());
    if (down == nullptr || moe_block_index(name) < 0) {
        throw std::runtime_error("the model has no expert tensor " + name);
    }
    if (ggml_n_dims(down) != 3) {
        throw std::runtime_error(name + " is not a 3-d expert tensor");
    }
    plan.down = down;
    plan.il   = moe_block_index(name);

    const int64_t n_expert = down->ne[2];
    if (req.n_experts < 1 || req.n_experts > n_expert) {
        throw std::runtime_error(format("%s: %d slots asked, the layer has %" PRId64 " experts", name.c_str(), req.n_experts, n_expert));
    }
    std::set<int32_t> seen;
    for (int32_t i = 0; i < req.n_experts; ++i) {
        const int32_t e = req.experts[i];
        if (e < 0 || e >= n_expert || !seen.insert(e).second) {
            throw std::runtime_error(format("%s: expert %d is out of range or repeated", name.c_str(), e));
        }
        plan.experts.push_back(e);
    }
    if (req.n_experts == n_expert) {
        std::sort(plan.experts.begin(), plan.experts.end()); // slot i = expert i: no remapping
    }
    if (req.rates != nullptr && req.n_rates == n_expert) {
        plan.rates.assign(req.rates, req.rates + n_expert);
    }

    if (debug_cpu) {
        plan.dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    } else {
        plan.dev = model.dev_layer(plan.il);
        if (moe_is_cpu_dev(plan.dev)) {
            return "the layer runs on the CPU";
        }
    }

    plan.sources = moe_layer_sources(model, name);
    for (const ggml_tensor * t : plan.sources) {
        if (t->ne[moe_expert_dim(t)] != n_expert || !ggml_is_contiguous(t)) {
            return std::string("expert tensor ") + t->name + " has an unexpected shape";
        }
        if (t->buffer == nullptr) {
            return std::string("expert tensor ") + t->name + " is not loaded";
        }
        // host memory: pinned host buffers (CUDA_Host) belong to a GPU device but live in RAM
        ggml_backend_buffer_type_t src_buft = ggml_backend_buffer_get_type(t->buffer);
        if (!ggml_backend_buft_is_host(src_buft) && !moe_is_cpu_dev(ggml_backend_buft_get_device(src_buft))) {
            return "its experts are on a GPU already";
        }
        // debug: the source's own buffer type, so that the same CPU kernels run (repack included)
        ggml_backend_buffer_type_t buft = !debug_cpu ? ggml_backend_dev_buffer_type(plan.dev) :
            ggml_backend_buffer_is_host(t->buffer) ? ggml_backend_dev_buffer_type(plan.dev) : src_buft;
        if (ggml_n_dims(t) == 3) {
            auto it = supported.find({ buft, t->type });
            if (it == supported.end()) {
                it = supported.emplace(std::make_pair(buft, t->type), moe_dev_supports_skip_neg(plan.dev, buft, t)).first;
            }
            if (!it->second) {
                return std::string(ggml_backend_dev_name(plan.dev)) + " cannot compute a MUL_MAT_ID with ids < 0 on " + ggml_type_name(t->type);
            }
        }
        plan.bufts.push_back(buft);
    }
    return "";
}

// the copy of `src` that holds n_slot experts; at least 2, as some backends (CPU_REPACK) tell
// expert stacks from plain matrices by ggml_n_dims, which does not count a trailing 1
ggml_tensor * moe_new_slot_tensor(ggml_context * ctx, const ggml_tensor * src, int64_t n_slot) {
    int64_t ne[GGML_MAX_DIMS];
    for (int d = 0; d < GGML_MAX_DIMS; ++d) {
        ne[d] = src->ne[d];
    }
    ne[moe_expert_dim(src)] = std::max<int64_t>(n_slot, 2);
    ggml_tensor * t = ggml_new_tensor(ctx, src->type, ggml_n_dims(src), ne);
    ggml_format_name(t, "%s.slots", src->name);
    return t;
}

ggml_tensor * moe_new_map(ggml_context * ctx, int64_t n_expert, const char * name, int il) {
    ggml_tensor * t = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, n_expert);
    ggml_format_name(t, "blk.%d.%s", il, name);
    return t;
}

// fills the slot copy dst of src with the layer's experts; keeps the bytes where the buffer only
// takes whole tensors and the slots will change
void moe_fill_slot(llama_moeplug_cache & cache, llama_moeplug_cache_layer & layer, ggml_tensor * dst, const ggml_tensor * src) {
    const size_t slice = src->nb[moe_expert_dim(src)];
    std::vector<uint8_t> staging(ggml_nbytes(dst), 0); // a padding slot stays zero
    for (size_t s = 0; s < layer.experts.size(); ++s) {
        llama_moeplug_read_expert(cache, src, layer.experts[s], staging.data() + s*slice);
    }
    // one call for the whole tensor: repacked buffers only take whole tensors
    ggml_backend_tensor_set(dst, staging.data(), 0, staging.size());
    if (cache.dynamic && !layer.full && llama_moeplug_whole_tensors_only(dst)) {
        layer.shadow[dst] = std::move(staging);
    }
}

std::string moe_plans_failure(const std::map<std::string, int> & reasons) {
    std::string res = "no layer can use it:";
    for (const auto & [why, n] : reasons) {
        res += format(" %d %s (%s);", n, n == 1 ? "layer" : "layers", why.c_str());
    }
    res.pop_back();
    return res;
}

} // namespace

bool llama_moeplug_cache_build(llama_model & model, const llama_moeplug_cache_params & params, llama_moeplug_cache_result & result) {
    const int64_t t_start = ggml_time_us();
    const moe_overrides over = moe_read_overrides();
    const bool debug_cpu = over.slots_on_cpu || params.slots_on_cpu;

    if (params.max_batch < 1) {
        throw std::runtime_error(format("max batch %d: it must be at least 1", params.max_batch));
    }
    if (params.offload_min_batch < 0) {
        throw std::runtime_error(format("offload min batch %d: it must be 0 or more", params.offload_min_batch));
    }

    std::vector<moe_layer_plan> plans;
    std::map<std::string, int> skipped;
    moe_support_cache supported; // one probe per buffer type and weight type
    for (size_t i = 0; i < params.n_layers; ++i) {
        moe_layer_plan plan;
        const std::string why = moe_plan_layer(model, params.layers[i], debug_cpu, supported, plan);
        if (!why.empty()) {
            skipped[why]++;
            continue;
        }
        plans.push_back(std::move(plan));
    }
    if (plans.empty()) {
        snprintf(result.reason, sizeof(result.reason), "%s", moe_plans_failure(skipped).c_str());
        return false;
    }
    for (const auto & [why, n] : skipped) {
        LLAMA_LOG_WARN("moe-cache: %d %s left stock: %s\n", n, n == 1 ? "layer" : "layers", why.c_str());
    }

    auto cache = std::make_unique<llama_moeplug_cache>();
    cache->max_batch   = params.max_batch;
    cache->count       = params.count;
    cache->dynamic     = params.policy == LLAMA_MOEPLUG_CACHE_POLICY_DYNAMIC && !over.no_resident;
    cache->half_life   = params.half_life   > 0.0f ? params.half_life   : MOEPLUG_CACHE_HALF_LIFE_DEFAULT;
    cache->max_uploads = params.max_uploads > 0    ? params.max_uploads : MOEPLUG_CACHE_UPLOADS_DEFAULT;
    cache->model_files.assign(params.model_files, params.model_files + params.n_model_files);
    if (!(params.stream_share >= 0.0f && params.stream_share <= 1.0f)) {
        throw std::runtime_error(format("stream share %g: it must be from 0 to 1", (double) params.stream_share));
    }
    cache->stream_share = params.stream_share;
    if (const char * v = over.stream) { // overrides the caller (llama-bench, experiments)
        char * end = nullptr;
        const float share = strtof(v, &end);
        if (end == v || *end != '\0' || !(share >= 0.0f && share <= 1.0f)) {
            throw std::runtime_error(format("LLAMA_MOE_CACHE_STREAM=%s: give the share of a layer's misses the device computes, 0 to 1", v));
        }
        cache->stream_share = share;
    }
    const bool no_resident = over.no_resident;

    // one context per buffer type: the slots, and the maps beside them
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    auto ctx_for = [&](ggml_backend_buffer_type_t buft) {
        auto it = ctx_of.find(buft);
        if (it != ctx_of.end()) {
            return it->second;
        }
        ggml_init_params ip = {
            /*.mem_size   =*/ ggml_tensor_overhead() * MOEPLUG_CACHE_TENSORS_PER_LAYER * (plans.size() + 1),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        ggml_context * ctx = ggml_init(ip);
        cache->ctxs.emplace_back(ctx);
        ctx_of[buft] = ctx;
        return ctx;
    };

    std::map<ggml_backend_dev_t, size_t> bytes_on;
    std::map<ggml_backend_dev_t, size_t> bytes_per_slot_on;
    for (const auto & plan : plans) {
        auto layer = std::make_unique<llama_moeplug_cache_layer>();
        layer->il       = plan.il;
        layer->n_expert = plan.down->ne[2];
        layer->experts  = plan.experts;
        layer->dev      = plan.dev;
        layer->score.assign(layer->n_expert, 0.0f);
        for (size_t e = 0; e < plan.rates.size(); ++e) {
            // a use count in steady state: rate x the tokens a count lasts (half-life / ln 2)
            layer->score[e] = plan.rates[e] * cache->half_life / 0.69314718f;
        }
        for (const ggml_tensor * src : plan.sources) {
            layer->bytes_per_expert += src->nb[moe_expert_dim(src)];
        }

        // prompt batches copy the layer's experts on the device where its backend can; the device computes
        // some misses where it copies experts from host memory itself (slots on the CPU: the third pass runs
        // on the CPU too, the same result)
        const bool full = !no_resident && (int64_t) plan.experts.size() == layer->n_expert;
        layer->device_copy = !full && !no_resident && moe_device_copies(model, plan, over.device_copy);
        layer->direct = !full && !no_resident && over.direct && moe_sources_in_device_host(plan);
        layer->stream = cache->stream_share > 0.0f && !full && !no_resident && !layer->direct &&
            (moe_is_cpu_dev(plan.dev) || layer->device_copy);
        layer->overlap = !layer->stream && !layer->direct && !full && !no_resident && !moe_is_cpu_dev(plan.dev) &&
            over.overlap;

        for (size_t i = 0; i < plan.sources.size(); ++i) {
            const ggml_tensor * src = plan.sources[i];
            ggml_tensor * t = moe_new_slot_tensor(ctx_for(plan.bufts[i]), src, (int64_t) plan.experts.size());
            layer->slots[src] = t;
            const size_t n = ggml_backend_buft_get_alloc_size(plan.bufts[i], t);
            bytes_on[plan.dev]          += n;
            bytes_per_slot_on[plan.dev] += n / t->ne[moe_expert_dim(t)];
            if (layer->stream && ggml_n_dims(src) < 3) {
                ggml_tensor * m = ggml_dup_tensor(ctx_for(plan.bufts[i]), src);
                ggml_format_name(m, "%s.mirror", src->name);
                layer->mirrors[src] = m;
                bytes_on[plan.dev] += ggml_backend_buft_get_alloc_size(plan.bufts[i], m);
            }
        }
        ggml_context * ctx_map = ctx_for(ggml_backend_dev_buffer_type(plan.dev));
        layer->map_src          = moe_new_map(ctx_map, layer->n_expert, "moe_map_src", plan.il);
        layer->map_slot         = moe_new_map(ctx_map, layer->n_expert, "moe_map_slot", plan.il);
        layer->map_slot_clamped = moe_new_map(ctx_map, layer->n_expert, "moe_map_slot_clamped", plan.il);
        if (layer->stream) {
            layer->map_str = moe_new_map(ctx_map, layer->n_expert, "moe_map_str", plan.il);
        }
        cache->layers[plan.down] = std::move(layer);
    }

    for (const auto & [dev, n] : bytes_on) {
        if (moe_is_cpu_dev(dev)) {
            continue;
        }
        size_t free = 0;
        size_t total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        if (n + params.margin > free) {
            const size_t per_slot = bytes_per_slot_on[dev];
            const size_t room     = free > params.margin ? free - params.margin : 0;
            snprintf(result.reason, sizeof(result.reason),
                "does not fit on %s: %.2f MiB needed (%.2f MiB per slot across its layers), %.2f MiB free less a %.2f MiB margin; at most %zu slots per layer would fit",
                ggml_backend_dev_name(dev), n / 1048576.0, per_slot / 1048576.0, free / 1048576.0,
                params.margin / 1048576.0, per_slot ? room / per_slot : 0);
            return false;
        }
    }

    for (auto & [buft, ctx] : ctx_of) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        if (buf == nullptr) {
            snprintf(result.reason, sizeof(result.reason), "could not allocate the slots in %s", ggml_backend_buft_name(buft));
            return false;
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        cache->bufs.emplace_back(buf);
    }

    for (auto & [down, layer] : cache->layers) {
        layer->full = !no_resident && (int64_t) layer->experts.size() == layer->n_expert;
    }
    if (over.offload_min_batch > 0) {
        cache->offload_min_batch = over.offload_min_batch;
    }
    cache->copy_min_batch = params.offload_min_batch;
    cache->copy_ahead     = !params.no_copy_ahead;
    result.offload_min_batch = cache->copy_min_batch > 0 ? cache->copy_min_batch : cache->offload_min_batch;
    for (const auto & [down, layer] : cache->layers) {
        result.n_layers_copied     += layer->device_copy;
        result.n_layers_streamed   += layer->stream;
        result.n_layers_overlapped += layer->overlap;
        result.n_layers_direct     += layer->direct;
    }
    result.stream_share = cache->stream_share;
    uint64_t n_bytes = 0;
    for (auto & [down, layer] : cache->layers) {
        for (auto & [src, dst] : layer->slots) {
            moe_fill_slot(*cache, *layer, dst, src);
            n_bytes += ggml_nbytes(dst);
        }
        for (auto & [src, dst] : layer->mirrors) {
            const size_t slice = src->nb[moe_expert_dim(src)];
            std::vector<uint8_t> bytes(ggml_nbytes(dst));
            for (int64_t e = 0; e < layer->n_expert; ++e) {
                llama_moeplug_read_expert(*cache, src, (int32_t) e, bytes.data() + e*slice);
            }
            ggml_backend_tensor_set(dst, bytes.data(), 0, bytes.size());
            n_bytes += bytes.size();
        }

        layer->slot_of.assign(layer->n_expert, -1);
        if (!no_resident) {
            for (size_t s = 0; s < layer->experts.size(); ++s) {
                layer->slot_of[layer->experts[s]] = (int32_t) s;
            }
        }
        layer->choose_streamed(cache->stream_share);
        layer->write_maps();
    }

    // dynamic policy: uploads go through a backend of their own on each slot device (its own queue
    // on a GPU), each layer's signalled by an event (none on the CPU: the copies are synchronous)
    if (cache->dynamic) {
        std::map<ggml_backend_dev_t, ggml_backend_t> upload_on;
        for (const auto & plan : plans) {
            llama_moeplug_cache_layer & layer = *cache->layers.at(plan.down);
            if (layer.full || moe_is_cpu_dev(plan.dev)) {
                continue;
            }
            if (!upload_on.count(plan.dev)) {
                ggml_backend_t b = ggml_backend_dev_init(plan.dev, nullptr);
                if (b == nullptr) {
                    throw std::runtime_error(std::string("cannot start a backend on ") + ggml_backend_dev_name(plan.dev) + " for slot uploads");
                }
                cache->upload_backends.emplace_back(b);
                upload_on[plan.dev] = b;
            }
            layer.upload = upload_on[plan.dev];
            layer.uploaded = ggml_backend_event_new(plan.dev);
            if (layer.uploaded != nullptr) {
                cache->events.push_back(layer.uploaded);
            }
        }
    }

    // the slot copies compute with the precision their sources ask for
    for (const auto & [down, layer] : cache->layers) {
        for (const auto & [src, dst] : layer->slots) {
            const auto acc = model.prec_policy.prec_acc.find(src);
            if (acc != model.prec_policy.prec_acc.end()) {
                model.prec_policy.prec_acc[dst] = acc->second;
            }
            const auto src1 = model.prec_policy.prec_src1.find(src);
            if (src1 != model.prec_policy.prec_src1.end()) {
                model.prec_policy.prec_src1[dst] = src1->second;
            }
        }
    }

    result.n_slots_min = INT32_MAX;
    for (const auto & plan : plans) {
        const int32_t n = (int32_t) plan.experts.size();
        result.n_slots        = std::max(result.n_slots, n);
        result.n_slots_min    = std::min(result.n_slots_min, n);
        result.n_slots_total += n;
        result.n_layers_full += cache->layers.at(plan.down)->full;
    }
    result.n_layers   = (int32_t) plans.size();
    result.n_bytes    = n_bytes;
    result.t_upload_s = (ggml_time_us() - t_start) / 1e6;
    // every device that holds slots, in layer order: "CUDA0", or "CUDA0, CUDA1" with a layer split
    std::string devices;
    std::set<ggml_backend_dev_t> named;
    for (const auto & plan : plans) {
        if (named.insert(plan.dev).second) {
            devices += std::string(devices.empty() ? "" : ", ") + ggml_backend_dev_name(plan.dev);
        }
    }
    snprintf(result.device, sizeof(result.device), "%s", devices.c_str());

    model.moeplug_cache = std::move(cache);
    return true;
}

bool llama_model_moeplug_cache_init(llama_model * model, const llama_moeplug_cache_params * params, llama_moeplug_cache_result * result) {
    *result = {};
    if (model->moeplug_cache) {
        snprintf(result->reason, sizeof(result->reason), "the model has a cache already");
        return false;
    }
    try {
        return llama_moeplug_cache_build(*model, *params, *result);
    } catch (const std::exception & err) {
        snprintf(result->reason, sizeof(result->reason), "%s", err.what());
        return false;
    }
}
