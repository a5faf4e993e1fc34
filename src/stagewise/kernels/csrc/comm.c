/* Collectives of one node's tensor-parallel group through a shared-memory file.

   The file holds a header (the group's size, each rank's sequence number on its own cache line,
   an abort flag) and two buffers of one slot per rank. An all-reduce of n elements runs in chunks
   of a slot: for its s-th chunk a rank copies its part into its slot of buffer s % 2, publishes s
   (release), waits until every rank has published s (acquire), and sums all slots in rank order
   into its output, so every rank holds the same bits. Two buffers make one wait per chunk enough:
   a rank writes buffer s % 2 again at s + 2 only after every rank has published s + 1, which each
   does only after it finished reading chunk s.

   Waiting spins with a pause, then yields the CPU, then sleeps in short naps (a peer that is not
   running keeps no core busy for long); a wait longer than the handle's timeout aborts the group,
   so every rank stops with an error instead of hanging. */
#define _GNU_SOURCE
#include "comm.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "vec.h"

#define MAGIC 0x3130505457474153ULL /* "SAGWTP01" */
#define MAX_RANKS 64
#define MAX_HANDLES 64
#define SPIN_PAUSES 4000            /* ~10-40 us of pauses before yielding */
#define NAP_AFTER_NS 2000000        /* then sched_yield for 2 ms, then naps */
#define NAP_NS 20000
#define PARALLEL_MIN 65536          /* elements from which a sum is split over OpenMP threads */

typedef struct {
    _Atomic int64_t v;
    char pad[56];
} line_t;

typedef struct {
    _Atomic uint64_t magic; /* written last by comm_create */
    int64_t size, slot_bytes;
    char pad[40];
    line_t attached, aborted;
    line_t seq[MAX_RANKS];
} header_t;

typedef struct {
    header_t* hdr;
    char* data;           /* buffers [2][size][slot_bytes] */
    int64_t rank, size, slot_bytes, seq, timeout_ns, mapped;
} comm_t;

static comm_t* handles[MAX_HANDLES];
static pthread_mutex_t handles_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t data_offset(void) { return ((int64_t)sizeof(header_t) + 4095) / 4096 * 4096; }

int64_t comm_file_bytes(int64_t size, int64_t slot_bytes) { return data_offset() + 2 * size * slot_bytes; }

int64_t comm_create(const char* path, int64_t size, int64_t slot_bytes) {
    if (!path || size < 1 || size > MAX_RANKS || slot_bytes < 64 || slot_bytes % 64) return COMM_BAD_ARGS;
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) return -errno;
    int64_t bytes = comm_file_bytes(size, slot_bytes);
    int64_t rc = 0;
    header_t* hdr = MAP_FAILED;
    if (ftruncate(fd, bytes) != 0) rc = -errno;
    if (!rc) hdr = mmap(NULL, sizeof(header_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (!rc && hdr == MAP_FAILED) rc = -errno;
    if (!rc) {                    /* ftruncate zeroed everything: sequence numbers start at 0 */
        hdr->size = size;
        hdr->slot_bytes = slot_bytes;
        atomic_store_explicit(&hdr->magic, MAGIC, memory_order_release);
        munmap(hdr, sizeof(header_t));
    }
    close(fd);
    if (rc) unlink(path);
    return rc;
}

static comm_t* get(int64_t handle) {
    if (handle < 0 || handle >= MAX_HANDLES) return NULL;
    pthread_mutex_lock(&handles_lock);
    comm_t* c = handles[handle];
    pthread_mutex_unlock(&handles_lock);
    return c;
}

int64_t comm_attach(const char* path, int64_t rank, int64_t size, int64_t timeout_ms) {
    if (!path || size < 1 || size > MAX_RANKS || rank < 0 || rank >= size || timeout_ms < 1) return COMM_BAD_ARGS;
    int fd = open(path, O_RDWR);
    if (fd < 0) return -errno;
    struct stat st;
    int64_t rc = fstat(fd, &st) == 0 ? 0 : -errno;
    if (!rc && st.st_size < data_offset()) rc = COMM_BAD_ARGS;
    char* base = MAP_FAILED;
    if (!rc) base = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (rc) return rc;
    if (base == MAP_FAILED) return -errno;
    header_t* hdr = (header_t*)base;
    if (atomic_load_explicit(&hdr->magic, memory_order_acquire) != MAGIC || hdr->size != size
            || st.st_size < comm_file_bytes(size, hdr->slot_bytes)) {
        munmap(base, st.st_size);
        return COMM_BAD_ARGS;
    }
    comm_t* c = calloc(1, sizeof(comm_t));
    if (!c) {
        munmap(base, st.st_size);
        return -ENOMEM;
    }
    *c = (comm_t){hdr, base + data_offset(), rank, size, hdr->slot_bytes, 0, timeout_ms * 1000000, st.st_size};
    pthread_mutex_lock(&handles_lock);
    int64_t h = 0;
    while (h < MAX_HANDLES && handles[h]) h++;
    if (h < MAX_HANDLES) handles[h] = c;
    pthread_mutex_unlock(&handles_lock);
    if (h == MAX_HANDLES) {
        munmap(base, st.st_size);
        free(c);
        return -EMFILE;
    }
    atomic_fetch_add(&hdr->attached.v, 1);
    return h;
}

int64_t comm_attached(int64_t handle) {
    comm_t* c = get(handle);
    return c ? atomic_load(&c->hdr->attached.v) : COMM_BAD_HANDLE;
}

int64_t comm_rank(int64_t handle) {
    comm_t* c = get(handle);
    return c ? c->rank : COMM_BAD_HANDLE;
}

int64_t comm_size(int64_t handle) {
    comm_t* c = get(handle);
    return c ? c->size : COMM_BAD_HANDLE;
}

void comm_detach(int64_t handle) {
    comm_t* c = get(handle);
    if (!c) return;
    pthread_mutex_lock(&handles_lock);
    handles[handle] = NULL;
    pthread_mutex_unlock(&handles_lock);
    munmap(c->hdr, c->mapped);
    free(c);
}

void comm_abort(int64_t handle) {
    comm_t* c = get(handle);
    if (c) atomic_store(&c->hdr->aborted.v, 1);
}

static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield" ::: "memory");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* until every rank has published `seq` (acquire: their slots are then visible) */
static int64_t wait_peers(comm_t* c, int64_t seq) {
    int64_t start = 0;
    for (uint64_t spins = 0;; spins++) {
        int64_t q = 0;
        while (q < c->size && atomic_load_explicit(&c->hdr->seq[q].v, memory_order_acquire) >= seq) q++;
        if (q == c->size) return COMM_OK;
        if (atomic_load_explicit(&c->hdr->aborted.v, memory_order_relaxed)) return COMM_ABORTED;
        if (spins < SPIN_PAUSES) {
            cpu_pause();
            continue;
        }
        int64_t now = now_ns();
        if (!start) start = now;
        if (now - start > c->timeout_ns) {
            atomic_store(&c->hdr->aborted.v, 1);
            return COMM_TIMEOUT;
        }
        if (now - start < NAP_AFTER_NS) {
            sched_yield();
        } else {
            struct timespec nap = {0, NAP_NS};
            nanosleep(&nap, NULL);
        }
    }
}

static char* slot(const comm_t* c, int64_t seq, int64_t rank) {
    return c->data + ((seq & 1) * c->size + rank) * c->slot_bytes;
}

/* publish this rank's chunk of sequence number `seq` and wait for every rank's */
static int64_t exchange(comm_t* c, int64_t seq, const void* part, int64_t bytes) {
    if (atomic_load_explicit(&c->hdr->aborted.v, memory_order_relaxed)) return COMM_ABORTED;
    memcpy(slot(c, seq, c->rank), part, bytes);
    atomic_store_explicit(&c->hdr->seq[c->rank].v, seq, memory_order_release);
    return wait_peers(c, seq);
}

static void sum_f32(const comm_t* c, int64_t seq, float* out, int64_t m) {
    const float* first = (const float*)slot(c, seq, 0);
#pragma omp parallel for if (m >= PARALLEL_MIN) schedule(static)
    for (int64_t i0 = 0; i0 < m; i0 += 4096) {
        int64_t i1 = i0 + 4096 < m ? i0 + 4096 : m;
        memcpy(out + i0, first + i0, (i1 - i0) * sizeof(float));
        for (int64_t q = 1; q < c->size; q++) {
            const float* s = (const float*)slot(c, seq, q);
            for (int64_t i = i0; i < i1; i++) out[i] += s[i];
        }
    }
}

static void sum_bf16(const comm_t* c, int64_t seq, uint16_t* out, int64_t m) {
#pragma omp parallel for if (m >= PARALLEL_MIN) schedule(static)
    for (int64_t i0 = 0; i0 < m; i0 += 1024) {
        int64_t i1 = i0 + 1024 < m ? i0 + 1024 : m;
        float acc[1024];
        for (int64_t q = 0; q < c->size; q++) {
            const uint16_t* s = (const uint16_t*)slot(c, seq, q);
            for (int64_t i = i0; i < i1; i++) {
                uint32_t u = (uint32_t)s[i] << 16;
                float f;
                memcpy(&f, &u, 4);
                acc[i - i0] = q ? acc[i - i0] + f : f;
            }
        }
        for (int64_t i = i0; i < i1; i++) out[i] = f2bf(acc[i - i0]);
    }
}

int64_t comm_all_reduce(int64_t handle, const void* in, void* out, int64_t n, int64_t dtype) {
    comm_t* c = get(handle);
    if (!c) return COMM_BAD_HANDLE;
    if (n < 0 || (dtype != COMM_F32 && dtype != COMM_BF16) || (n > 0 && (!in || !out))) return COMM_BAD_ARGS;
    int64_t esize = dtype == COMM_F32 ? 4 : 2, chunk = c->slot_bytes / esize;
    for (int64_t off = 0; off < n; off += chunk) {
        int64_t m = n - off < chunk ? n - off : chunk;
        int64_t seq = ++c->seq;
        int64_t rc = exchange(c, seq, (const char*)in + off * esize, m * esize);
        if (rc) return rc;
        if (dtype == COMM_F32)
            sum_f32(c, seq, (float*)out + off, m);
        else
            sum_bf16(c, seq, (uint16_t*)out + off, m);
    }
    return COMM_OK;
}

int64_t comm_all_gather(int64_t handle, const void* in, void* out, int64_t rows, int64_t row_bytes, int64_t dst) {
    comm_t* c = get(handle);
    if (!c) return COMM_BAD_HANDLE;
    int64_t writes = dst < 0 || dst == c->rank;
    if (rows < 0 || row_bytes < 1 || row_bytes > c->slot_bytes || dst >= c->size
            || (rows > 0 && (!in || (writes && !out))))
        return COMM_BAD_ARGS;
    int64_t chunk = c->slot_bytes / row_bytes, out_row = c->size * row_bytes;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        int64_t m = rows - r0 < chunk ? rows - r0 : chunk;
        int64_t seq = ++c->seq;
        int64_t rc = exchange(c, seq, (const char*)in + r0 * row_bytes, m * row_bytes);
        if (rc) return rc;
        if (!writes) continue;
        for (int64_t q = 0; q < c->size; q++) {
            const char* s = slot(c, seq, q);
            char* o = (char*)out + r0 * out_row + q * row_bytes;
            for (int64_t r = 0; r < m; r++) memcpy(o + r * out_row, s + r * row_bytes, row_bytes);
        }
    }
    return COMM_OK;
}
