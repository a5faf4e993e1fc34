/* The CPU kernels of stagewise::qlinear and stagewise::qlinear_cat (schemas and fakes in
   kernels/quant.py): called by the dispatcher directly, after the same checks as the Python
   registration (kernels/quant_kernels.py), so a decode step pays no Python per quantized layer.
   Only packed weights run here; kernels/quant.py keeps file-layout weights on its reference path. */
#include "quant.h"
#include "ops.h"

namespace stagewise {
namespace {

std::string type_name(int64_t qt) {
    switch (qt) {
        case 2: return "Q4_0";
        case 3: return "Q4_1";
        case 6: return "Q5_0";
        case 7: return "Q5_1";
        case 8: return "Q8_0";
        case 12: return "Q4_K";
        case 13: return "Q5_K";
        case 14: return "Q6_K";
        case 39: return "MXFP4";
        default: return "type " + std::to_string(qt);
    }
}

std::string strides(const Tensor& t) {
    std::ostringstream s;
    s << "(";
    for (int64_t i = 0; i < t.dim(); i++) s << (i ? ", " : "") << t.stride(i);
    s << (t.dim() == 1 ? ",)" : ")");
    return s.str();
}

/* kernels/quant_kernels.py `check_linear`, for the rows */
void check_rows(const Tensor& x) {
    ScalarType dt = x.scalar_type();
    if (!x.is_cpu() || x.dim() != 2 || (dt != ScalarType::Float && dt != ScalarType::BFloat16))
        throw std::invalid_argument(std::string("Quantized linear takes CPU float32 or bfloat16 rows [M, K], not ")
                                    + dtype_name(dt) + " " + shape(x) + ".");
}

/* ... and for one weight */
void check_weight(const Tensor& x, const Tensor& data, int64_t qt, int64_t n) {
    int64_t k = x.size(1);
    if (!quant_supported((int)qt)) throw std::invalid_argument("GGUF " + type_name(qt) + " has no quantized kernel.");
    if (n < 0) throw std::invalid_argument("A quantized weight has N >= 0 rows; got N=" + std::to_string(n) + ".");
    int64_t step = qt >= 12 && qt <= 14 ? 256 : 32;       /* the K types; MXFP4 (39) has blocks of 32 */
    if (k % step || k == 0)
        throw std::invalid_argument("Quantized linear needs K a multiple of " + std::to_string(step) + "; got K="
                                    + std::to_string(k) + ".");
    if (x.stride(1) != 1)
        throw std::invalid_argument("Quantized linear needs rows with unit column stride; got strides " + strides(x)
                                    + ".");
    int64_t panels = (n / 32 + (n % 32 != 0)) * 2, bytes = quant_panel_bytes((int)qt, k);
    if (data.scalar_type() != ScalarType::Byte || data.dim() != 2 || data.size(0) != panels || data.size(1) != bytes
        || !data.is_contiguous() || !data.is_cpu())
        throw std::invalid_argument("A packed " + std::to_string(n) + "x" + std::to_string(k) + " " + type_name(qt)
                                    + " weight is contiguous uint8 (" + std::to_string(panels) + ", "
                                    + std::to_string(bytes) + ") on the CPU; got " + dtype_name(data.scalar_type())
                                    + " " + shape(data) + (data.is_cpu() ? "" : " on another device")
                                    + " (K of the activations must match the weight's, and N its rows).");
}

Tensor run(const Tensor& x, const std::vector<Tensor>& data, std::optional<Tensor> bias,
           const std::vector<int64_t>& qtypes, const std::vector<int64_t>& ns, bool exact, bool f32_out) {
    check_rows(x);
    int64_t count = (int64_t)data.size(), total = 0;
    if (count < 1 || count > QUANT_MAX_SEGMENTS || (int64_t)qtypes.size() != count || (int64_t)ns.size() != count)
        throw std::invalid_argument("Quantized linear takes 1 to " + std::to_string(QUANT_MAX_SEGMENTS)
                                    + " weights with one type and row count each.");
    int qts[QUANT_MAX_SEGMENTS];
    const uint8_t* ws[QUANT_MAX_SEGMENTS];
    int64_t rows[QUANT_MAX_SEGMENTS];
    for (int64_t s = 0; s < count; s++) {
        check_weight(x, data[s], qtypes[s], ns[s]);
        qts[s] = (int)qtypes[s];
        ws[s] = static_cast<const uint8_t*>(data[s].data_ptr());
        rows[s] = ns[s];
        total += ns[s];
    }
    if (bias) {
        ScalarType bt = bias->scalar_type();
        if (bias->dim() != 1 || bias->size(0) != total || (bt != ScalarType::Float && bt != ScalarType::BFloat16))
            throw std::invalid_argument("The bias must be float [" + std::to_string(total) + "], not "
                                        + dtype_name(bt) + " " + shape(*bias) + ".");
        bias = torch::stable::contiguous(cast(*bias, ScalarType::Float));
    }
    int64_t m = x.size(0), k = x.size(1);
    bool f32 = f32_out || x.scalar_type() == ScalarType::Float;
    Tensor y = torch::stable::new_empty(x, Shape{m, total}, f32 ? ScalarType::Float : ScalarType::BFloat16);
    if (!m) return y;
    int status = quant_linear((int)count, qts, ws, rows, exact, x.data_ptr(), x.scalar_type() == ScalarType::BFloat16,
                              x.stride(0), m, k, bias ? static_cast<const float*>(bias->data_ptr()) : nullptr,
                              f32 ? static_cast<float*>(y.data_ptr()) : nullptr,
                              f32 ? nullptr : static_cast<uint16_t*>(y.data_ptr()), total);
    if (status) throw std::runtime_error("The quantized kernel ran out of memory for " + std::to_string(m) + " rows.");
    return y;
}

/* kernels/quant.py `_qlinear` for packed weights */
Tensor qlinear(Tensor x, Tensor data, std::optional<Tensor> bias, int64_t qtype, int64_t n, bool packed, bool exact,
               bool f32_out) {
    if (!packed)
        throw std::invalid_argument("The quantized op takes packed weights: call QuantizedWeight.pack() first.");
    return run(x, std::vector<Tensor>{data}, bias, std::vector<int64_t>{qtype}, std::vector<int64_t>{n}, exact,
               f32_out);
}

/* kernels/quant.py `_qlinear_cat` */
Tensor qlinear_cat(Tensor x, std::vector<Tensor> data, std::optional<Tensor> bias, std::vector<int64_t> qtypes,
                   std::vector<int64_t> ns, bool exact, bool f32_out) {
    return run(x, data, bias, qtypes, ns, exact, f32_out);
}

}  // namespace
}  // namespace stagewise

STABLE_TORCH_LIBRARY_IMPL(stagewise, CPU, m) {
    m.impl("qlinear", TORCH_BOX(&stagewise::qlinear));
    m.impl("qlinear_cat", TORCH_BOX(&stagewise::qlinear_cat));
}
