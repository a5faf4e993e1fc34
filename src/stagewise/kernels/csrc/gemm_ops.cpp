/* The CPU kernels of stagewise::linear and stagewise::linear_packed (schemas and fakes in
   kernels/gemm.py): the dispatcher calls these directly, no Python on the way, after the same
   checks as the Python registration. Where this file does not build, kernels/gemm.py registers
   its Python implementations instead; both call the same C kernels, so results are identical. */
#include "gemm.h"
#include "ops.h"

/* absent where the build lacks their instruction sets (gemm.c) */
#pragma weak small_linear_bf16dp
#pragma weak packed_f32_panel
#pragma weak packed_linear_f32
#pragma weak packed_linear_bf16
#pragma weak packed_bf16_panel
#pragma weak packed_bf16_pair

namespace stagewise {
namespace {

/* set from kernels/gemm.py when this library loads: rows up to which stagewise::linear runs the
   small-row kernel (0: never), and whether the CPU computes bf16 natively */
int64_t max_rows_f32 = 0, max_rows_bf16 = 0;
bool native_bf16 = false;

/* kernels/gemm.py `supports`, and a bias of N entries */
void check_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias) {
    ScalarType dt = x.scalar_type();
    int64_t step = native_bf16 && dt == ScalarType::BFloat16 ? 32 : 8;
    bool ok = x.is_cpu() && dt == w.scalar_type() && (dt == ScalarType::Float || dt == ScalarType::BFloat16)
              && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.size(1) % step == 0
              && x.stride(1) == 1 && w.is_contiguous()
              && (!bias || (bias->scalar_type() == dt && bias->is_contiguous() && bias->dim() == 1
                            && bias->size(0) == w.size(0)));
    if (!ok)
        throw std::invalid_argument(
            "stagewise linear kernel: x " + describe(x) + ", weight " + describe(w) + ", bias " + describe(bias)
            + "; it needs CPU float32 or bfloat16 of one dtype, x [M, K] with unit column stride, a contiguous "
              "weight [N, K] with the same K, a multiple of " + std::to_string(step)
            + ", and a contiguous bias [N] or none.");
}

/* kernels/gemm.py `small_linear` */
Tensor small_linear(Tensor x, const Tensor& w, std::optional<Tensor> bias) {
    check_linear(x, w, bias);
    ScalarType dt = x.scalar_type();
    bool dp = dt == ScalarType::BFloat16 && native_bf16;
    if (dp && !small_linear_bf16dp) throw std::runtime_error("The small-row linear kernel is not available on this machine.");
    if (dt == ScalarType::BFloat16) {
        if (bias) bias = cast(*bias, ScalarType::Float);
        if (!native_bf16) x = cast(x, ScalarType::Float);
    }
    int64_t m = x.size(0), k = x.size(1), n = w.size(0);
    Tensor y = torch::stable::new_empty(x, Shape{m, n}, ScalarType::Float);
    const float* b = bias ? static_cast<const float*>(bias->data_ptr()) : nullptr;
    float* yp = static_cast<float*>(y.data_ptr());
    if (m) {
        if (dt == ScalarType::Float)
            small_linear_f32(static_cast<const float*>(x.data_ptr()), x.stride(0), static_cast<const float*>(w.data_ptr()),
                             b, yp, n, m, n, k);
        else if (!native_bf16)
            small_linear_bf16(static_cast<const float*>(x.data_ptr()), x.stride(0),
                              static_cast<const uint16_t*>(w.data_ptr()), b, yp, n, m, n, k);
        else
            small_linear_bf16dp(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                                static_cast<const uint16_t*>(w.data_ptr()), b, yp, n, m, n, k);
    }
    return cast(y, dt);
}

/* kernels/gemm.py `_by_rows`: the small-row kernel up to the row limit, else MKL / oneDNN */
Tensor linear(Tensor x, Tensor w, std::optional<Tensor> bias) {
    ScalarType dt = x.scalar_type();
    if (x.size(0) <= (dt == ScalarType::BFloat16 ? max_rows_bf16 : max_rows_f32)) return small_linear(x, w, bias);
    if (dt == ScalarType::BFloat16 && !native_bf16) {
        std::optional<Tensor> b = bias ? std::optional<Tensor>(cast(*bias, ScalarType::Float)) : std::nullopt;
        return cast(aten_linear(cast(x, ScalarType::Float), cast(w, ScalarType::Float), b), dt);
    }
    return aten_linear(x, w, bias);
}

/* (panel width, k per pair) of the packed kernel for dtype, as kernels/gemm.py `_kernel_layout` */
std::optional<std::array<int64_t, 2>> packed_layout(ScalarType dt) {
    if (dt == ScalarType::BFloat16 && packed_linear_bf16)
        return std::array<int64_t, 2>{packed_bf16_panel(), packed_bf16_pair()};
    if (dt == ScalarType::Float && packed_f32_panel) return std::array<int64_t, 2>{packed_f32_panel(), 1};
    return std::nullopt;
}

/* kernels/gemm.py `_check_packed` */
void check_packed(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias) {
    auto found = w.is_cpu() && w.dim() == 2 ? packed_layout(w.scalar_type()) : std::nullopt;
    bool ok = found && w.is_contiguous() && w.size(0) % ((*found)[1] == 2 ? 16 : 1) == 0
              && w.size(1) % (*found)[1] == 0 && x.is_cpu() && x.dim() == 2 && x.size(1) == w.size(1)
              && (!bias || (bias->dim() == 1 && bias->size(0) == w.size(0)));
    if (!ok) {
        std::string layout = found ? "(" + std::to_string((*found)[0]) + ", " + std::to_string((*found)[1]) + ")" : "None";
        throw std::invalid_argument(
            "stagewise packed linear kernel: x " + describe(x) + ", weight " + describe(w) + ", bias " + describe(bias)
            + "; it needs a contiguous packed CPU weight [N, K] (float32 or bfloat16, with AVX2 FMA; "
              "packed layout here: " + layout + "), x [M, K] with the same K and a bias [N] or none.");
    }
}

/* kernels/gemm.py `_packed` */
Tensor linear_packed(Tensor x, Tensor w, std::optional<Tensor> bias, bool f32_out) {
    ScalarType dt = w.scalar_type();
    if (x.scalar_type() != dt || x.dim() != 2 || x.stride(1) != 1) {
        int64_t k = x.dim() ? x.size(x.dim() - 1) : 1;
        x = torch::stable::contiguous(torch::stable::reshape(cast(x, dt), Shape{-1, k}));
    }
    check_packed(x, w, bias);
    int64_t m = x.size(0), k = x.size(1), n = w.size(0);
    std::optional<Tensor> b32 = bias ? std::optional<Tensor>(torch::stable::contiguous(cast(*bias, ScalarType::Float)))
                                     : std::nullopt;
    const float* b = b32 ? static_cast<const float*>(b32->data_ptr()) : nullptr;
    bool wide = dt == ScalarType::BFloat16 && f32_out;
    Tensor y = torch::stable::new_empty(x, Shape{m, n}, wide ? ScalarType::Float : dt);
    if (!m) return y;
    if (dt == ScalarType::BFloat16)
        packed_linear_bf16(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0), static_cast<const uint16_t*>(w.data_ptr()),
                           b, wide ? nullptr : static_cast<uint16_t*>(y.data_ptr()),
                           wide ? static_cast<float*>(y.data_ptr()) : nullptr, n, m, n, k);
    else
        packed_linear_f32(static_cast<const float*>(x.data_ptr()), x.stride(0), static_cast<const float*>(w.data_ptr()), b,
                          static_cast<float*>(y.data_ptr()), n, m, n, k);
    return y;
}

}  // namespace
}  // namespace stagewise

extern "C" void stagewise_gemm_configure(int64_t max_rows_f32, int64_t max_rows_bf16, int native_bf16) {
    stagewise::max_rows_f32 = max_rows_f32;
    stagewise::max_rows_bf16 = max_rows_bf16;
    stagewise::native_bf16 = native_bf16 != 0;
}

STABLE_TORCH_LIBRARY_IMPL(stagewise, CPU, m) {
    m.impl("linear", TORCH_BOX(&stagewise::linear));
    m.impl("linear_packed", TORCH_BOX(&stagewise::linear_packed));
}
