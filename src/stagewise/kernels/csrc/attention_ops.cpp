/* The CPU kernels of stagewise::decode_attention, rows_attention and prefill_attention (schemas and
   fakes in kernels/attention.py): called by the dispatcher directly, after the same checks as the
   Python registration (the decode kernel itself checks the block tables against the pool). */
#include "attention.h"
#include "ops.h"

/* absent where the build lacks their instruction sets (attention.c) */
#pragma weak decode_attention16_f32
#pragma weak decode_attention16_bf16
#pragma weak decode_attention16_f32_rows
#pragma weak decode_attention16_bf16_rows
#pragma weak prefill_attention_bf16

namespace stagewise {
namespace {

/* kernels/attention.py `_check_decode` (`rows`: `_check_rows`' call of it, whose tables are spans') */
void check_decode(const Tensor& q, const Tensor& cache, const Tensor& tables, const Tensor& lens, bool rows = false) {
    const char* problem = nullptr;
    if (q.dim() != 3 || cache.dim() != 5 || cache.size(0) != 2)
        problem = "q must be [G, Hq, D] and the cache [2, num_blocks, block_size, Hkv, D]";
    else if (!q.is_cpu() || (q.scalar_type() != ScalarType::Float && q.scalar_type() != ScalarType::BFloat16)
             || cache.scalar_type() != q.scalar_type())
        problem = "q and the cache must be CPU float32 or bfloat16 of one dtype";
    else if (!cache.is_contiguous())
        problem = "the cache must be contiguous";
    else if (cache.size(4) != q.size(2) || q.size(2) % 8 || cache.size(3) < 1 || q.size(1) % cache.size(3))
        problem = "the head size must match the cache's and be a multiple of 8, and Hq a multiple of Hkv";
    else if (!rows && (tables.scalar_type() != ScalarType::Long || tables.dim() != 2 || tables.size(0) != q.size(0)))
        problem = "block_tables must be int64 [G, max_blocks], one row per query row";
    else if (lens.scalar_type() != ScalarType::Long || lens.dim() != 1 || lens.size(0) != q.size(0))
        problem = "seq_lens must be int64 [G], one length per query row";
    if (problem)
        throw std::invalid_argument(std::string("stagewise decode attention: ") + problem + "; got q " + shape(q) + " "
                                    + dtype_name(q.scalar_type()) + ", cache " + shape(cache) + " "
                                    + dtype_name(cache.scalar_type()) + ", block_tables " + shape(tables) + " "
                                    + dtype_name(tables.scalar_type()) + ", seq_lens " + shape(lens) + " "
                                    + dtype_name(lens.scalar_type()) + ".");
}

/* kernels/attention.py `_bad_table`: the sentence for the kernel's refusal of sequence `row` */
std::invalid_argument bad_table(int64_t row, const Tensor& cache, const Tensor& tables, const Tensor& lens) {
    int64_t nb = cache.size(1), bs = cache.size(2), width = tables.size(1);
    int64_t length = static_cast<const int64_t*>(lens.data_ptr())[row];
    std::ostringstream s;
    s << "stagewise decode attention: sequence " << row;
    if (length < 1 || length > width * bs) {
        s << " has " << length << " keys, but its block table row holds " << width << " blocks of " << bs << " (1 to "
          << width * bs << " keys).";
    } else {
        const int64_t* ids = static_cast<const int64_t*>(tables.data_ptr()) + row * tables.stride(0);
        s << " reads blocks [";
        for (int64_t i = 0; i < (length + bs - 1) / bs; i++) s << (i ? ", " : "") << ids[i];
        s << "], but the cache holds blocks 0.." << nb - 1 << ".";
    }
    return std::invalid_argument(s.str());
}

template <typename T>
using decode_fn = int64_t (*)(STAGEWISE_DECODE_ARGS(T));

template <typename T>
int64_t run_decode(decode_fn<T> fn, const Tensor& q, const Tensor& cache, const Tensor& tables, const Tensor& lens,
                   double scale, int64_t hpt, Tensor& out) {
    int64_t nb = cache.size(1), bs = cache.size(2), hkv = cache.size(3), d = cache.size(4);
    const T* k = static_cast<const T*>(cache.data_ptr());
    return fn(static_cast<const T*>(q.data_ptr()), q.stride(0), k, k + nb * bs * hkv * d, bs * hkv * d, nb,
              static_cast<const int64_t*>(tables.data_ptr()), tables.stride(0), tables.size(1),
              static_cast<const int64_t*>(lens.data_ptr()), q.size(0), q.size(1), hkv, d, bs, static_cast<float>(scale),
              hpt, static_cast<T*>(out.data_ptr()));
}

/* kernels/attention.py `_decode` */
Tensor decode_attention(Tensor q, Tensor cache, Tensor tables, Tensor lens, double scale,
                        std::optional<bool> per_sequence) {
    check_decode(q, cache, tables, lens);
    int64_t g = q.size(0), hq = q.size(1), d = q.size(2), hkv = cache.size(3);
    if (q.stride(2) != 1 || q.stride(1) != d) q = torch::stable::contiguous(q);
    tables = torch::stable::contiguous(tables);
    lens = torch::stable::contiguous(lens);
    Tensor out = torch::stable::new_empty(q, Shape{g, hq, d});
    /* a task per sequence reads each key row once; with fewer than two sequences per thread, a task
       per (sequence, KV head) keeps every thread busy (the two give identical results) */
    bool per_seq = per_sequence ? *per_sequence : g >= 2 * static_cast<int64_t>(torch::stable::get_num_threads());
    int64_t hpt = per_seq ? hkv : 1, bad;
    if (q.scalar_type() == ScalarType::Float)
        bad = run_decode<float>(d % 16 == 0 && decode_attention16_f32 ? decode_attention16_f32 : decode_attention_f32,
                                q, cache, tables, lens, scale, hpt, out);
    else
        bad = run_decode<uint16_t>(d % 16 == 0 && decode_attention16_bf16 ? decode_attention16_bf16 : decode_attention_bf16,
                                   q, cache, tables, lens, scale, hpt, out);
    if (bad) throw bad_table(bad - 1, cache, tables, lens);
    return out;
}

template <typename T>
using rows_fn = int64_t (*)(STAGEWISE_ROWS_ARGS(T));

template <typename T>
int64_t run_rows(rows_fn<T> fn, const Tensor& q, const Tensor& cache, const Tensor& tables, const Tensor& spans,
                 const Tensor& lens, double scale, int64_t hpt, Tensor& out) {
    int64_t nb = cache.size(1), bs = cache.size(2), hkv = cache.size(3), d = cache.size(4);
    const T* k = static_cast<const T*>(cache.data_ptr());
    return fn(static_cast<const T*>(q.data_ptr()), q.stride(0), k, k + nb * bs * hkv * d, bs * hkv * d, nb,
              static_cast<const int64_t*>(tables.data_ptr()), tables.stride(0), tables.size(1),
              static_cast<const int64_t*>(lens.data_ptr()), q.size(0), static_cast<const int64_t*>(spans.data_ptr()),
              tables.size(0), q.size(1), hkv, d, bs, static_cast<float>(scale), hpt, static_cast<T*>(out.data_ptr()));
}

/* kernels/attention.py `_rows` (and `_check_rows`) */
Tensor rows_attention(Tensor q, Tensor cache, Tensor tables, Tensor spans, Tensor lens, double scale) {
    check_decode(q, cache, tables, lens, true);
    if (tables.scalar_type() != ScalarType::Long || tables.dim() != 2)
        throw std::invalid_argument("stagewise rows attention: span_tables must be int64 [S, max_blocks]; got "
                                    + shape(tables) + " " + dtype_name(tables.scalar_type()) + ".");
    if (spans.scalar_type() != ScalarType::Long || spans.dim() != 1 || spans.size(0) != tables.size(0) + 1)
        throw std::invalid_argument("stagewise rows attention: spans must be int64 [S + 1], one more than the table "
                                    "rows (" + std::to_string(tables.size(0)) + "); got " + shape(spans) + " "
                                    + dtype_name(spans.scalar_type()) + ".");
    int64_t g = q.size(0), hq = q.size(1), d = q.size(2), hkv = cache.size(3), n_spans = tables.size(0);
    if (q.stride(2) != 1 || q.stride(1) != d) q = torch::stable::contiguous(q);
    tables = torch::stable::contiguous(tables);
    lens = torch::stable::contiguous(lens);
    spans = torch::stable::contiguous(spans);
    Tensor out = torch::stable::new_empty(q, Shape{g, hq, d});
    int64_t hpt = n_spans >= 2 * static_cast<int64_t>(torch::stable::get_num_threads()) ? hkv : 1, bad;
    if (q.scalar_type() == ScalarType::Float)
        bad = run_rows<float>(d % 16 == 0 && decode_attention16_f32_rows ? decode_attention16_f32_rows
                                                                          : decode_attention_f32_rows,
                              q, cache, tables, spans, lens, scale, hpt, out);
    else
        bad = run_rows<uint16_t>(d % 16 == 0 && decode_attention16_bf16_rows ? decode_attention16_bf16_rows
                                                                              : decode_attention_bf16_rows,
                                 q, cache, tables, spans, lens, scale, hpt, out);
    if (bad) {
        int64_t span = bad - 1, width = tables.size(1) * cache.size(2);
        const int64_t* at = static_cast<const int64_t*>(spans.data_ptr());
        std::ostringstream m;
        m << "stagewise rows attention: span " << span << " of " << n_spans << " (rows [" << at[span] << ", "
          << at[span + 1] << "], spans must rise from 0 to " << g << " by 1..64) has a row length outside 1.." << width
          << " or reads blocks outside 0.." << cache.size(1) - 1 << ".";
        throw std::invalid_argument(m.str());
    }
    return out;
}

/* kernels/attention.py `_check_prefill` */
void check_prefill(const Tensor& q, const Tensor& k, const Tensor& v) {
    bool ok = prefill_attention_bf16 && q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.is_cpu()
              && q.scalar_type() == ScalarType::BFloat16 && k.scalar_type() == q.scalar_type()
              && v.scalar_type() == k.scalar_type() && k.size(0) == q.size(0) && v.size(0) == k.size(0)
              && k.size(1) == v.size(1) && k.size(2) == v.size(2) && k.size(2) == q.size(2) && q.size(2) % 16 == 0
              && k.size(1) >= 1 && q.size(1) % k.size(1) == 0;
    if (!ok)
        throw std::invalid_argument(
            "stagewise prefill attention: it needs CPU bfloat16 q [n, Hq, D] and k, v [n, Hkv, D] with D a multiple of "
            "16, Hq a multiple of Hkv, and a CPU with AVX512-BF16; got q " + shape(q) + " " + dtype_name(q.scalar_type())
            + ", k " + shape(k) + " " + dtype_name(k.scalar_type()) + ", v " + shape(v) + " " + dtype_name(v.scalar_type())
            + ".");
}

/* kernels/attention.py `_prefill` */
Tensor prefill_attention(Tensor q, Tensor k, Tensor v, double scale) {
    check_prefill(q, k, v);
    int64_t n = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(1);
    if (q.stride(2) != 1 || q.stride(1) != d) q = torch::stable::contiguous(q);
    bool same = k.stride(0) == v.stride(0) && k.stride(1) == v.stride(1) && k.stride(2) == v.stride(2);
    if (!same || k.stride(2) != 1 || k.stride(1) != d) {
        k = torch::stable::contiguous(k);
        v = torch::stable::contiguous(v);
    }
    Tensor out = torch::stable::new_empty(q, Shape{n, hq, d});
    if (n)
        prefill_attention_bf16(static_cast<const uint16_t*>(q.data_ptr()), q.stride(0),
                               static_cast<const uint16_t*>(k.data_ptr()), static_cast<const uint16_t*>(v.data_ptr()),
                               k.stride(0), n, hq, hkv, d, static_cast<float>(scale),
                               static_cast<uint16_t*>(out.data_ptr()), out.stride(0));
    return out;
}

}  // namespace
}  // namespace stagewise

STABLE_TORCH_LIBRARY_IMPL(stagewise, CPU, m) {
    m.impl("decode_attention", TORCH_BOX(&stagewise::decode_attention));
    m.impl("rows_attention", TORCH_BOX(&stagewise::rows_attention));
    m.impl("prefill_attention", TORCH_BOX(&stagewise::prefill_attention));
}
