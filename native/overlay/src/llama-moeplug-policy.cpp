// Expert slot cache (moeplug), after each graph: what the router selected in every observed layer
// is read back once, for three uses, each opt-in:
//   - slot hits on /metrics (--metrics),
//   - per-expert selection counts of every MoE layer (--moe-cache-record),
//   - the dynamic policy (--moe-cache-policy dynamic): each layer keeps use counts of its experts,
//     decayed over tokens and seeded from the profile; when a missed expert's count beats the
//     coldest resident expert's by a margin, the cold one leaves its slot at once (it becomes a
//     miss like any other) and the hot one is uploaded into that slot on a queue of its own. The
//     next graphs do not wait for the upload: until it has landed (checked after the next graph)
//     the expert stays a miss. A slot therefore only changes while no graph can read it, and each
//     expert is computed by the same kernels whichever side holds it: results do not change.
//
// One context computes at a time per model (llama-server's case); the policy state is not shared
// between contexts computing in parallel on one model.

#include "llama-moeplug-cache.h"

#include "llama-batch.h"
#include "llama-ext.h"
#include "llama-moeplug-ext.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>

namespace {

struct moe_observed {
    int                  il   = -1;
    char                 kind = 'n'; // 's' two passes, 'p' stock pass with slots, 'w' whole layer on its slots, 'n' stock pass
    ggml_tensor *        t    = nullptr;
    std::vector<int32_t> ids;        // [n_expert_used, n_tokens]; empty where nothing needs the ids
};

// the observed selections of the graph, read with one wait per backend; a whole layer's only when
// recording (every selection is a hit: counting needs only how many there were)
std::vector<moe_observed> moe_read_observed(ggml_backend_sched_t sched, ggml_cgraph * gf, bool record) {
    std::vector<moe_observed> res;
    const size_t n_prefix = strlen(MOEPLUG_OBS_PREFIX);
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        ggml_tensor * t = ggml_graph_node(gf, i);
        if (!(t->flags & GGML_TENSOR_FLAG_OUTPUT) || strncmp(t->name, MOEPLUG_OBS_PREFIX, n_prefix) != 0) {
            continue;
        }
        moe_observed o;
        char kind = 0;
        if (sscanf(t->name + n_prefix, "%d-%c", &o.il, &kind) != 2) {
            continue;
        }
        o.kind = kind;
        o.t    = t;
        if (kind != 'w' || record) {
            o.ids.resize(ggml_nelements(t));
        }
        res.push_back(std::move(o));
    }
    if (res.empty()) {
        return res;
    }
    std::vector<ggml_backend_t> waits;
    for (auto & o : res) {
        if (o.ids.empty()) {
            continue;
        }
        ggml_backend_t backend = ggml_backend_sched_get_tensor_backend(sched, o.t);
        if (backend == nullptr) {
            ggml_backend_tensor_get(o.t, o.ids.data(), 0, ggml_nbytes(o.t));
            continue;
        }
        ggml_backend_tensor_get_async(backend, o.t, o.ids.data(), 0, ggml_nbytes(o.t));
        if (std::find(waits.begin(), waits.end(), backend) == waits.end()) {
            waits.push_back(backend);
        }
    }
    for (ggml_backend_t b : waits) {
        ggml_backend_synchronize(b);
    }
    return res;
}

// the upload in flight has landed (waits for it if not): its expert is resident from the next graph on
void moe_commit_upload(llama_moeplug_cache_layer & layer) {
    if (layer.pending_slot < 0) {
        return;
    }
    if (layer.uploaded != nullptr) {
        ggml_backend_event_synchronize(layer.uploaded);
    }
    const int32_t s = layer.pending_slot;
    const int32_t e = layer.pending_expert;
    layer.experts[s] = e;
    layer.slot_of[e] = s;
    layer.pending_slot   = -1;
    layer.pending_expert = -1;
    layer.n_swaps++;
}

// the resident expert `out` leaves its slot (from the next graph on it is a miss) and `in` is
// copied into that slot; the copy is asynchronous where the layer has an upload queue
void moe_start_upload(llama_moeplug_cache & cache, llama_moeplug_cache_layer & layer, int32_t in, int32_t out) {
    const int32_t s = layer.slot_of[out];
    layer.slot_of[out] = -1;
    layer.experts[s]   = -1;

    std::vector<uint8_t> bytes;
    for (auto & [src, dst] : layer.slots) {
        const size_t slice = src->nb[ggml_n_dims(src) - 1];
        auto sh = layer.shadow.find(dst);
        if (sh != layer.shadow.end()) {
            // a buffer that only takes whole tensors: the bytes of every slot, the new one replaced
            llama_moeplug_read_expert(cache, src, in, sh->second.data() + s*slice);
            ggml_backend_tensor_set(dst, sh->second.data(), 0, sh->second.size());
            continue;
        }
        if (layer.upload != nullptr && ggml_backend_buffer_is_host(src->buffer)) {
            // straight from the source's memory (pinned when loaded with --load-mode none)
            ggml_backend_tensor_set_async(layer.upload, dst, (const uint8_t *) src->data + in*slice, s*slice, slice);
            continue;
        }
        bytes.resize(slice);
        llama_moeplug_read_expert(cache, src, in, bytes.data());
        ggml_backend_tensor_set(dst, bytes.data(), s*slice, slice);
    }
    if (layer.upload != nullptr && layer.uploaded != nullptr) {
        ggml_backend_event_record(layer.uploaded, layer.upload);
    }
    layer.pending_slot   = s;
    layer.pending_expert = in;
}

llama_moeplug_cache_layer * moe_layer_of(llama_moeplug_cache & cache, int il) {
    for (auto & [down, layer] : cache.layers) {
        if (layer->il == il) {
            return layer.get();
        }
    }
    return nullptr;
}

// the dynamic policy after a batch of n_tokens: decay and add this batch's selections, land the
// uploads of the last batch, and start the swaps that gain most
void moe_dynamic_step(llama_moeplug_cache & cache, const std::vector<moe_observed> & observed, uint32_t n_tokens) {
    const float decay = std::exp2(-(float) n_tokens / cache.half_life);

    struct candidate {
        llama_moeplug_cache_layer * layer;
        int32_t in;
        int32_t out;
        float   gain;
    };
    std::vector<candidate> candidates;
    std::vector<llama_moeplug_cache_layer *> changed;

    for (const auto & o : observed) {
        if (o.kind != 's' && o.kind != 'p') {
            continue;
        }
        llama_moeplug_cache_layer * layer = moe_layer_of(cache, o.il);
        if (layer == nullptr || layer->full) {
            continue;
        }
        for (float & v : layer->score) {
            v *= decay;
        }
        for (int32_t e : o.ids) {
            if (e >= 0 && e < layer->n_expert) {
                layer->score[e] += 1.0f;
            }
        }
        if (layer->pending_slot >= 0) {
            moe_commit_upload(*layer);
            changed.push_back(layer);
        }

        int32_t in = -1, out = -1;
        for (int32_t e = 0; e < layer->n_expert; ++e) {
            if (layer->slot_of[e] >= 0) {
                if (out < 0 || layer->score[e] < layer->score[out]) {
                    out = e;
                }
            } else if (in < 0 || layer->score[e] > layer->score[in]) {
                in = e;
            }
        }
        if (in >= 0 && out >= 0 && layer->score[in] > layer->score[out] + MOEPLUG_CACHE_SWAP_MARGIN) {
            candidates.push_back({ layer, in, out, layer->score[in] - layer->score[out] });
        }
    }

    std::sort(candidates.begin(), candidates.end(), [](const candidate & a, const candidate & b) {
        return a.gain != b.gain ? a.gain > b.gain : a.layer->il < b.layer->il;
    });
    if ((int32_t) candidates.size() > cache.max_uploads) {
        candidates.resize(cache.max_uploads);
    }
    for (const auto & c : candidates) {
        moe_start_upload(cache, *c.layer, c.in, c.out);
        changed.push_back(c.layer);
    }

    std::sort(changed.begin(), changed.end());
    changed.erase(std::unique(changed.begin(), changed.end()), changed.end());
    for (llama_moeplug_cache_layer * layer : changed) {
        layer->choose_streamed(cache.stream_share);
        layer->write_maps();
    }
}

} // namespace

void llama_moeplug_cache_after_compute(llama_moeplug_cache & cache, ggml_backend_sched_t sched, ggml_cgraph * gf,
        const llama_ubatch & ubatch) {
    if (!cache.count && !cache.dynamic && !cache.record) {
        return;
    }
    const std::vector<moe_observed> observed = moe_read_observed(sched, gf, cache.record);
    if (observed.empty()) {
        return;
    }

    if (cache.count) {
        for (const auto & o : observed) {
            const llama_moeplug_cache_layer * layer = o.kind == 'n' ? nullptr : moe_layer_of(cache, o.il);
            if (layer == nullptr) {
                continue;
            }
            if (o.ids.empty()) { // a whole layer, not read
                layer->n_selected += ggml_nelements(o.t);
                layer->n_resident += ggml_nelements(o.t);
                continue;
            }
            uint64_t selected = 0, resident = 0;
            for (int32_t e : o.ids) {
                if (e < 0 || e >= layer->n_expert) {
                    continue;
                }
                selected++;
                resident += layer->full || layer->slot_of[e] >= 0;
            }
            layer->n_selected += selected;
            layer->n_resident += resident;
        }
    }

    if (cache.record) {
        std::lock_guard<std::mutex> lock(cache.record_mutex);
        uint64_t n_decode = 0;
        for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
            n_decode += ubatch.output != nullptr && ubatch.output[i];
        }
        cache.n_record_decode  += n_decode;
        cache.n_record_prefill += ubatch.n_tokens - n_decode;
        for (const auto & o : observed) {
            auto it = cache.recorded.find(o.il);
            if (it == cache.recorded.end()) {
                continue;
            }
            llama_moeplug_record_layer_state & rec = it->second;
            const int64_t n_used = o.t->ne[0];
            for (int64_t j = 0; j < (int64_t) o.ids.size(); ++j) {
                const int32_t e   = o.ids[j];
                const int64_t tok = j / n_used;
                if (e < 0 || e >= (int32_t) rec.prefill.size() || tok >= (int64_t) ubatch.n_tokens) {
                    continue;
                }
                (ubatch.output != nullptr && ubatch.output[tok] ? rec.decode : rec.prefill)[e]++;
            }
        }
    }

    if (cache.dynamic) {
        moe_dynamic_step(cache, observed, ubatch.n_tokens);
    }
}

bool llama_model_moeplug_record_init(llama_model * model) {
    if (!model->moeplug_cache) {
        model->moeplug_cache = std::make_unique<llama_moeplug_cache>();
    }
    llama_moeplug_cache & cache = *model->moeplug_cache;
    std::lock_guard<std::mutex> lock(cache.record_mutex);
    // every MoE layer, by its expert down weight (blk.N.ffn_down_exps.weight, or _chexps)
    for (const auto & [name, t] : model->tensors_by_name) {
        int il = -1;
        int n  = 0;
        if (sscanf(name.c_str(), "blk.%d.ffn_down_%n", &il, &n) != 1 || n == 0 || ggml_n_dims(t) != 3) {
            continue;
        }
        const std::string rest = name.substr(n);
        if (rest != "exps.weight" && rest != "chexps.weight") {
            continue;
        }
        auto & rec = cache.recorded[il];
        if (!rec.tensor.empty() && rest == "chexps.weight") {
            continue; // the routed experts' down weight wins over the chunked one
        }
        rec.il     = il;
        rec.tensor = name;
        rec.prefill.assign(t->ne[2], 0);
        rec.decode.assign(t->ne[2], 0);
    }
    if (cache.recorded.empty()) {
        return false;
    }
    cache.record = true;
    return true;
}

size_t llama_model_moeplug_record_read(const llama_model * model, llama_moeplug_record_layer * layers, uint64_t * counts,
        int32_t n_expert_max, size_t n_max, uint64_t * n_tokens, bool reset) {
    if (!model->moeplug_cache || !model->moeplug_cache->record) {
        return 0;
    }
    llama_moeplug_cache & cache = *model->moeplug_cache;
    std::lock_guard<std::mutex> lock(cache.record_mutex);
    std::vector<llama_moeplug_record_layer_state *> order;
    for (auto & [il, rec] : cache.recorded) {
        order.push_back(&rec);
    }
    std::sort(order.begin(), order.end(), [](auto * a, auto * b) { return a->il < b->il; });
    for (size_t i = 0; i < order.size() && i < n_max; ++i) {
        const auto & rec = *order[i];
        if (layers != nullptr) {
            layers[i] = { rec.il, rec.tensor.c_str(), (int32_t) rec.prefill.size() };
        }
        if (counts != nullptr) {
            uint64_t * row = counts + i*2*(size_t) n_expert_max;
            std::fill(row, row + 2*(size_t) n_expert_max, 0);
            for (size_t e = 0; e < rec.prefill.size() && (int32_t) e < n_expert_max; ++e) {
                row[e]                = rec.prefill[e];
                row[n_expert_max + e] = rec.decode[e];
            }
        }
    }
    if (n_tokens != nullptr) {
        n_tokens[0] = cache.n_record_prefill;
        n_tokens[1] = cache.n_record_decode;
    }
    if (reset) {
        for (auto * rec : order) {
            std::fill(rec->prefill.begin(), rec->prefill.end(), 0);
            std::fill(rec->decode.begin(),  rec->decode.end(),  0);
        }
        cache.n_record_prefill = 0;
        cache.n_record_decode  = 0;
    }
    return order.size();
}
