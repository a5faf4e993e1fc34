/* Collectives between the processes of one node through a shared-memory file (comm.c): the
   all-reduce and all-gather of a tensor-parallel group. Entry points shared by the C and the C++
   side (comm_ops.cpp). A group is a file every rank maps; a rank's view of it is a small integer
   handle, checked by every call. */
#ifndef STAGEWISE_COMM_H
#define STAGEWISE_COMM_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dtypes of comm_all_reduce */
enum { COMM_F32 = 0, COMM_BF16 = 1 };
/* return codes: 0 ok; negative: the call was refused before touching memory */
enum { COMM_OK = 0, COMM_TIMEOUT = 1, COMM_ABORTED = 2, COMM_BAD_HANDLE = -1, COMM_BAD_ARGS = -2 };

/* bytes of the file for `size` ranks with `slot_bytes` per rank and buffer */
int64_t comm_file_bytes(int64_t size, int64_t slot_bytes);
/* create the group's file at `path` (it must not exist): 0, or -errno */
int64_t comm_create(const char* path, int64_t size, int64_t slot_bytes);
/* map the file as `rank`: a handle >= 0, or a negative code (-errno, or COMM_BAD_ARGS when the file
   is not a group of `size` ranks) */
int64_t comm_attach(const char* path, int64_t rank, int64_t size, int64_t timeout_ms);
/* ranks that have attached so far */
int64_t comm_attached(int64_t handle);
void comm_detach(int64_t handle);
/* every rank ends waiting with COMM_ABORTED (a rank that cannot go on says so) */
void comm_abort(int64_t handle);
/* out[i] = sum over ranks in rank order of in[i] (bf16: summed in float32, rounded once), so
   every rank gets the same bits; `in` and `out` hold n elements and may be the same memory */
int64_t comm_all_reduce(int64_t handle, const void* in, void* out, int64_t n, int64_t dtype);
/* in: `rows` rows of `row_bytes`; out: `rows` rows of size * row_bytes, rank r's row at byte
   r * row_bytes. Only rank `dst` writes out (every rank where dst < 0). */
int64_t comm_all_gather(int64_t handle, const void* in, void* out, int64_t rows, int64_t row_bytes, int64_t dst);
/* the group's rank and size of a handle, or -1 */
int64_t comm_rank(int64_t handle);
int64_t comm_size(int64_t handle);

#ifdef __cplusplus
}
#endif
#endif
