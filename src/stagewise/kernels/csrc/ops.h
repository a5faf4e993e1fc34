/* What the C++ op registrations share (PyTorch's stable ABI, torch/csrc/stable): argument errors
   as ValueError (std::invalid_argument), tensors described in them, aten calls through the
   dispatcher. Each <concern>_ops.cpp registers the CPU kernels of the ops kernels/<concern>.py
   declares (schema and fake stay in Python), with the same checks as the Python registration. */
#ifndef STAGEWISE_OPS_H
#define STAGEWISE_OPS_H
#include <array>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

namespace stagewise {
using torch::headeronly::ScalarType;
using torch::stable::Tensor;
using Shape = std::vector<int64_t>;

inline const char* dtype_name(ScalarType t) {
    switch (t) {
        case ScalarType::Float: return "torch.float32";
        case ScalarType::BFloat16: return "torch.bfloat16";
        case ScalarType::Half: return "torch.float16";
        case ScalarType::Double: return "torch.float64";
        case ScalarType::Long: return "torch.int64";
        case ScalarType::Int: return "torch.int32";
        case ScalarType::Byte: return "torch.uint8";
        case ScalarType::Char: return "torch.int8";
        default: return "another dtype";
    }
}

inline std::string shape(const Tensor& t) {
    std::ostringstream s;
    s << "[";
    for (int64_t i = 0; i < t.dim(); i++) s << (i ? ", " : "") << t.size(i);
    s << "]";
    return s.str();
}

/* "torch.float32 cpu [2, 64] strides [64, 1]", as kernels/gemm.py writes it */
inline std::string describe(const std::optional<Tensor>& t) {
    if (!t) return "None";
    std::ostringstream s;
    s << dtype_name(t->scalar_type()) << (t->is_cpu() ? " cpu " : " other ") << shape(*t) << " strides [";
    for (int64_t i = 0; i < t->dim(); i++) s << (i ? ", " : "") << t->stride(i);
    s << "]";
    return s.str();
}

/* aten::linear through the dispatcher (MKL / oneDNN), as F.linear */
inline Tensor aten_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b) {
    std::array<StableIValue, 3> stack{torch::stable::detail::from(x), torch::stable::detail::from(w),
                                      torch::stable::detail::from(b)};
    STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::linear", "", stack.data(), TORCH_ABI_VERSION));
    return torch::stable::detail::to<Tensor>(stack[0]);
}

inline Tensor cast(const Tensor& t, ScalarType dtype) {
    return t.scalar_type() == dtype ? t : torch::stable::to(t, dtype);
}
}  // namespace stagewise
#endif
