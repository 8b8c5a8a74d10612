// test-moe-split: splitting one MoE expert pass over two expert sets changes nothing, bitwise.
//
//   ref   = mul_mat_id(A, b, ids)
//   split = mul_mat_id(A, b, ids_host) + mul_mat_id(A_slots, b, ids_slot)
//
// A_slots holds copies of N "resident" experts of A. ids_host keeps the ids of the other experts
// (-1 for resident ones) and ids_slot maps resident experts to their slot (-1 for the others); both
// ops carry ggml_set_skip_neg_ids, so every (slot, token) row is computed by exactly one pass and
// the other contributes an exact zero. The same holds with expert biases through add_id.
//
// Checked on the CPU backend for plain and repacked (CPU_REPACK) weights, several types, batch
// sizes 1..31, N in {0, 1, some, all} and 1/4/16 threads.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static const int64_t K       = 256; // row length (n_embd)
static const int64_t M       = 64;  // rows per expert (expert ff)
static const int64_t N_EXP   = 8;   // experts
static const int64_t N_USED  = 2;   // experts used per token

struct split_case {
    ggml_type                  type;
    ggml_backend_buffer_type_t buft;
    std::string                buft_name;
};

// the weights of all experts in the storage format of `type`, from random floats
static std::vector<uint8_t> make_weights(ggml_type type, int64_t n_expert, std::mt19937 & rng) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> f(n_expert*M*K);
    for (auto & x : f) {
        x = dist(rng);
    }
    std::vector<uint8_t> q(n_expert*M*ggml_row_size(type, K));
    ggml_quantize_chunk(type, f.data(), q.data(), 0, n_expert*M, K, nullptr);
    return q;
}

static ggml_backend_buffer_type_t find_repack_buft() {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra == nullptr) {
        return nullptr;
    }
    for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; ++b) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) {
            return *b;
        }
    }
    return nullptr;
}

struct weights {
    ggml_context *        ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_tensor *         a   = nullptr;  // [K, M, n_expert]

    ~weights() {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
};

// returns false when this buffer type does not take this type (e.g. no repack for it on this CPU)
static bool load_weights(weights & w, const split_case & c, int64_t n_expert, const std::vector<uint8_t> & data) {
    ggml_init_params ip = { ggml_tensor_overhead()*2, nullptr, true };
    w.ctx = ggml_init(ip);
    w.a   = ggml_new_tensor_3d(w.ctx, c.type, K, M, n_expert);
    w.buf = ggml_backend_alloc_ctx_tensors_from_buft(w.ctx, c.buft);
    if (w.buf == nullptr) {
        return false;
    }
    if (c.buft_name == "CPU_REPACK" && w.a->extra == nullptr) {
        return false; // this CPU has no repacked layout for this type
    }
    ggml_backend_buffer_set_usage(w.buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_tensor_set(w.a, data.data(), 0, ggml_nbytes(w.a));
    return true;
}

// one graph with the reference and the split computation; returns the number of differing floats
static int64_t run_case(ggml_backend_t backend, ggml_tensor * a, ggml_tensor * a_slots, int64_t n_tokens,
        const std::vector<int32_t> & ids, const std::vector<int32_t> & ids_host, const std::vector<int32_t> & ids_slot,
        std::mt19937 & rng, int64_t n_slots) {
    ggml_init_params ip = { ggml_tensor_overhead()*32 + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * b      = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, K, N_USED, n_tokens);
    ggml_tensor * t_ids  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, N_USED, n_tokens);
    ggml_tensor * t_host = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, N_USED, n_tokens);
    ggml_tensor * t_slot = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, N_USED, n_tokens);
    ggml_tensor * bias   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, M, N_EXP);
    ggml_tensor * bias_s = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, M, n_slots);

    ggml_tensor * ref = ggml_mul_mat_id(ctx, a, b, t_ids);
    ggml_tensor * ref_b = ggml_add_id(ctx, ref, bias, t_ids);

    ggml_tensor * host = ggml_mul_mat_id(ctx, a, b, t_host);
    ggml_tensor * slot = ggml_mul_mat_id(ctx, a_slots, b, t_slot);
    ggml_set_skip_neg_ids(host);
    ggml_set_skip_neg_ids(slot);
    ggml_tensor * host_b = ggml_add_id(ctx, host, bias,   t_host);
    ggml_tensor * slot_b = ggml_add_id(ctx, slot, bias_s, t_slot);
    ggml_set_skip_neg_ids(host_b);
    ggml_set_skip_neg_ids(slot_b);

    ggml_tensor * split   = ggml_add(ctx, host, slot);
    ggml_tensor * split_b = ggml_add(ctx, host_b, slot_b);

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, ref_b);
    ggml_build_forward_expand(gf, split);
    ggml_build_forward_expand(gf, split_b);

    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);

    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> vb(ggml_nelements(b));
    for (auto & x : vb) {
        x = dist(rng);
    }
    std::vector<float> vbias(ggml_nelements(bias));
    for (auto & x : vbias) {
        x = dist(rng);
    }
    // the slots' biases are copies of their experts' biases
    std::vector<float> vbias_s(ggml_nelements(bias_s), 0.0f);
    for (size_t i = 0; i < ids.size(); ++i) {
        if (ids_slot[i] >= 0) {
            memcpy(vbias_s.data() + ids_slot[i]*M, vbias.data() + ids[i]*M, M*sizeof(float));
        }
    }

    ggml_backend_tensor_set(b,      vb.data(),       0, ggml_nbytes(b));
    ggml_backend_tensor_set(t_ids,  ids.data(),      0, ggml_nbytes(t_ids));
    ggml_backend_tensor_set(t_host, ids_host.data(), 0, ggml_nbytes(t_host));
    ggml_backend_tensor_set(t_slot, ids_slot.data(), 0, ggml_nbytes(t_slot));
    ggml_backend_tensor_set(bias,   vbias.data(),    0, ggml_nbytes(bias));
    ggml_backend_tensor_set(bias_s, vbias_s.data(),  0, ggml_nbytes(bias_s));

    ggml_backend_graph_compute(backend, gf);

    int64_t n_diff = 0;
    auto compare = [&](ggml_tensor * x, ggml_tensor * y) {
        std::vector<float> vx(ggml_nelements(x));
        std::vector<float> vy(ggml_nelements(y));
        ggml_backend_tensor_get(x, vx.data(), 0, ggml_nbytes(x));
        ggml_backend_tensor_get(y, vy.data(), 0, ggml_nbytes(y));
        for (size_t i = 0; i < vx.size(); ++i) {
            // bitwise, except that +0 and -0 are the same zero
            if (memcmp(&vx[i], &vy[i], sizeof(float)) != 0 && !(vx[i] == 0.0f && vy[i] == 0.0f)) {
                n_diff++;
            }
        }
    };
    compare(ref, split);
    compare(ref_b, split_b);

    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return n_diff;
}

int main(void) {
    ggml_backend_load_all();

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_buffer_type_t plain  = ggml_backend_cpu_buffer_type();
    ggml_backend_buffer_type_t repack = find_repack_buft();

    std::vector<split_case> cases;
    for (ggml_type t : { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_K }) {
        cases.push_back({ t, plain, "CPU" });
    }
    if (repack) {
        for (ggml_type t : { GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_K }) {
            cases.push_back({ t, repack, "CPU_REPACK" });
        }
    }

    std::mt19937 rng(42);
    int64_t n_run = 0;
    int64_t n_fail = 0;

    for (const split_case & c : cases) {
        const std::vector<uint8_t> data = make_weights(c.type, N_EXP, rng);
        const size_t expert_bytes = data.size()/N_EXP;

        weights w;
        if (!load_weights(w, c, N_EXP, data)) {
            printf("  %-6s %-10s: not available on this CPU, skipped\n", ggml_type_name(c.type), c.buft_name.c_str());
            continue;
        }

        int64_t n_case_fail = 0;
        for (int64_t n_res : { (int64_t) 0, (int64_t) 1, (int64_t) 3, N_EXP }) {
            // the resident experts: a random choice of n_res; their slots hold copies of them
            std::vector<int32_t> perm(N_EXP);
            for (int32_t e = 0; e < N_EXP; ++e) {
                perm[e] = e;
            }
            std::shuffle(perm.begin(), perm.end(), rng);
            std::vector<int32_t> slot_of(N_EXP, -1);
            const int64_t n_slots = std::max<int64_t>(n_res, 1); // a tensor needs one slot at least
            std::vector<uint8_t> slot_data(n_slots*expert_bytes, 0);
            for (int64_t s = 0; s < n_slots; ++s) {
                const int32_t e = s < n_res ? perm[s] : perm[0];
                if (s < n_res) {
                    slot_of[e] = (int32_t) s;
                }
                memcpy(slot_data.data() + s*expert_bytes, data.data() + e*expert_bytes, expert_bytes);
            }
            weights ws;
            if (!load_weights(ws, c, n_slots, slot_data)) {
                printf("  cannot allocate the slots\n");
                return 1;
            }

            for (int nth : { 1, 4, 16 }) {
                ggml_backend_cpu_set_n_threads(backend, nth);
                for (int64_t n_tokens = 1; n_tokens <= 31; ++n_tokens) {
                    std::vector<int32_t> ids, ids_host, ids_slot;
                    for (int64_t t = 0; t < n_tokens; ++t) {
                        std::shuffle(perm.begin(), perm.end(), rng);
                        for (int64_t k = 0; k < N_USED; ++k) {
                            const int32_t e = perm[k];
                            ids.push_back(e);
                            ids_host.push_back(slot_of[e] >= 0 ? -1 : e);
                            ids_slot.push_back(slot_of[e]);
                        }
                    }
                    const int64_t n_diff = run_case(backend, w.a, ws.a, n_tokens, ids, ids_host, ids_slot, rng, n_slots);
                    n_run++;
                    if (n_diff != 0) {
                        n_case_fail++;
                        printf("  FAIL %s %s: resident %lld, threads %d, tokens %lld: %lld values differ\n",
                               ggml_type_name(c.type), c.buft_name.c_str(), (long long) n_res, nth,
                               (long long) n_tokens, (long long) n_diff);
                    }
                }
            }
        }
        printf("  %-6s %-10s: %s\n", ggml_type_name(c.type), c.buft_name.c_str(), n_case_fail ? "FAIL" : "bitwise equal");
        n_fail += n_case_fail;
    }

    ggml_backend_free(backend);
    printf("test-moe-split: %lld passed, %lld failed\n", (long long) (n_run - n_fail), (long long) n_fail);
    return n_fail == 0 && n_run > 0 ? 0 : 1;
}
