#pragma once

struct ggml_tensor;

// the routed-expert weights of one MoE layer, as llm_graph_context::build_moe_experts takes them
// (the expert slot cache passes the slots' copies); any of them may be nullptr
struct llm_moe_experts {
    ggml_tensor * up        = nullptr;
    ggml_tensor * up_b      = nullptr;
    ggml_tensor * up_s      = nullptr;
    ggml_tensor * gate      = nullptr;
    ggml_tensor * gate_b    = nullptr;
    ggml_tensor * gate_s    = nullptr;
    ggml_tensor * gate_up   = nullptr;
    ggml_tensor * gate_up_b = nullptr;
    ggml_tensor * down      = nullptr;
    ggml_tensor * down_b    = nullptr;
    ggml_tensor * down_s    = nullptr;
};
