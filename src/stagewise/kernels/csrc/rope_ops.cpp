/* The CPU kernel of stagewise::rope_kv (schema and fake in kernels/rope.py): called by the
   dispatcher directly, after the same checks as the Python registration. */
#include <tuple>

#include "ops.h"
#include "rope.h"

namespace stagewise {
namespace {

bool same_layout(const Tensor& a, const Tensor& b) {
    if (a.dim() != b.dim()) return false;
    for (int64_t i = 0; i < a.dim(); i++)
        if (a.size(i) != b.size(i) || a.stride(i) != b.stride(i)) return false;
    return true;
}

/* kernels/rope.py `supports` and `_check` */
void check_rope(const Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t hq, int64_t hkv,
                const std::optional<Tensor>& cache, const std::optional<Tensor>& slots) {
    ScalarType dt = qkv.scalar_type();
    int64_t d = cos.dim() > 0 ? cos.size(cos.dim() - 1) : 0;
    bool ok = qkv.is_cpu() && (dt == ScalarType::Float || dt == ScalarType::BFloat16) && qkv.dim() == 2
              && qkv.stride(1) == 1 && cos.scalar_type() == dt && cos.is_cpu() && hq > 0 && hkv > 0
              && d > 0 && d % 2 == 0 && qkv.size(1) == (hq + 2 * hkv) * d && cos.stride(cos.dim() - 1) == 1
              && (cos.dim() == 2 || cos.dim() == 3) && cos.size(0) == qkv.size(0) && (cos.dim() == 2 || cos.size(1) == 1)
              && sin.scalar_type() == dt && sin.is_cpu() && same_layout(sin, cos);
    if (ok && (cache || slots))
        ok = cache && slots && cache->is_cpu() && cache->scalar_type() == dt && cache->dim() == 5 && cache->size(0) == 2
             && cache->size(3) == hkv && cache->size(4) == d && cache->is_contiguous() && slots->is_cpu()
             && slots->scalar_type() == ScalarType::Long && slots->dim() == 1 && slots->is_contiguous()
             && slots->numel() <= qkv.size(0);
    if (!ok)
        throw std::invalid_argument(
            "stagewise rope_kv: qkv " + describe(qkv) + ", cos " + describe(cos) + ", sin " + describe(sin)
            + ", heads " + std::to_string(hq) + ", kv_heads " + std::to_string(hkv) + ", kv_cache " + describe(cache)
            + ", slots " + describe(slots) + "; it needs CPU float32 or bfloat16 of one dtype: qkv [T, (heads + 2 "
            "kv_heads) D] with unit column stride, cos and sin alike [T, D] or [T, 1, D] with D even, and a "
            "contiguous kv_cache [2, blocks, block_size, kv_heads, D] with int64 slots [n <= T] (both or neither).");
}

template <typename T, typename F>
int64_t run(F fn, const Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t hq, int64_t hkv,
            const std::optional<Tensor>& cache, const std::optional<Tensor>& slots, Tensor& q, Tensor& k,
            int64_t cache_slots) {
    int64_t d = cos.size(cos.dim() - 1);
    return fn(static_cast<const T*>(qkv.data_ptr()), qkv.stride(0), static_cast<const T*>(cos.data_ptr()),
              static_cast<const T*>(sin.data_ptr()), cos.stride(0), static_cast<T*>(q.data_ptr()),
              static_cast<T*>(k.data_ptr()), qkv.size(0), hq, hkv, d,
              cache ? static_cast<T*>(cache->data_ptr()) : nullptr, cache_slots,
              slots ? static_cast<const int64_t*>(slots->data_ptr()) : nullptr, slots ? slots->numel() : 0);
}

/* kernels/rope.py `_rope_kv` */
std::tuple<Tensor, Tensor> rope_kv(Tensor qkv, Tensor cos, Tensor sin, int64_t hq, int64_t hkv,
                                   std::optional<Tensor> cache, std::optional<Tensor> slots) {
    check_rope(qkv, cos, sin, hq, hkv, cache, slots);
    int64_t d = cos.size(cos.dim() - 1), cache_slots = cache ? cache->size(1) * cache->size(2) : 0;
    Tensor q = torch::stable::new_empty(qkv, Shape{qkv.size(0), hq, d});
    Tensor k = torch::stable::new_empty(qkv, Shape{qkv.size(0), hkv, d});
    int64_t bad = qkv.scalar_type() == ScalarType::Float
                      ? run<float>(rope_kv_f32, qkv, cos, sin, hq, hkv, cache, slots, q, k, cache_slots)
                      : run<uint16_t>(rope_kv_bf16, qkv, cos, sin, hq, hkv, cache, slots, q, k, cache_slots);
    if (bad >= 0)
        throw std::invalid_argument("stagewise rope_kv: slot " + std::to_string(static_cast<const int64_t*>(
                                        slots->data_ptr())[bad]) + " (row " + std::to_string(bad) + ") is outside the "
                                    "KV cache's " + std::to_string(cache_slots) + " slots; nothing was written.");
    return std::make_tuple(q, k);
}

}  // namespace
}  // namespace stagewise

STABLE_TORCH_LIBRARY_IMPL(stagewise, CPU, m) {
    m.impl("rope_kv", TORCH_BOX(&stagewise::rope_kv));
}
