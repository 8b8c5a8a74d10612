#pragma once

// Route replay (moeplug): recorded router decisions (native/REPLAY-FORMAT.md) replace the
// router's own, token by token, so that a benchmark sees a real model's expert selections on
// a synthetic model of the same layout. Each sequence takes the next prompt of the file when a
// batch holds its position 0; the token at position pos replays row offsets[p] + pos % len(p).
// The weights are the file's when it has them, else the model's own router weights for the
// replayed experts.
//
// Call sites in upstream files (the patch that adds them in parentheses):
//   src/llama-model.h      llama_model::moeplug_replay                                     (0014)
//   src/llama-graph.h      llm_graph_params::moeplug_replay, llm_graph_context::moeplug_replay (0014)
//   src/llama-context.cpp  graph_params(): passes model.moeplug_replay to the graph         (0014)
//   src/llama-graph.cpp    build_moe_ffn(): build_selected() for the selected experts,
//                          build_weights() for their weights                               (0014)
//   src/CMakeLists.txt     this file's .cpp in libllama                                    (0014)
//   common/common.cpp      common_init: --moe-route-replay; reset after the warm-up and
//                          the context probe (common_context_can_seq_rm)                  (0015)
//   tools/llama-bench      --moe-route-replay                                              (0008)
// The C API (llama_model_moeplug_replay_init/_reset) is in src/llama-moeplug-ext.h.

#include "ggml.h"
#include "ggml-cpp.h"

#include "llama-graph.h"

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

struct llama_model;
struct llama_moeplug_replay_result;

constexpr uint32_t MOEPLUG_REPLAY_VERSION = 1;

struct llama_moeplug_replay {
    std::string path;

    int32_t n_layer       = 0; // MoE layers recorded
    int32_t n_expert      = 0;
    int32_t n_expert_used = 0;

    std::vector<int32_t> experts; // [n_tokens][n_layer][n_expert_used]
    std::vector<float>   weights; // the same layout, or empty
    std::vector<int32_t> offsets; // [n_prompts + 1]

    std::vector<int32_t> moe_index; // block index -> row of the file, -1 for blocks not replayed

    // the prompt each sequence replays, and the next prompt to hand out
    mutable std::mutex                 mutex;
    mutable std::map<int32_t, int32_t> prompt_of_seq;
    mutable int32_t                    next_prompt = 0;

    int32_t n_prompts() const { return (int32_t) offsets.size() - 1; }
    int64_t n_tokens()  const { return offsets.empty() ? 0 : offsets.back(); }

    // the row of the file that token (seq, pos) replays; a new sequence takes the next prompt
    int64_t row(int32_t seq, int32_t pos) const;

    // forget every sequence: the next one takes the first prompt again
    void reset() const;

    // the selected experts of block il for the graph g ([n_expert_used, n_tokens] I32, a graph
    // input), or nullptr for a block the file does not replay
    ggml_tensor * build_selected(const llm_graph_context & g, int il, int64_t n_tokens) const;

    // the file's routing weights of block il ([1, n_expert_used, n_tokens] F32), or `weights`
    // unchanged when the file has none or does not replay the block
    ggml_tensor * build_weights(const llm_graph_context & g, int il, ggml_tensor * weights) const;
};

// reads and checks the file against the model; throws std::runtime_error naming what differs
std::unique_ptr<llama_moeplug_replay> llama_moeplug_replay_load(const llama_model & model, const std::string & path);
