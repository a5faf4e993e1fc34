/* The CPU kernels of stagewise::all_reduce and stagewise::all_gather (schemas and fakes in
   kernels/comm.py): the dispatcher calls these directly, after the same checks as the Python
   registration; both call the same C collectives (comm.c). */
#include "comm.h"
#include "ops.h"

namespace stagewise {
namespace {

/* kernels/comm.py `_raise` */
[[noreturn]] void fail(int64_t rc, const char* op, int64_t group) {
    std::ostringstream s;
    s << "tensor-parallel " << op << ": ";
    int64_t rank = comm_rank(group), size = comm_size(group);
    if (rc == COMM_TIMEOUT) {
        s << "rank " << rank << " of " << size << " waited longer than its timeout for the other ranks of its "
          << "stage; one of them died or is stuck.";
        throw std::runtime_error(s.str());
    }
    if (rc == COMM_ABORTED) {
        s << "rank " << rank << " of " << size << " stopped because another rank of its stage gave up (it timed "
          << "out or failed).";
        throw std::runtime_error(s.str());
    }
    if (rc == COMM_BAD_HANDLE) s << "group " << group << " is not open in this process.";
    else s << "the kernel refused its arguments (group " << group << ").";
    throw std::invalid_argument(s.str());
}

std::string describe_short(const Tensor& x) {
    return std::string(dtype_name(x.scalar_type())) + (x.is_cpu() ? " cpu " : " other ") + shape(x);
}

/* kernels/comm.py `_all_reduce` */
Tensor all_reduce(Tensor x, int64_t group) {
    ScalarType dt = x.scalar_type();
    if (!x.is_cpu() || (dt != ScalarType::Float && dt != ScalarType::BFloat16))
        throw std::invalid_argument("stagewise all_reduce: it needs a CPU float32 or bfloat16 tensor, got "
                                    + describe_short(x) + ".");
    x = torch::stable::contiguous(x);
    Tensor out = torch::stable::empty_like(x);
    int64_t rc = comm_all_reduce(group, x.data_ptr(), out.data_ptr(), x.numel(), dt == ScalarType::Float ? COMM_F32
                                                                                                         : COMM_BF16);
    if (rc) fail(rc, "all-reduce", group);
    return out;
}

/* kernels/comm.py `_all_gather` */
Tensor all_gather(Tensor x, int64_t group, int64_t size, int64_t dst) {
    ScalarType dt = x.scalar_type();
    int64_t actual = comm_size(group);
    if (!x.is_cpu() || x.dim() != 2
            || (dt != ScalarType::Float && dt != ScalarType::BFloat16 && dt != ScalarType::Half))
        throw std::invalid_argument("stagewise all_gather: it needs a CPU float tensor [rows, columns], got "
                                    + describe_short(x) + ".");
    if (actual != size || dst < -1 || dst >= size)
        throw std::invalid_argument("stagewise all_gather: group " + std::to_string(group) + " has "
                                    + std::to_string(actual) + " ranks; the call said " + std::to_string(size)
                                    + " ranks and destination " + std::to_string(dst) + " (-1: every rank).");
    x = torch::stable::contiguous(x);
    int64_t rows = x.size(0), cols = x.size(1), esize = dt == ScalarType::Float ? 4 : 2;
    Tensor out = torch::stable::new_empty(x, Shape{rows, size * cols});
    int64_t rc = comm_all_gather(group, x.data_ptr(), out.data_ptr(), rows, cols * esize, dst);
    if (rc) fail(rc, "all-gather", group);
    return out;
}

}  // namespace
}  // namespace stagewise

STABLE_TORCH_LIBRARY_IMPL(stagewise, CPU, m) {
    m.impl("all_reduce", TORCH_BOX(&stagewise::all_reduce));
    m.impl("all_gather", TORCH_BOX(&stagewise::all_gather));
}
