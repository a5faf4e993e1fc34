/* The CPU kernel of stagewise::decode_layers (schema, checks and the Python reference in
   kernels/layers.py): a decode (or verify) step's run of Llama-style decoder layers in one call.
   Each layer is the same sequence of ops the model's modules call in an eager step
   (model/llama.py), each called through the dispatcher as they call it, so the results are their
   bits; what goes is the Python between them (~150 us a layer on a 2-core CPU: module calls,
   argument checks, views). */
#include <array>
#include <tuple>

#include "ops.h"

namespace stagewise {
namespace {

using torch::stable::detail::from;
using torch::stable::detail::to;

template <size_t N>
void call(const char* op, const char* overload, std::array<StableIValue, N>& stack) {
    STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(op, overload, stack.data(), TORCH_ABI_VERSION));
}

/* (norm(x + residual), x + residual); without a residual, norm(x) and an empty tensor */
std::tuple<Tensor, Tensor> rms_norm(const Tensor& x, const std::optional<Tensor>& res, const Tensor& w, double eps) {
    std::array<StableIValue, 4> s{from(x), from(res), from(w), from(eps)};
    call("stagewise::rms_norm", "", s);
    return {to<Tensor>(s[0]), to<Tensor>(s[1])};
}

/* one projection: its weight's segments [first, first + count) of the flattened lists (qtype -1: one
   packed float weight), and its bias */
Tensor project(const Tensor& x, const std::vector<Tensor>& data, const std::vector<int64_t>& qtypes,
               const std::vector<int64_t>& ns, int64_t first, int64_t count, const std::optional<Tensor>& bias,
               bool exact) {
    if (qtypes[first] < 0) {                 // a float weight in the packed kernels' layout
        std::array<StableIValue, 4> s{from(x), from(data[first]), from(bias), from(false)};
        call("stagewise::linear_packed", "", s);
        return to<Tensor>(s[0]);
    }
    if (count == 1) {
        std::array<StableIValue, 8> s{from(x), from(data[first]), from(bias), from(qtypes[first]), from(ns[first]),
                                      from(true), from(exact), from(false)};
        call("stagewise::qlinear", "", s);
        return to<Tensor>(s[0]);
    }
    std::vector<Tensor> d(data.begin() + first, data.begin() + first + count);
    std::vector<int64_t> q(qtypes.begin() + first, qtypes.begin() + first + count);
    std::vector<int64_t> n(ns.begin() + first, ns.begin() + first + count);
    std::array<StableIValue, 7> s{from(x), from(d), from(bias), from(q), from(n), from(exact), from(false)};
    call("stagewise::qlinear_cat", "", s);
    return to<Tensor>(s[0]);
}

Tensor unary(const char* op, const Tensor& x) {
    std::array<StableIValue, 1> s{from(x)};
    call(op, "", s);
    return to<Tensor>(s[0]);
}

Tensor mul(const Tensor& a, const Tensor& b) {
    std::array<StableIValue, 2> s{from(a), from(b)};
    call("aten::mul", "Tensor", s);
    return to<Tensor>(s[0]);
}

/* kernels/layers.py `_check`: the lists' lengths (each op checks its own tensors as it runs) */
void check_lists(int64_t layers, const std::vector<Tensor>& norms, const std::vector<Tensor>& data,
                 const std::vector<int64_t>& qtypes, const std::vector<int64_t>& ns, const std::vector<int64_t>& parts,
                 const std::vector<Tensor>& biases, const std::vector<int64_t>& bias_of,
                 const std::vector<Tensor>& caches, const Tensor& hidden) {
    int64_t segments = 0;
    bool ok = layers >= 1 && static_cast<int64_t>(norms.size()) == 2 * layers
              && static_cast<int64_t>(parts.size()) == 4 * layers && static_cast<int64_t>(bias_of.size()) == 4 * layers
              && hidden.dim() == 2;
    for (int64_t b : bias_of) ok = ok && b >= -1 && b < static_cast<int64_t>(biases.size());
    for (int64_t p : parts) {
        ok = ok && p >= 1;
        segments += p;
    }
    ok = ok && static_cast<int64_t>(data.size()) == segments && static_cast<int64_t>(qtypes.size()) == segments
         && static_cast<int64_t>(ns.size()) == segments;
    if (!ok)
        throw std::invalid_argument(
            "stagewise decode_layers: " + std::to_string(caches.size()) + " caches, " + std::to_string(norms.size())
            + " norm weights, " + std::to_string(parts.size()) + " projection part counts and " + std::to_string(data.size())
            + " weight segments for hidden " + shape(hidden) + "; it needs, per layer, one KV cache, two norm weights "
            "and four projections (qkv, o, gate_up, down) of at least one segment each and a bias index each (-1: "
            "none) into the biases, and hidden [T, H].");
}

/* kernels/layers.py `_decode_layers` */
std::tuple<Tensor, Tensor> decode_layers(Tensor hidden, std::optional<Tensor> residual, Tensor cos, Tensor sin,
                                         Tensor slots, Tensor block_ids, Tensor seq_lens, std::vector<Tensor> norms,
                                         std::vector<Tensor> data, std::vector<int64_t> qtypes, std::vector<int64_t> ns,
                                         std::vector<int64_t> parts, std::vector<Tensor> biases,
                                         std::vector<int64_t> bias_of, std::vector<Tensor> caches, int64_t hq, int64_t hkv,
                                         double eps, double scale, bool exact, std::optional<Tensor> spans) {
    int64_t layers = static_cast<int64_t>(caches.size());
    check_lists(layers, norms, data, qtypes, ns, parts, biases, bias_of, caches, hidden);
    int64_t rows = hidden.size(0), seg = 0;
    std::optional<bool> per_sequence;
    /* projection p's weight (its next parts[p] segments) and bias */
    auto proj = [&](const Tensor& x, int64_t p) {
        std::optional<Tensor> bias;
        if (bias_of[p] >= 0) bias = biases[bias_of[p]];
        Tensor y = project(x, data, qtypes, ns, seg, parts[p], bias, exact);
        seg += parts[p];
        return y;
    };
    Tensor res = residual ? *residual : hidden;
    for (int64_t l = 0; l < layers; l++) {
        Tensor x = hidden;
        if (l == 0 && !residual) {          // the stage's first layer starts the residual stream
            x = std::get<0>(rms_norm(hidden, std::nullopt, norms[0], eps));
        } else {
            auto [normed, total] = rms_norm(hidden, res, norms[2 * l], eps);
            x = normed, res = total;
        }
        Tensor qkv = proj(x, 4 * l);
        std::optional<Tensor> cache = caches[l], slot = slots;
        std::array<StableIValue, 7> r{from(qkv), from(cos), from(sin), from(hq), from(hkv), from(cache), from(slot)};
        call("stagewise::rope_kv", "", r);
        Tensor q = to<Tensor>(r[0]), out;
        if (spans) {                        // rows in spans of their sequences' block tables
            std::array<StableIValue, 6> a{from(q), from(caches[l]), from(block_ids), from(*spans), from(seq_lens),
                                          from(scale)};
            call("stagewise::rows_attention", "", a);
            out = to<Tensor>(a[0]);
        } else {
            std::array<StableIValue, 6> a{from(q), from(caches[l]), from(block_ids), from(seq_lens), from(scale),
                                          from(per_sequence)};
            call("stagewise::decode_attention", "", a);
            out = to<Tensor>(a[0]);
        }
        Tensor attn = torch::stable::reshape(out, {rows, -1});
        auto [h, total] = rms_norm(proj(attn, 4 * l + 1), res, norms[2 * l + 1], eps);
        res = total;
        Tensor gate_up = proj(h, 4 * l + 2);
        int64_t inter = gate_up.size(1) / 2;
        Tensor gate = torch::stable::narrow(gate_up, 1, 0, inter), up = torch::stable::narrow(gate_up, 1, inter, inter);
        hidden = proj(mul(unary("aten::silu", gate), up), 4 * l + 3);
    }
    return std::make_tuple(hidden, res);
}

}  // namespace
}  // namespace stagewise

STABLE_TORCH_LIBRARY_IMPL(stagewise, CPU, m) {
    m.impl("decode_layers", TORCH_BOX(&stagewise::decode_layers));
}
