/* The CPU kernel of stagewise::rms_norm (schema and fake in kernels/norm.py): called by the
   dispatcher directly, after the same checks as the Python registration. */
#include <tuple>

#include "norm.h"
#include "ops.h"

namespace stagewise {
namespace {

/* kernels/norm.py `_check` */
void check_norm(const Tensor& x, const std::optional<Tensor>& res, const Tensor& w) {
    ScalarType dt = x.scalar_type();
    bool ok = x.is_cpu() && (dt == ScalarType::Float || dt == ScalarType::BFloat16) && x.dim() == 2
              && x.stride(1) == 1 && w.is_cpu() && w.scalar_type() == dt && w.dim() == 1 && w.size(0) == x.size(1)
              && w.is_contiguous();
    if (ok && res)
        ok = res->is_cpu() && res->scalar_type() == dt && res->dim() == 2 && res->size(0) == x.size(0)
             && res->size(1) == x.size(1) && res->stride(1) == 1;
    if (!ok)
        throw std::invalid_argument("stagewise rms_norm: x " + describe(x) + ", residual " + describe(res) + ", weight "
                                    + describe(w) + "; it needs CPU float32 or bfloat16 of one dtype, x [M, N] and a "
                                    "residual of the same shape (or none) with unit column stride, and a contiguous "
                                    "weight [N].");
}

template <typename T, typename F>
void run(F fn, const Tensor& x, const std::optional<Tensor>& res, const Tensor& w, Tensor& out, Tensor& sum,
         double eps) {
    int64_t m = x.size(0), n = x.size(1);
    fn(static_cast<const T*>(x.data_ptr()), x.stride(0), res ? static_cast<const T*>(res->data_ptr()) : nullptr,
       res ? res->stride(0) : 0, static_cast<const T*>(w.data_ptr()), static_cast<T*>(out.data_ptr()), n,
       res ? static_cast<T*>(sum.data_ptr()) : nullptr, n, m, n, static_cast<float>(eps));
}

/* kernels/norm.py `_rms_norm` */
std::tuple<Tensor, Tensor> rms_norm(Tensor x, std::optional<Tensor> res, Tensor w, double eps) {
    check_norm(x, res, w);
    int64_t m = x.size(0), n = x.size(1);
    Tensor out = torch::stable::new_empty(x, Shape{m, n});
    Tensor sum = res ? torch::stable::new_empty(x, Shape{m, n}) : torch::stable::new_empty(x, Shape{0});
    if (x.scalar_type() == ScalarType::Float)
        run<float>(rms_norm_f32, x, res, w, out, sum, eps);
    else
        run<uint16_t>(rms_norm_bf16, x, res, w, out, sum, eps);
    return std::make_tuple(out, sum);
}

}  // namespace
}  // namespace stagewise

STABLE_TORCH_LIBRARY_IMPL(stagewise, CPU, m) {
    m.impl("rms_norm", TORCH_BOX(&stagewise::rms_norm));
}
