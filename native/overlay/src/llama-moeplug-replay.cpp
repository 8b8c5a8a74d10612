#include "llama-moeplug-replay.h"

#include "llama-batch.h"
#include "llama-ext.h"
#include "llama-moeplug-ext.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "gguf.h"

#include <cstring>
#include <stdexcept>

namespace {

// one graph's replayed inputs: the selected experts (and weights) of every replayed block
class llm_graph_input_moeplug_replay : public llm_graph_input_i {
public:
    explicit llm_graph_input_moeplug_replay(const llama_moeplug_replay & replay) : replay(replay) {}

    void set_input(const llama_ubatch * ubatch) override;

    bool can_reuse(const llm_graph_params & params) override {
        return params.ubatch.n_tokens == n_tokens;
    }

    struct layer_input {
        int           row;    // of the file
        ggml_tensor * ids;    // I32 [n_expert_used, n]
        ggml_tensor * weights; // F32 [1, n_expert_used, n], or nullptr
    };

    const llama_moeplug_replay & replay;
    int64_t                  n_tokens = 0; // of the ubatch the graph was built for
    std::vector<layer_input> layers;
};

void llm_graph_input_moeplug_replay::set_input(const llama_ubatch * ubatch) {
    const int64_t n = ubatch->n_tokens;

    // the file row of every token, and of the tokens that give outputs (the last layer computes
    // only those rows, in this order: llm_graph_input_out_ids)
    std::vector<int64_t> rows(n);
    std::vector<int64_t> rows_out;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t seq = ubatch->seq_id && ubatch->seq_id[i] ? ubatch->seq_id[i][0] : 0;
        rows[i] = replay.row(seq, ubatch->pos[i]);
        if (ubatch->output && ubatch->output[i]) {
            rows_out.push_back(rows[i]);
        }
    }

    const int64_t k = replay.n_expert_used;
    std::vector<int32_t> ids;
    std::vector<float>   w;
    for (const auto & l : layers) {
        const int64_t m = l.ids->ne[1];
        const std::vector<int64_t> & src = m == n ? rows : rows_out;
        GGML_ASSERT((int64_t) src.size() == m);
        ids.resize(m*k);
        for (int64_t t = 0; t < m; ++t) {
            memcpy(ids.data() + t*k, replay.experts.data() + (src[t]*replay.n_layer + l.row)*k, k*sizeof(int32_t));
        }
        ggml_backend_tensor_set(l.ids, ids.data(), 0, ggml_nbytes(l.ids));
        if (l.weights) {
            w.resize(m*k);
            for (int64_t t = 0; t < m; ++t) {
                memcpy(w.data() + t*k, replay.weights.data() + (src[t]*replay.n_layer + l.row)*k, k*sizeof(float));
            }
            ggml_backend_tensor_set(l.weights, w.data(), 0, ggml_nbytes(l.weights));
        }
    }
}

// this graph's replay input, made on the first replayed block
llm_graph_input_moeplug_replay & moe_replay_input(const llm_graph_context & g, const llama_moeplug_replay & replay) {
    for (auto & inp : g.res->inputs) {
        if (auto * r = dynamic_cast<llm_graph_input_moeplug_replay *>(inp.get())) {
            return *r;
        }
    }
    auto inp = std::make_unique<llm_graph_input_moeplug_replay>(replay);
    inp->n_tokens = g.ubatch.n_tokens;
    return *static_cast<llm_graph_input_moeplug_replay *>(g.res->add_input(std::move(inp)));
}

uint32_t moe_get_u32(const gguf_context * g, const std::string & path, const char * key) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) {
        throw std::runtime_error(path + " has no key " + key);
    }
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_UINT32) {
        throw std::runtime_error(path + ": key " + key + " is not a u32");
    }
    return gguf_get_val_u32(g, id);
}

} // namespace

int64_t llama_moeplug_replay::row(int32_t seq, int32_t pos) const {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = prompt_of_seq.find(seq);
    if (it == prompt_of_seq.end() || pos == 0) {
        const int32_t p = next_prompt;
        next_prompt = (next_prompt + 1) % n_prompts();
        it = prompt_of_seq.insert_or_assign(seq, p).first;
    }
    const int32_t p   = it->second;
    const int64_t len = offsets[p + 1] - offsets[p];
    return offsets[p] + (pos < 0 ? 0 : pos) % len;
}

void llama_moeplug_replay::reset() const {
    std::lock_guard<std::mutex> lock(mutex);
    prompt_of_seq.clear();
    next_prompt = 0;
}

ggml_tensor * llama_moeplug_replay::build_selected(const llm_graph_context & g, int il, int64_t n_tokens) const {
    if (il < 0 || il >= (int) moe_index.size() || moe_index[il] < 0) {
        return nullptr;
    }
    auto & inp = moe_replay_input(g, *this);
    ggml_tensor * ids = ggml_new_tensor_2d(g.ctx0, GGML_TYPE_I32, n_expert_used, n_tokens);
    ggml_set_input(ids);
    ggml_format_name(ids, "moe_replay_ids-%d", il);
    ggml_tensor * w = nullptr;
    if (!weights.empty()) {
        w = ggml_new_tensor_3d(g.ctx0, GGML_TYPE_F32, 1, n_expert_used, n_tokens);
        ggml_set_input(w);
        ggml_format_name(w, "moe_replay_weights-%d", il);
    }
    inp.layers.push_back({ moe_index[il], ids, w });
    return ids;
}

ggml_tensor * llama_moeplug_replay::build_weights(const llm_graph_context & g, int il, ggml_tensor * weights_in) const {
    GGML_UNUSED(g);
    if (weights.empty() || il < 0 || il >= (int) moe_index.size() || moe_index[il] < 0) {
        return weights_in;
    }
    for (const auto & inp : g.res->inputs) {
        if (const auto * r = dynamic_cast<const llm_graph_input_moeplug_replay *>(inp.get())) {
            for (const auto & l : r->layers) {
                if (l.row == moe_index[il] && l.weights && l.weights->ne[2] == weights_in->ne[2]) {
                    return l.weights;
                }
            }
        }
    }
    return weights_in;
}

std::unique_ptr<llama_moeplug_replay> llama_moeplug_replay_load(const llama_model & model, const std::string & path) {
    ggml_context * ctx_raw = nullptr;
    gguf_init_params ip = { /*.no_alloc =*/ false, /*.ctx =*/ &ctx_raw };
    gguf_context_ptr gp { gguf_init_from_file(path.c_str(), ip) };
    ggml_context_ptr ctx { ctx_raw };
    if (!gp) {
        throw std::runtime_error("cannot read " + path + " (missing, truncated or not GGUF)");
    }
    const gguf_context * g = gp.get();

    const int64_t type_id = gguf_find_key(g, "general.type");
    if (type_id < 0 || gguf_get_kv_type(g, type_id) != GGUF_TYPE_STRING || strcmp(gguf_get_val_str(g, type_id), "moe-route-replay") != 0) {
        throw std::runtime_error(path + " is not a moe route replay file");
    }
    const uint32_t version = moe_get_u32(g, path, "moe_replay.version");
    if (version != MOEPLUG_REPLAY_VERSION) {
        throw std::runtime_error(format("%s is a version %u replay file; this build reads version %u", path.c_str(), version, MOEPLUG_REPLAY_VERSION));
    }

    auto r = std::make_unique<llama_moeplug_replay>();
    r->path          = path;
    r->n_layer       = (int32_t) moe_get_u32(g, path, "moe_replay.n_layer");
    r->n_expert      = (int32_t) moe_get_u32(g, path, "moe_replay.n_expert");
    r->n_expert_used = (int32_t) moe_get_u32(g, path, "moe_replay.n_expert_used");
    const uint32_t n_prompts = moe_get_u32(g, path, "moe_replay.n_prompts");
    const uint32_t n_tokens  = moe_get_u32(g, path, "moe_replay.n_tokens");

    // the model's MoE blocks, the MTP (NextN) ones aside: they keep their router
    const auto & hp = model.hparams;
    const int n_trunk = (int) hp.n_layer();
    std::vector<int32_t> moe_blocks;
    for (int il = 0; il < n_trunk && il < (int) model.layers.size(); ++il) {
        if (model.layers[il].ffn_down_exps != nullptr) {
            moe_blocks.push_back(il);
        }
    }
    std::string diff;
    auto check = [&](const char * what, int64_t file, int64_t mdl) {
        if (file != mdl) {
            diff += format("%s%s %lld in the file, %lld in the model", diff.empty() ? "" : ", ", what, (long long) file, (long long) mdl);
        }
    };
    check("MoE layers", r->n_layer, (int64_t) moe_blocks.size());
    check("experts", r->n_expert, hp.n_expert);
    check("experts per token", r->n_expert_used, moe_blocks.empty() ? 0 : hp.n_expert_used(moe_blocks[0]));
    if (!diff.empty()) {
        throw std::runtime_error(path + " does not match the model: " + diff);
    }

    const ggml_tensor * te = ggml_get_tensor(ctx.get(), "replay.experts");
    const ggml_tensor * tw = ggml_get_tensor(ctx.get(), "replay.weights");
    const ggml_tensor * to = ggml_get_tensor(ctx.get(), "replay.offsets");
    if (te == nullptr || to == nullptr) {
        throw std::runtime_error(path + " has no " + (te == nullptr ? "replay.experts" : "replay.offsets") + " tensor");
    }
    if (te->type != GGML_TYPE_I32 || te->ne[0] != r->n_expert_used || te->ne[1] != r->n_layer || te->ne[2] != n_tokens || te->ne[3] != 1) {
        throw std::runtime_error(path + ": replay.experts is not I32 [n_expert_used, n_layer, n_tokens]");
    }
    if (tw != nullptr && (tw->type != GGML_TYPE_F32 || !ggml_are_same_shape(te, tw))) {
        throw std::runtime_error(path + ": replay.weights is not F32 of replay.experts' shape");
    }
    if (to->type != GGML_TYPE_I32 || ggml_nelements(to) != (int64_t) n_prompts + 1 || n_prompts == 0) {
        throw std::runtime_error(path + ": replay.offsets is not I32 [n_prompts + 1]");
    }

    r->offsets.assign((const int32_t *) to->data, (const int32_t *) to->data + n_prompts + 1);
    if (r->offsets.front() != 0 || r->offsets.back() != (int32_t) n_tokens) {
        throw std::runtime_error(path + ": replay.offsets do not run from 0 to n_tokens");
    }
    for (uint32_t p = 0; p < n_prompts; ++p) {
        if (r->offsets[p + 1] <= r->offsets[p]) {
            throw std::runtime_error(format("%s: prompt %u has no tokens (offsets must increase)", path.c_str(), p));
        }
    }
    r->experts.assign((const int32_t *) te->data, (const int32_t *) te->data + ggml_nelements(te));
    for (size_t i = 0; i < r->experts.size(); ++i) {
        if (r->experts[i] < 0 || r->experts[i] >= r->n_expert) {
            throw std::runtime_error(format("%s: expert id %d at token %zu is outside [0, %d)", path.c_str(), r->experts[i],
                i / (size_t) (r->n_layer*r->n_expert_used), r->n_expert));
        }
    }
    if (tw != nullptr) {
        r->weights.assign((const float *) tw->data, (const float *) tw->data + ggml_nelements(tw));
    }

    r->moe_index.assign(model.layers.size(), -1);
    for (size_t l = 0; l < moe_blocks.size(); ++l) {
        r->moe_index[moe_blocks[l]] = (int32_t) l;
    }
    return r;
}

bool llama_model_moeplug_replay_init(llama_model * model, const char * path, llama_moeplug_replay_result * result) {
    *result = {};
    try {
        model->moeplug_replay = llama_moeplug_replay_load(*model, path);
    } catch (const std::exception & err) {
        snprintf(result->reason, sizeof(result->reason), "%s", err.what());
        return false;
    }
    const auto & r = *model->moeplug_replay;
    result->n_prompts     = r.n_prompts();
    result->n_tokens      = r.n_tokens();
    result->n_layer       = r.n_layer;
    result->n_expert      = r.n_expert;
    result->n_expert_used = r.n_expert_used;
    result->has_weights   = !r.weights.empty();
    return true;
}

void llama_model_moeplug_replay_reset(const llama_model * model) {
    if (model->moeplug_replay) {
        model->moeplug_replay->reset();
    }
}
