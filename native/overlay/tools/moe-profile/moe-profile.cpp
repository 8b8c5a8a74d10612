// llama-moe-profile: record which experts the router of a MoE model selects.
//
// For each prompt: prefill, then generate -n tokens (greedy, or seeded sampling with --temp > 0),
// recording for every MoE layer the expert ids used by its expert down-projection, separately
// for prefill and generation. The result is a GGUF "moe profile" (format: native/PROFILE-FORMAT.md
// in the moeplug repository), read by moeplug and by the expert slot cache.
//
// The ids are read from the MUL_MAT_ID of the expert down weight (ffn_down_exps / ffn_down_chexps),
// not from the router's top-k node: asking for the top-k node would split the graph inside the
// fused router kernels. Keying by weight name also covers copies made by the scheduler.
//
// Models with MTP (NextN) blocks: the MTP head is run teacher-forced in a second context, fed
// the pair (token p+1, trunk hidden state p) after every trunk batch, as the MTP draft would see
// it. Its MoE layer then routes every token but the first of each prompt, in step with the trunk.

#include "../src/llama-ext.h"  // llama_set_embeddings_nextn, llama_get_embeddings_nextn_ith (staging API)

#include "arg.h"
#include "common.h"
#include "gguf.h"
#include "ggml-cpp.h"
#include "log.h"
#include "moeplug-cache.h"
#include "llama.h"
#include "sampling.h"

#include <algorithm>
#include <clocale>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>


enum moe_phase {
    MOE_PHASE_PREFILL = 0,
    MOE_PHASE_DECODE  = 1,
};

struct moe_tensor_record {
    bool                 mtp      = false;  // routed by the MTP head: no row for a prompt's first token
    int64_t              n_expert = 0;
    int64_t              n_used   = 0;
    std::vector<int32_t> counts[2];  // [phase][expert]
    std::vector<int16_t> seq;        // n_used ids per recorded token, in token order
};

struct moe_profiler {
    moe_phase phase = MOE_PHASE_PREFILL;
    bool      failed = false;
    std::string error;

    std::map<std::string, moe_tensor_record> tensors;  // key: expert down weight name
    std::vector<std::string>                 order;    // first-seen order of the keys

    std::vector<uint8_t> buf;
};

// the eval callback's user data: which context is computing
struct moe_cb_source {
    moe_profiler * prof;
    bool           mtp;
};

// weight names may be decorated by the scheduler as "<backend>#<name>#<copy>"
static std::string moe_weight_name(const char * name) {
    const char * p = strchr(name, '#');
    if (p == nullptr) {
        return name;
    }
    p++;
    const char * q = strchr(p, '#');
    return q ? std::string(p, q - p) : std::string(p);
}

static bool ends_with(const std::string & s, const std::string & suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

static bool moe_is_expert_down(const std::string & wname) {
    return ends_with(wname, "ffn_down_exps.weight") || ends_with(wname, "ffn_down_chexps.weight");
}

static bool moe_profile_cb_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    const auto * src  = (const moe_cb_source *) user_data;
    moe_profiler * prof = src->prof;

    if (t->op != GGML_OP_MUL_MAT_ID || !moe_is_expert_down(moe_weight_name(t->src[0]->name))) {
        return !ask;  // not ours: do not split the graph here, and keep computing
    }
    if (ask) {
        return true;
    }

    const std::string     wname = moe_weight_name(t->src[0]->name);
    const ggml_tensor   * ids   = t->src[2];
    const int64_t n_expert = t->src[0]->ne[2];
    const int64_t n_used   = ids->ne[0];
    const int64_t n_tokens = ids->ne[1];

    auto it = prof->tensors.find(wname);
    if (it == prof->tensors.end()) {
        moe_tensor_record rec;
        rec.mtp      = src->mtp;
        rec.n_expert = n_expert;
        rec.n_used   = n_used;
        rec.counts[MOE_PHASE_PREFILL].assign(n_expert, 0);
        rec.counts[MOE_PHASE_DECODE ].assign(n_expert, 0);
        it = prof->tensors.emplace(wname, std::move(rec)).first;
        prof->order.push_back(wname);
    }
    moe_tensor_record & rec = it->second;
    if (rec.n_used != n_used || rec.n_expert != n_expert) {
        prof->failed = true;
        prof->error  = "inconsistent ids shape for " + wname;
        return true;
    }

    // ids is a (possibly strided) view: copy its whole span, then index with its strides
    prof->buf.resize(ggml_nbytes(ids));
    ggml_backend_tensor_get(ids, prof->buf.data(), 0, ggml_nbytes(ids));

    for (int64_t i1 = 0; i1 < n_tokens; ++i1) {
        for (int64_t i0 = 0; i0 < n_used; ++i0) {
            const int32_t id = *(const int32_t *) (prof->buf.data() + i1*ids->nb[1] + i0*ids->nb[0]);
            if (id < 0 || id >= n_expert) {
                prof->failed = true;
                prof->error  = "expert id out of range in " + wname;
                return true;
            }
            rec.counts[prof->phase][id]++;
            rec.seq.push_back((int16_t) id);
        }
    }
    return true;
}

// prompts are separated by lines holding only "---"
static std::vector<std::string> moe_read_prompts(const std::string & path) {
    std::ifstream f(path);
    if (!f) {
        throw std::runtime_error("cannot open prompts file " + path);
    }
    std::vector<std::string> prompts;
    std::string cur;
    std::string line;
    auto flush = [&]() {
        const size_t b = cur.find_first_not_of(" \t\r\n");
        if (b != std::string::npos) {
            const size_t e = cur.find_last_not_of(" \t\r\n");
            prompts.push_back(cur.substr(b, e - b + 1));
        }
        cur.clear();
    };
    while (std::getline(f, line)) {
        if (line == "---" || line == "---\r") {
            flush();
        } else {
            cur += line + "\n";
        }
    }
    flush();
    return prompts;
}

struct moe_token_meta {
    int32_t prompt;
    int32_t pos;
    int32_t phase;
};

static bool moe_write_profile(const std::string & out, const common_moeplug_fingerprint & fp, const moe_profiler & prof,
        const std::vector<moe_token_meta> & tokens, const std::vector<std::string> & prompt_labels,
        const std::string & source, const common_params & params) {
    const int64_t n_tensors = (int64_t) prof.order.size();
    const int64_t n_expert  = prof.tensors.at(prof.order[0]).n_expert;
    const int64_t n_used    = prof.tensors.at(prof.order[0]).n_used;
    const int64_t n_steps   = (int64_t) tokens.size();

    int64_t n_prefill = 0;
    for (const auto & t : tokens) {
        n_prefill += t.phase == MOE_PHASE_PREFILL;
    }

    const size_t data_size = 2*n_expert*n_tensors*sizeof(int32_t) + n_used*n_tensors*n_steps*sizeof(int16_t) +
                             3*n_steps*sizeof(int32_t) + 8*ggml_tensor_overhead();
    ggml_init_params cp = { /*.mem_size =*/ data_size, /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ false };
    ggml_context_ptr ctx_ptr { ggml_init(cp) };
    gguf_context_ptr g_ptr { gguf_init_empty() };
    ggml_context * ctx = ctx_ptr.get();
    gguf_context * g   = g_ptr.get();

    gguf_set_val_str(g, "general.type", "moe-profile");
    gguf_set_val_u32(g, "moe_profile.version", COMMON_MOEPLUG_PROFILE_VERSION);
    common_moeplug_fingerprint_write(g, fp);
    common_moeplug_set_arr_str(g, "moe_profile.tensors", prof.order);
    gguf_set_val_u64(g, "moe_profile.tokens.prefill", (uint64_t) n_prefill);
    gguf_set_val_u64(g, "moe_profile.tokens.decode", (uint64_t) (n_steps - n_prefill));
    common_moeplug_set_arr_str(g, "moe_profile.sources", { source });
    common_moeplug_set_arr_str(g, "moe_profile.source.0.prompt_labels", prompt_labels);
    gguf_set_val_u32(g, "moe_profile.source.0.n_predict", (uint32_t) params.n_predict);
    gguf_set_val_u32(g, "moe_profile.source.0.seed", params.sampling.seed);
    gguf_set_val_f32(g, "moe_profile.source.0.temp", params.sampling.temp);

    ggml_tensor * cnt[2];
    cnt[MOE_PHASE_PREFILL] = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_expert, n_tensors);
    cnt[MOE_PHASE_DECODE ] = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_expert, n_tensors);
    ggml_set_name(cnt[MOE_PHASE_PREFILL], "counts.prefill");
    ggml_set_name(cnt[MOE_PHASE_DECODE ], "counts.decode");
    ggml_tensor * seq  = ggml_new_tensor_3d(ctx, GGML_TYPE_I16, n_used, n_tensors, n_steps);
    ggml_tensor * meta = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 3, n_steps);
    ggml_set_name(seq,  "seq.0");
    ggml_set_name(meta, "seq_meta.0");

    for (int64_t it = 0; it < n_tensors; ++it) {
        const moe_tensor_record & rec = prof.tensors.at(prof.order[it]);
        for (int ph = 0; ph < 2; ++ph) {
            memcpy((int32_t *) cnt[ph]->data + it*n_expert, rec.counts[ph].data(), n_expert*sizeof(int32_t));
        }
        int64_t row = 0;
        for (int64_t s = 0; s < n_steps; ++s) {
            int16_t * dst = (int16_t *) seq->data + (s*n_tensors + it)*n_used;
            if (rec.mtp && tokens[s].pos == 0) {
                std::fill(dst, dst + n_used, (int16_t) -1);  // the MTP head has no input for a first token
                continue;
            }
            memcpy(dst, rec.seq.data() + row*n_used, n_used*sizeof(int16_t));
            row++;
        }
    }
    for (int64_t s = 0; s < n_steps; ++s) {
        int32_t * m = (int32_t *) meta->data + 3*s;
        m[0] = tokens[s].prompt;
        m[1] = tokens[s].pos;
        m[2] = tokens[s].phase;
    }
    gguf_add_tensor(g, cnt[MOE_PHASE_PREFILL]);
    gguf_add_tensor(g, cnt[MOE_PHASE_DECODE]);
    if (n_steps > 0) {
        gguf_add_tensor(g, seq);
        gguf_add_tensor(g, meta);
    }

    // write beside the destination, then rename: a reader never sees half a profile
    const std::string tmp = out + ".tmp";
    const bool ok = gguf_write_to_file(g, tmp.c_str(), false) && std::rename(tmp.c_str(), out.c_str()) == 0;
    if (!ok) {
        std::remove(tmp.c_str());
    }
    return ok;
}

static void moe_batch_add(llama_batch & batch, llama_token id, llama_pos pos, bool output) {
    const int i = batch.n_tokens++;
    batch.token[i]     = id;
    batch.pos[i]       = pos;
    batch.n_seq_id[i]  = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i]    = output;
}

// The MTP head, run teacher-forced: after each trunk batch it gets (token i+1, trunk state i) for
// every row, plus (first token, last state of the previous batch).
struct moe_mtp_head {
    llama_context *    ctx = nullptr;
    common_batch       batch;
    int32_t            n_embd = 0;
    std::vector<float> pending_h;  // the previous batch's last hidden state

    void reset() {
        llama_memory_clear(llama_get_memory(ctx), true);
        pending_h.clear();
    }

    bool feed(llama_context * ctx_trunk, const llama_batch & trunk) {
        batch.clear();
        if (!pending_h.empty()) {
            const int32_t idx = batch.add(trunk.token[0], trunk.pos[0], 0, false);
            batch.set_embd(idx, { pending_h.data(), 1, (size_t) n_embd });
        }
        for (int32_t i = 0; i < trunk.n_tokens; ++i) {
            const float * h = llama_get_embeddings_nextn_ith(ctx_trunk, i);
            if (h == nullptr) {
                return false;
            }
            if (i + 1 == trunk.n_tokens) {
                pending_h.assign(h, h + n_embd);
                break;
            }
            const int32_t idx = batch.add(trunk.token[i + 1], trunk.pos[i + 1], 0, false);
            batch.set_embd(idx, { h, 1, (size_t) n_embd });
        }
        return batch.size() == 0 || llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch.get()) == 0;
    }
};

struct moe_args {
    std::string prompts_file;
    int         random_prompts = 0; // --random K:N, instead of a prompts file
    int         random_len     = 0;
    std::string out  = "moe-profile.gguf";
    std::string label;
    bool        chat   = false;
    bool        no_mtp = false;
};

// printed with fprintf: it can run before common_init() has set up llama.cpp's logging
static void moe_usage(int /*argc*/, char ** argv) {
    fprintf(stderr,
        "\nusage: %s -m MODEL (--prompts FILE | --random K:N) [--out FILE] [--label NAME] [--chat] [-n N] [llama.cpp options]\n\n"
        "  --prompts FILE   prompts separated by lines holding only '---'\n"
        "  --random K:N     K prompts of N token ids drawn uniformly from the vocabulary (seeded by -s), and random\n"
        "                   tokens in decode too: the workload llama-bench runs\n"
        "  --out FILE       profile to write (default: moe-profile.gguf)\n"
        "  --label NAME     label of this run, e.g. codeish (default: the prompts file's name)\n"
        "  --chat           wrap each prompt in the model's chat template as a user turn\n"
        "  --no-mtp         do not run the MTP (NextN) head of a model that has one\n"
        "  -n N             tokens generated per prompt (default: 512); --temp 0 is greedy, else seeded by -s;\n"
        "                   generation stops at an end-of-generation token unless --ignore-eos\n\n",
        argv[0]);
}

// take our own options out of argv; the rest goes to llama.cpp's common parser
static bool moe_parse_own_args(int & argc, char ** argv, moe_args & a) {
    int out = 1;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&](std::string & dst) {
            if (i + 1 >= argc) {
                throw std::invalid_argument("missing value for " + arg);
            }
            dst = argv[++i];
        };
        if (arg == "--prompts") {
            value(a.prompts_file);
        } else if (arg == "--random") {
            std::string v;
            value(v);
            if (sscanf(v.c_str(), "%d:%d", &a.random_prompts, &a.random_len) != 2 || a.random_prompts < 1 || a.random_len < 1) {
                throw std::invalid_argument("--random " + v + ": give K:N, K prompts of N tokens");
            }
        } else if (arg == "--out") {
            value(a.out);
        } else if (arg == "--label") {
            value(a.label);
        } else if (arg == "--chat") {
            a.chat = true;
        } else if (arg == "--no-mtp") {
            a.no_mtp = true;
        } else {
            argv[out++] = argv[i];
        }
    }
    argc = out;
    return !a.prompts_file.empty() || a.random_prompts > 0;
}

static std::string moe_apply_chat(const llama_model * model, const std::string & prompt) {
    const char * tmpl = llama_model_chat_template(model, nullptr);
    if (tmpl == nullptr) {
        return prompt;
    }
    llama_chat_message msg = { "user", prompt.c_str() };
    std::vector<char> buf(prompt.size()*2 + 1024);
    int32_t n = llama_chat_apply_template(tmpl, &msg, 1, true, buf.data(), (int32_t) buf.size());
    if (n > (int32_t) buf.size()) {
        buf.resize(n);
        n = llama_chat_apply_template(tmpl, &msg, 1, true, buf.data(), (int32_t) buf.size());
    }
    return n < 0 ? prompt : std::string(buf.data(), n);
}

static int moe_profile_main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");

    moe_args a;
    try {
        if (!moe_parse_own_args(argc, argv, a)) {
            moe_usage(argc, argv);
            return 1;
        }
    } catch (const std::exception & e) {
        fprintf(stderr, "%s: %s\n", __func__, e.what());
        return 1;
    }

    common_params params;
    params.n_predict = 512;
    params.sampling.temp = 0.0f;
    common_init();
    if (!common_params_parse(argc, argv, params, LLAMA_EXAMPLE_COMMON, moe_usage)) {
        return 1;
    }

    std::vector<std::string> prompts;
    common_moeplug_fingerprint fp;
    try {
        prompts = a.random_prompts > 0 ? std::vector<std::string>(a.random_prompts) : moe_read_prompts(a.prompts_file);
        fp      = common_moeplug_fingerprint_of(params.model.path);
    } catch (const std::exception & e) {
        LOG_ERR("%s: %s\n", __func__, e.what());
        return 1;
    }
    if (prompts.empty()) {
        LOG_ERR("%s: no prompts in %s\n", __func__, a.prompts_file.c_str());
        return 1;
    }
    if (!params.moeplug.cache_profile.empty()) {
        // the slots would hide the resident experts' ids from the recording
        LOG_ERR("%s: profile without --moe-cache-profile: the cache changes what is recorded\n", __func__);
        return 1;
    }
    if (!params.moeplug.route_replay.empty()) {
        // the profile records the router's own decisions
        LOG_ERR("%s: profile without --moe-route-replay: the replay replaces the router being recorded\n", __func__);
        return 1;
    }
    if (a.label.empty()) {
        a.label = a.random_prompts > 0 ? "random" : a.prompts_file.substr(a.prompts_file.find_last_of('/') + 1);
    }

    llama_backend_init();
    llama_numa_init(params.numa);

    moe_profiler  prof;
    moe_cb_source src_trunk = { &prof, false };
    moe_cb_source src_mtp   = { &prof, true  };
    params.cb_eval           = moe_profile_cb_eval;
    params.cb_eval_user_data = &src_trunk;
    params.warmup            = false;  // a warm-up run would be recorded too
    params.load_mtp          = fp.n_nextn > 0 && !a.no_mtp;

    auto init = common_init_from_params(params);
    llama_model   * model = init->model();
    llama_context * ctx   = init->context();
    if (model == nullptr || ctx == nullptr) {
        LOG_ERR("%s: failed to load the model\n", __func__);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_ctx   = (int) llama_n_ctx(ctx);

    moe_mtp_head mtp;
    llama_context_ptr mtp_ctx;
    if (params.load_mtp && llama_model_n_layer_nextn(model) > 0) {
        llama_context_params cparams = common_context_params_to_llama(params);
        cparams.ctx_type          = LLAMA_CONTEXT_TYPE_MTP;
        cparams.n_rs_seq          = 0;
        cparams.cb_eval_user_data = &src_mtp;
        mtp_ctx.reset(llama_init_from_model(model, cparams));
        if (!mtp_ctx) {
            LOG_ERR("%s: failed to create the MTP context\n", __func__);
            return 1;
        }
        mtp.ctx    = mtp_ctx.get();
        mtp.n_embd = llama_model_n_embd_out(model);
        mtp.batch  = common_batch(mtp.ctx);
        llama_set_embeddings_nextn(ctx, true, /*masked =*/ false);
        LOG_INF("%s: running the MTP head (%d NextN layer(s)) teacher-forced\n", __func__, llama_model_n_layer_nextn(model));
    }
    const int n_batch = (int) llama_n_batch(ctx);

    std::vector<moe_token_meta> tokens;
    std::vector<std::string>    labels;
    common_sampler * smpl = common_sampler_init(model, params.sampling);
    llama_batch batch = llama_batch_init(std::max(n_batch, 1), 0, 1);

    std::mt19937 rng(params.sampling.seed);
    std::uniform_int_distribution<llama_token> random_token(0, llama_vocab_n_tokens(vocab) - 1);

    for (size_t ip = 0; ip < prompts.size() && !prof.failed; ++ip) {
        std::vector<llama_token> toks;
        if (a.random_prompts > 0) {
            for (int i = 0; i < a.random_len; ++i) {
                toks.push_back(random_token(rng));
            }
        } else {
            const std::string text = a.chat ? moe_apply_chat(model, prompts[ip]) : prompts[ip];
            toks = common_tokenize(ctx, text, llama_vocab_get_add_bos(vocab), true);
        }
        if (toks.empty()) {
            continue;
        }
        if ((int) toks.size() + params.n_predict > n_ctx) {
            LOG_WRN("%s: prompt %zu: %zu tokens + %d to generate exceed the context (%d); truncating the prompt\n",
                    __func__, ip, toks.size(), params.n_predict, n_ctx);
            toks.resize(std::max(1, n_ctx - params.n_predict));
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        if (mtp.ctx) {
            mtp.reset();
        }
        common_sampler_reset(smpl);
        labels.push_back(a.label);

        // prefill: every token is an output, so every layer routes every token
        prof.phase = MOE_PHASE_PREFILL;
        int pos = 0;
        for (size_t i0 = 0; i0 < toks.size(); i0 += n_batch) {
            batch.n_tokens = 0;
            const size_t n = std::min(toks.size() - i0, (size_t) n_batch);
            for (size_t i = 0; i < n; ++i) {
                moe_batch_add(batch, toks[i0 + i], pos, true);
                tokens.push_back({ (int32_t) ip, pos, MOE_PHASE_PREFILL });
                pos++;
            }
            if (llama_decode(ctx, batch) != 0 || (mtp.ctx && !mtp.feed(ctx, batch))) {
                LOG_ERR("%s: prefill of prompt %zu failed\n", __func__, ip);
                return 1;
            }
        }

        prof.phase = MOE_PHASE_DECODE;
        for (int i = 0; i < params.n_predict && !prof.failed; ++i) {
            const llama_token tok = a.random_prompts > 0 ? random_token(rng) : common_sampler_sample(smpl, ctx, batch.n_tokens - 1);
            if (a.random_prompts == 0) {
                common_sampler_accept(smpl, tok, true);
                if (llama_vocab_is_eog(vocab, tok) && !params.sampling.ignore_eos) {
                    break;
                }
            }
            batch.n_tokens = 0;
            moe_batch_add(batch, tok, pos, true);
            tokens.push_back({ (int32_t) ip, pos, MOE_PHASE_DECODE });
            pos++;
            if (llama_decode(ctx, batch) != 0 || (mtp.ctx && !mtp.feed(ctx, batch))) {
                LOG_ERR("%s: decode of prompt %zu failed\n", __func__, ip);
                return 1;
            }
        }
        LOG_INF("%s: prompt %zu/%zu: %d tokens recorded\n", __func__, ip + 1, prompts.size(), pos);
    }
    llama_batch_free(batch);
    common_sampler_free(smpl);

    if (prof.failed) {
        LOG_ERR("%s: %s\n", __func__, prof.error.c_str());
        return 1;
    }
    if (prof.order.empty()) {
        LOG_ERR("%s: no expert down-projection ran: not a MoE model?\n", __func__);
        return 1;
    }
    const int64_t n_first = std::count_if(tokens.begin(), tokens.end(), [](const moe_token_meta & t) { return t.pos == 0; });
    for (const auto & name : prof.order) {
        const auto & rec = prof.tensors.at(name);
        const int64_t expected = (int64_t) tokens.size() - (rec.mtp ? n_first : 0);
        if ((int64_t) rec.seq.size() != rec.n_used * expected) {
            LOG_ERR("%s: %s routed %zu token slots, expected %lld\n", __func__, name.c_str(), rec.seq.size(),
                    (long long) (rec.n_used * expected));
            return 1;
        }
    }
    if (!moe_write_profile(a.out, fp, prof, tokens, labels, a.label, params)) {
        LOG_ERR("%s: cannot write %s\n", __func__, a.out.c_str());
        return 1;
    }
    LOG_INF("%s: wrote %s: %zu expert tensors, %zu tokens\n", __func__, a.out.c_str(), prof.order.size(), tokens.size());

    llama_backend_free();
    return 0;
}

int main(int argc, char ** argv) {
    const int rc = moe_profile_main(argc, argv);
    // the log is written by a worker thread: drain it, so that an error printed just before
    // returning is not lost
    common_log_pause(common_log_main());
    return rc;
}
