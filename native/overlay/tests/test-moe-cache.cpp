// test-moe-cache: a model with the expert slot cache gives the same logits as without it, bitwise.
//
//   test-moe-cache -m MODEL --moe-cache-profile PROFILE --moe-cache-slots N [-ub U] [-n N_GEN]
//
// Loads the model twice, once stock and once with the cache (common_moeplug_cache_init, as
// llama-server does), processes 100 random prompt tokens in ubatches of -ub with every logit
// output, then generates -n tokens greedily with both, one token per batch. Every logit of every
// step must be bitwise equal, and so every token. Run it with LLAMA_MOE_CACHE_DEVICE=CPU on a CPU
// build (the slots then live on the CPU with the source's buffer type), and with
// LLAMA_MOE_CACHE_NO_RESIDENT=1 for a cache whose maps keep every expert on the source weights.
//
// --ref-full-offload: the reference model keeps every expert on the GPU (no -ot/--cpu-moe), for
// "all experts resident == stock full offload" on a GPU build.
//
// --fidelity K: where bitwise equality is not expected (slots on the GPU, other experts on the
// CPU: two kernels), measures instead how far the cache is from the placement given (e.g.
// --cpu-moe) and compares it with how far stock full offload is from it. For K random prompts the
// reference generates -n tokens greedily; stock full offload and the cache are run teacher-forced
// on the same tokens, one per batch. Prints, for both, the share of steps whose top token agrees
// with the reference and the KL divergence of their next-token distributions from it; passes when
// the cache is no worse than full offload on both. Also prints the paired count (steps where only
// one of the two agrees) and McNemar's z: on a random-weight model many top tokens are near ties,
// so a small gap in agreement can be chance.

#include "arg.h"
#include "common.h"
#include "log.h"
#include "llama.h"
#include "moeplug-cache.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

struct run_state {
    llama_model   * model = nullptr;
    llama_context * ctx   = nullptr;
    ~run_state() {
        llama_free(ctx);
        llama_model_free(model);
    }
};

static bool load(run_state & st, common_params & params, bool with_cache, bool full_offload = false) {
    llama_model_params mparams = common_model_params_to_llama(params);
    if (full_offload) {
        mparams.tensor_buft_overrides = nullptr;
    }
    st.model = llama_model_load_from_file(params.model.path.c_str(), mparams);
    if (st.model == nullptr) {
        return false;
    }
    if (with_cache && !common_moeplug_cache_init(st.model, params)) {
        LOG_ERR("the cache did not engage\n");
        return false;
    }
    if (!common_moeplug_replay_init(st.model, params)) {
        return false; // both models replay the same file, each from its first prompt
    }
    st.ctx = llama_init_from_model(st.model, common_context_params_to_llama(params));
    return st.ctx != nullptr;
}

// decodes tokens from pos on; returns the logits of every token, row after row
static std::vector<float> decode(llama_context * ctx, const std::vector<llama_token> & tokens, llama_pos pos) {
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    common_batch batch(ctx);
    for (size_t i = 0; i < tokens.size(); ++i) {
        batch.add(tokens[i], pos + (llama_pos) i, 0, true);
    }
    std::vector<float> logits;
    if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch.get()) == 0) {
        for (size_t i = 0; i < tokens.size(); ++i) {
            const float * row = llama_get_logits_ith(ctx, (int32_t) i);
            logits.insert(logits.end(), row, row + n_vocab);
        }
    }
    return logits;
}

// index of the first difference in bits, or -1
static int64_t first_difference(const std::vector<float> & a, const std::vector<float> & b) {
    if (a.size() != b.size()) {
        return 0;
    }
    for (size_t i = 0; i < a.size(); ++i) {
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            return (int64_t) i;
        }
    }
    return -1;
}

static llama_token argmax_last(const std::vector<float> & logits, int n_vocab) {
    const float * row = logits.data() + logits.size() - n_vocab;
    llama_token best = 0;
    for (int i = 1; i < n_vocab; ++i) {
        if (row[i] > row[best]) {
            best = i;
        }
    }
    return best;
}

// KL(p_ref || p_got) of the softmax of two logit rows, in double precision
static double kl_divergence(const float * ref, const float * got, int n) {
    double max_r = ref[0], max_g = got[0];
    for (int i = 1; i < n; ++i) {
        max_r = std::max(max_r, (double) ref[i]);
        max_g = std::max(max_g, (double) got[i]);
    }
    double sum_r = 0.0, sum_g = 0.0;
    for (int i = 0; i < n; ++i) {
        sum_r += std::exp(ref[i] - max_r);
        sum_g += std::exp(got[i] - max_g);
    }
    const double log_zr = max_r + std::log(sum_r), log_zg = max_g + std::log(sum_g);
    double kl = 0.0;
    for (int i = 0; i < n; ++i) {
        const double lr = ref[i] - log_zr;
        kl += std::exp(lr) * (lr - (got[i] - log_zg));
    }
    return std::max(kl, 0.0);
}

struct fidelity_stats {
    int64_t n_steps  = 0;
    int64_t n_agree  = 0;
    double  kl_sum   = 0.0;
    double  kl_max   = 0.0;

    void add(const std::vector<float> & ref, const std::vector<float> & got, int n_vocab) {
        n_steps++;
        n_agree += argmax_last(ref, n_vocab) == argmax_last(got, n_vocab);
        const double kl = kl_divergence(ref.data() + ref.size() - n_vocab, got.data() + got.size() - n_vocab, n_vocab);
        kl_sum += kl;
        kl_max  = std::max(kl_max, kl);
    }
    double agreement() const { return n_steps ? (double) n_agree / n_steps : 1.0; }
    double kl_mean()   const { return n_steps ? kl_sum / n_steps : 0.0; }
};

static int run_fidelity(common_params & params, int n_prompts) {
    run_state ref, full, cached;
    if (!load(ref, params, false) || !load(full, params, false, /*full_offload =*/ true) || !load(cached, params, true)) {
        LOG_ERR("test-moe-cache: cannot load %s\n", params.model.path.c_str());
        return 1;
    }
    const int n_vocab  = llama_vocab_n_tokens(llama_model_get_vocab(ref.model));
    const int n_prompt = 32;
    fidelity_stats s_full, s_cached;
    int64_t n_only_full = 0, n_only_cached = 0; // steps where one of the two agrees with the reference
    std::mt19937 rng(42);
    for (int ip = 0; ip < n_prompts; ++ip) {
        std::vector<llama_token> prompt(n_prompt);
        for (auto & t : prompt) {
            t = (llama_token) (rng() % n_vocab);
        }
        for (run_state * st : { &ref, &full, &cached }) {
            llama_memory_clear(llama_get_memory(st->ctx), true);
        }
        std::vector<float> r = decode(ref.ctx, prompt, 0);
        std::vector<float> f = decode(full.ctx, prompt, 0);
        std::vector<float> c = decode(cached.ctx, prompt, 0);
        for (int i = 0; i <= params.n_predict; ++i) {
            if (r.empty() || f.empty() || c.empty()) {
                LOG_ERR("test-moe-cache: decode failed at prompt %d step %d\n", ip, i);
                return 1;
            }
            const llama_token top_r = argmax_last(r, n_vocab);
            const bool full_agrees = argmax_last(f, n_vocab) == top_r, cached_agrees = argmax_last(c, n_vocab) == top_r;
            n_only_full   += full_agrees && !cached_agrees;
            n_only_cached += cached_agrees && !full_agrees;
            s_full.add(r, f, n_vocab);
            s_cached.add(r, c, n_vocab);
            if (i == params.n_predict) {
                break;
            }
            const llama_token next = argmax_last(r, n_vocab); // the reference's greedy token, for all three
            r = decode(ref.ctx,    { next }, n_prompt + i);
            f = decode(full.ctx,   { next }, n_prompt + i);
            c = decode(cached.ctx, { next }, n_prompt + i);
        }
    }
    printf("test-moe-cache: fidelity over %d prompts x %d greedy tokens of the reference placement:\n", n_prompts, params.n_predict);
    for (const auto & [name, st] : { std::make_pair("stock full offload", &s_full), std::make_pair("expert cache      ", &s_cached) }) {
        printf("  %s  top-token agreement %.4f%%  mean KL %.3e  max KL %.3e\n", name, 100.0 * st->agreement(), st->kl_mean(), st->kl_max);
    }
    // McNemar on the paired steps: whether the gap in agreement is more than chance would give
    const int64_t n_disc = n_only_full + n_only_cached;
    const double z = n_disc ? (double) (n_only_cached - n_only_full) / std::sqrt((double) n_disc) : 0.0;
    printf("  paired: only full offload agrees on %lld steps, only the cache on %lld (z = %+.2f)\n",
        (long long) n_only_full, (long long) n_only_cached, z);
    const bool pass = s_cached.agreement() >= s_full.agreement() && s_cached.kl_mean() <= s_full.kl_mean();
    printf("test-moe-cache: fidelity %s\n", pass ? "PASS: the cache is within stock's own envelope" : "FAIL: the cache is further from the reference than stock full offload");
    return pass ? 0 : 1;
}

int main(int argc, char ** argv) {
    bool ref_full_offload = false;
    int n_fidelity = 0;
    int n_args = 0;
    for (int i = 0; i < argc; ++i) {
        if (strcmp(argv[i], "--ref-full-offload") == 0) {
            ref_full_offload = true;
        } else if (strcmp(argv[i], "--fidelity") == 0 && i + 1 < argc) {
            n_fidelity = atoi(argv[++i]);
        } else {
            argv[n_args++] = argv[i];
        }
    }
    argc = n_args;

    common_params params;
    params.n_predict = 128;
    params.n_ctx     = 512;
    params.n_batch   = 512;
    params.warmup    = false;
    if (!common_params_parse(argc, argv, params, LLAMA_EXAMPLE_COMMON)) {
        return 1;
    }
    common_init();
    llama_backend_init();
    if (n_fidelity > 0) {
        return run_fidelity(params, n_fidelity);
    }

    run_state stock;
    run_state cached;
    if (!load(stock, params, false, ref_full_offload) || !load(cached, params, true)) {
        LOG_ERR("test-moe-cache: cannot load %s\n", params.model.path.c_str());
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(stock.model));

    const int n_prompt = 100;
    std::mt19937 rng(42);
    std::vector<llama_token> prompt(n_prompt);
    for (auto & t : prompt) {
        t = (llama_token) (rng() % n_vocab);
    }

    std::vector<float> ref = decode(stock.ctx, prompt, 0);
    std::vector<float> got = decode(cached.ctx, prompt, 0);
    if (ref.empty() || got.empty()) {
        LOG_ERR("test-moe-cache: prefill failed\n");
        return 1;
    }
    int64_t diff = first_difference(ref, got);
    if (diff >= 0) {
        printf("test-moe-cache: FAIL prefill token %" PRId64 " logit %" PRId64 ": %.9g != %.9g\n",
            diff / n_vocab, diff % n_vocab, ref[diff], got[diff]);
        return 1;
    }

    std::vector<llama_token> generated;
    llama_token next = argmax_last(ref, n_vocab);
    for (int i = 0; i < params.n_predict; ++i) {
        generated.push_back(next);
        ref = decode(stock.ctx,  { next }, n_prompt + i);
        got = decode(cached.ctx, { next }, n_prompt + i);
        diff = ref.empty() || got.empty() ? 0 : first_difference(ref, got);
        if (diff >= 0) {
            printf("test-moe-cache: FAIL decode step %d logit %" PRId64 "\n", i, diff);
            return 1;
        }
        next = argmax_last(ref, n_vocab);
    }

    std::string tokens;
    for (size_t i = 0; i < generated.size() && i < 8; ++i) {
        tokens += (i ? " " : "") + std::to_string(generated[i]);
    }
    printf("test-moe-cache: prefill %d tokens (ubatch %d) and %d greedy tokens [%s ...]: logits bitwise equal\n",
        n_prompt, params.n_ubatch, params.n_predict, tokens.c_str());
    return 0;
}
