/* comm_nccl.c - the NCCL collective backend (comm.h's table over device
 * buffers), calling NCCL through the table nccl_load.c fills at run time.
 *
 * Streams: one per communicator (the collective role; flatshard's copy-in
 * kernels run on the caller's stream). Each collective is ordered after the
 * caller's stream with an event and makes the caller's stream wait for it
 * with another, so the host never waits on the hot path. Buffers freed by
 * the caller after a call are reused by torch's caching allocator in the
 * caller's stream order, which already waits for the collective.
 *
 * Errors: a failed NCCL call, or an asynchronous error seen when issuing or
 * waiting, is reported with NCCL's own words in last_error; anything but a
 * usage error aborts the communicator (ncclCommAbort) so peers fail instead
 * of hanging. Waits poll with a timeout and abort when it passes. A
 * collective nobody waits for on the host is timed by the communicator's
 * watchdog thread (nccl_watchdog.c), which aborts too; the next call then
 * fails with the watchdog's verdict, naming the collective that hung.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep */

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm.h"
#include "fs_cuda.h"
#include "fs_nccl.h"
#include "nccl_watchdog.h"

/* ---------------------------------------------------------------------------
 * the communicator */

typedef struct {
    ncclComm_t comm;
    int device;
    cudaStream_t stream; /* the collectives' own stream */
    cudaStream_t caller; /* ordered against this one (torch's current stream) */
    cudaEvent_t ready, done;
    void *ws; /* f32 staging for low-precision reductions (caller's memory) */
    size_t ws_bytes;
    float *scratch; /* one float, for barrier */
    int in_group;
    int defer; /* the caller's stream does not wait (it waits on a recorded mark) */
    _Atomic int aborted; /* set once, by the issuing thread or the watchdog */
    int closed; /* fs_nccl_close ran: the NCCL objects are gone, this record stays */
    /* ncclCommAbort frees the communicator and may come from the watchdog's
     * thread: NCCL calls and the abort hold this, and no call is made on an
     * aborted communicator. */
    pthread_mutex_t mu;
    double timeout_s;
    fs_watchdog *watch;
} nccl_impl;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void n_abort(fs_comm *c, const char *why)
{
    nccl_impl *m = c->impl;
    pthread_mutex_lock(&m->mu);
    const int was = atomic_exchange(&m->aborted, 1);
    if (!was)
        fs_nccl.CommAbort(m->comm);
    pthread_mutex_unlock(&m->mu);
    if (!was && why && *why)
        snprintf(c->last_error, sizeof c->last_error, "aborted: %s", why);
}

/* The watchdog's abort, from its thread: last_error belongs to the issuing
 * thread, which reads the verdict at its next call (refused()). If that
 * thread is stuck inside an NCCL call (holding the lock) for as long again,
 * abort anyway: ncclCommAbort is what unblocks it. */
static void watch_abort(void *ctx)
{
    nccl_impl *m = ((fs_comm *)ctx)->impl;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)m->timeout_s + 1;
    const int locked = pthread_mutex_timedlock(&m->mu, &until) == 0;
    if (!atomic_exchange(&m->aborted, 1))
        fs_nccl.CommAbort(m->comm);
    if (locked)
        pthread_mutex_unlock(&m->mu);
}

/* A call on an aborted (or closed) communicator: say why it was aborted. */
static fs_status refused(fs_comm *c, const char *op)
{
    nccl_impl *m = c->impl;
    char verdict[480];
    if (m->closed)
        snprintf(c->last_error, sizeof c->last_error, "%s: the NCCL communicator is closed", op);
    else if (fs_watchdog_fired(m->watch, verdict, sizeof verdict))
        snprintf(c->last_error, sizeof c->last_error,
                 "%s: the NCCL communicator was aborted by its watchdog: %s", op, verdict);
    else
        snprintf(c->last_error, sizeof c->last_error,
                 "%s: the NCCL communicator was aborted after an earlier failure", op);
    return FS_ERR_BACKEND;
}

static fs_status cuda_fail(fs_comm *c, const char *op, cudaError_t e)
{
    snprintf(c->last_error, sizeof c->last_error, "%s: CUDA error %s (%s)", op,
             cudaGetErrorName(e), cudaGetErrorString(e));
    return FS_ERR_BACKEND;
}

/* NCCL said r for op: record its words; abort unless it was a usage error
 * found when issuing (the communicator stays sound then, and this rank's
 * caller is at fault). Asynchronous errors always abort. */
static fs_status nccl_fail_x(fs_comm *c, const char *op, ncclResult_t r, int force_abort)
{
    nccl_impl *m = c->impl;
    char detail[256] = "";
    pthread_mutex_lock(&m->mu);
    if (fs_nccl.GetLastError && !atomic_load(&m->aborted)) {
        const char *d = fs_nccl.GetLastError(m->comm);
        snprintf(detail, sizeof detail, "%s", d ? d : "");
    }
    pthread_mutex_unlock(&m->mu);
    snprintf(c->last_error, sizeof c->last_error, "%s: NCCL error %d (%s)%s%s", op, (int)r,
             fs_nccl.GetErrorString(r), *detail ? ": " : "", detail);
    if (force_abort || (r != ncclInvalidArgument && r != ncclInvalidUsage))
        n_abort(c, NULL);
    return FS_ERR_BACKEND;
}

static fs_status nccl_fail(fs_comm *c, const char *op, ncclResult_t r)
{
    return nccl_fail_x(c, op, r, 0);
}

static fs_status check_async(fs_comm *c, const char *op)
{
    nccl_impl *m = c->impl;
    ncclResult_t a = ncclSuccess, r = ncclSuccess;
    pthread_mutex_lock(&m->mu);
    const int gone = atomic_load(&m->aborted);
    if (!gone)
        r = fs_nccl.CommGetAsyncError(m->comm, &a);
    pthread_mutex_unlock(&m->mu);
    if (gone)
        return refused(c, op);
    if (r != ncclSuccess)
        return nccl_fail(c, op, r);
    if (a != ncclSuccess && a != ncclInProgress) {
        char what[96];
        snprintf(what, sizeof what, "%s (asynchronous error of an earlier collective)", op);
        return nccl_fail_x(c, what, a, 1);
    }
    return FS_OK;
}

static ncclDataType_t nccl_dtype(fs_dtype t)
{
    static const ncclDataType_t map[FS_DTYPE_COUNT] = {
        ncclFloat32, ncclFloat16, ncclBfloat16, ncclFloat64, ncclUint8, ncclInt32, ncclInt64,
    };
    return map[t];
}

/* Before a collective: the comm stream waits for the caller's work. */
static fs_status enter(fs_comm *c, const char *op)
{
    nccl_impl *m = c->impl;
    if (atomic_load(&m->aborted))
        return refused(c, op);
    cudaError_t e = cudaSetDevice(m->device);
    if (e != cudaSuccess)
        return cuda_fail(c, op, e);
    FS_CHECK(check_async(c, op));
    if (m->in_group) /* group_start already ordered the stream */
        return FS_OK;
    if ((e = cudaEventRecord(m->ready, m->caller)) != cudaSuccess ||
        (e = cudaStreamWaitEvent(m->stream, m->ready, 0)) != cudaSuccess)
        return cuda_fail(c, op, e);
    return FS_OK;
}

/* After: the watchdog times the collective; the caller's stream waits for
 * it (unless deferred). */
static fs_status leave(fs_comm *c, const char *op)
{
    nccl_impl *m = c->impl;
    if (m->in_group) /* timed as one, at group_end */
        return FS_OK;
    fs_watchdog_track(m->watch, m->stream, op, c->what);
    if (m->defer)
        return FS_OK;
    cudaError_t e;
    if ((e = cudaEventRecord(m->done, m->stream)) != cudaSuccess ||
        (e = cudaStreamWaitEvent(m->caller, m->done, 0)) != cudaSuccess)
        return cuda_fail(c, op, e);
    return FS_OK;
}

/* An NCCL call on c's communicator, under its lock, never after an abort. */
#define NCCL_TRY(c, op, call)                                 \
    do {                                                      \
        nccl_impl *m_ = (c)->impl;                            \
        pthread_mutex_lock(&m_->mu);                          \
        const int gone_ = atomic_load(&m_->aborted);          \
        const ncclResult_t r_ = gone_ ? ncclSuccess : (call); \
        pthread_mutex_unlock(&m_->mu);                        \
        if (gone_)                                            \
            return refused(c, op);                            \
        if (r_ != ncclSuccess)                                \
            return nccl_fail(c, op, r_);                      \
    } while (0)

#define CUDA_TRY(c, op, call)                  \
    do {                                       \
        cudaError_t e_ = (call);               \
        if (e_ != cudaSuccess)                 \
            return cuda_fail(c, op, e_);       \
    } while (0)

static fs_status n_all_gather(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t)
{
    nccl_impl *m = c->impl;
    FS_CHECK(enter(c, "all_gather"));
    NCCL_TRY(c, "ncclAllGather",
             fs_nccl.AllGather(send, recv, (size_t)count, nccl_dtype(t), m->comm, m->stream));
    return leave(c, "all_gather");
}

/* bf16/f16 reductions accumulate in f32 (comm.h): widen into the staging
 * buffer, reduce there in f32, narrow the result (averaging on the way). */
static fs_status staged(fs_comm *c, const char *op, size_t need)
{
    nccl_impl *m = c->impl;
    if (m->in_group) {
        snprintf(c->last_error, sizeof c->last_error, "%s: a bfloat16/float16 reduction inside a "
                 "group is not supported (it needs a cast after the group ends); reduce in "
                 "float32 or issue it outside the group", op);
        return FS_ERR_UNSUPPORTED;
    }
    if (!m->ws || m->ws_bytes < need) {
        snprintf(c->last_error, sizeof c->last_error, "%s: a bfloat16/float16 reduction needs "
                 "a float32 workspace of %zu bytes, set %zu (set_workspace)", op, need,
                 m->ws ? m->ws_bytes : (size_t)0);
        return FS_ERR_INVALID_ARG;
    }
    return FS_OK;
}

static fs_status n_reduce_scatter(fs_comm *c, const void *send, void *recv, int64_t recv_count,
                                  fs_dtype t, fs_redop op)
{
    nccl_impl *m = c->impl;
    const double scale = op == FS_RED_AVG ? 1.0 / c->world_size : 1.0;
    const int64_t total = recv_count * c->world_size;
    if (t == FS_F16 || t == FS_BF16) {
        FS_CHECK(staged(c, "reduce_scatter", (size_t)total * 4));
        FS_CHECK(enter(c, "reduce_scatter"));
        float *ws = m->ws, *mine = ws + (int64_t)c->rank * recv_count;
        CUDA_TRY(c, "reduce_scatter (widen)", fs_cuda_cast(ws, FS_F32, send, t, total, m->stream));
        NCCL_TRY(c, "ncclReduceScatter",
                 fs_nccl.ReduceScatter(ws, mine, (size_t)recv_count, ncclFloat32, ncclSum,
                                       m->comm, m->stream));
        CUDA_TRY(c, "reduce_scatter (narrow)", fs_cuda_scale_accumulate(recv, t, mine, FS_F32,
                                                                        recv_count, scale, 0,
                                                                        m->stream));
        return leave(c, "reduce_scatter");
    }
    FS_CHECK(enter(c, "reduce_scatter"));
    NCCL_TRY(c, "ncclReduceScatter",
             fs_nccl.ReduceScatter(send, recv, (size_t)recv_count, nccl_dtype(t), ncclSum,
                                   m->comm, m->stream));
    if (op == FS_RED_AVG) /* sum, then divide: the same rounding as the CPU backends */
        CUDA_TRY(c, "reduce_scatter (average)",
                 fs_cuda_scale_accumulate(recv, t, recv, t, recv_count, scale, 0, m->stream));
    return leave(c, "reduce_scatter");
}

static fs_status n_all_reduce(fs_comm *c, void *buf, int64_t count, fs_dtype t, fs_redop op)
{
    nccl_impl *m = c->impl;
    const double scale = op == FS_RED_AVG ? 1.0 / c->world_size : 1.0;
    void *work = buf;
    fs_dtype wt = t;
    if (t == FS_F16 || t == FS_BF16) {
        FS_CHECK(staged(c, "all_reduce", (size_t)count * 4));
        work = m->ws;
        wt = FS_F32;
    }
    FS_CHECK(enter(c, "all_reduce"));
    if (work != buf)
        CUDA_TRY(c, "all_reduce (widen)", fs_cuda_cast(work, FS_F32, buf, t, count, m->stream));
    NCCL_TRY(c, "ncclAllReduce",
             fs_nccl.AllReduce(work, work, (size_t)count, nccl_dtype(wt), ncclSum, m->comm,
                               m->stream));
    if (work != buf || op == FS_RED_AVG)
        CUDA_TRY(c, "all_reduce (narrow/average)",
                 fs_cuda_scale_accumulate(buf, t, work, wt, count, scale, 0, m->stream));
    return leave(c, "all_reduce");
}

static fs_status n_broadcast(fs_comm *c, void *buf, int64_t count, fs_dtype t, int root)
{
    nccl_impl *m = c->impl;
    FS_CHECK(enter(c, "broadcast"));
    NCCL_TRY(c, "ncclBroadcast",
             fs_nccl.Broadcast(buf, buf, (size_t)count, nccl_dtype(t), root, m->comm, m->stream));
    return leave(c, "broadcast");
}

fs_status fs_nccl_wait(fs_comm *c, double timeout_s)
{
    nccl_impl *m = c->impl;
    if (atomic_load(&m->aborted))
        return refused(c, "wait");
    CUDA_TRY(c, "wait", cudaSetDevice(m->device));
    CUDA_TRY(c, "wait", cudaEventRecord(m->done, m->stream));
    const double start = now_s();
    struct timespec nap = {0, 20000}; /* 20 us, doubling to 1 ms */
    for (;;) {
        cudaError_t e = cudaEventQuery(m->done);
        if (e == cudaSuccess)
            return check_async(c, "wait");
        if (e != cudaErrorNotReady) { /* a device fault: the peers would wait forever */
            cuda_fail(c, "wait", e);
            n_abort(c, NULL);
            return FS_ERR_BACKEND;
        }
        FS_CHECK(check_async(c, "wait"));
        if (now_s() - start > timeout_s) {
            snprintf(c->last_error, sizeof c->last_error,
                     "wait: collectives on rank %d did not finish within %.0f s (another rank "
                     "missing or stopped?); communicator aborted", c->rank, timeout_s);
            n_abort(c, NULL);
            return FS_ERR_BACKEND;
        }
        nanosleep(&nap, NULL);
        if (nap.tv_nsec < 1000000)
            nap.tv_nsec *= 2;
    }
}

/* All-to-all as NCCL builds it: one send and one receive per peer in one
 * NCCL group (inside an open flatshard group, part of that one). Bytes
 * only: quantized payloads (engine/link_quant.c). */
static fs_status n_all_to_all(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t)
{
    nccl_impl *m = c->impl;
    if (!fs_nccl.Send || !fs_nccl.Recv) {
        snprintf(c->last_error, sizeof c->last_error, "all_to_all: this NCCL library has no "
                 "ncclSend/ncclRecv (NCCL 2.7 or later needed)");
        return FS_ERR_UNSUPPORTED;
    }
    const size_t bytes = (size_t)count * fs_dtype_size(t);
    FS_CHECK(enter(c, "all_to_all"));
    if (!m->in_group)
        NCCL_TRY(c, "ncclGroupStart", fs_nccl.GroupStart());
    ncclResult_t first = ncclSuccess;
    pthread_mutex_lock(&m->mu);
    const int gone = atomic_load(&m->aborted);
    for (int r = 0; r < c->world_size && !gone && first == ncclSuccess; r++) {
        ncclResult_t a = fs_nccl.Send((const char *)send + r * bytes, bytes, ncclUint8, r,
                                      m->comm, m->stream);
        ncclResult_t b = a == ncclSuccess ? fs_nccl.Recv((char *)recv + r * bytes, bytes,
                                                         ncclUint8, r, m->comm, m->stream)
                                          : a;
        first = b;
    }
    pthread_mutex_unlock(&m->mu);
    if (!m->in_group)
        NCCL_TRY(c, "ncclGroupEnd", fs_nccl.GroupEnd());
    if (gone)
        return refused(c, "all_to_all");
    if (first != ncclSuccess)
        return nccl_fail(c, "ncclSend/ncclRecv", first);
    return leave(c, "all_to_all");
}

/* NCCL has no barrier: an all-reduce of one float, then a bounded wait. */
static fs_status n_barrier(fs_comm *c)
{
    nccl_impl *m = c->impl;
    if (m->in_group) { /* its all-reduce would not start before group_end: no barrier */
        snprintf(c->last_error, sizeof c->last_error, "barrier: not allowed inside a group");
        return FS_ERR_BAD_STATE;
    }
    FS_CHECK(enter(c, "barrier"));
    NCCL_TRY(c, "ncclAllReduce (barrier)",
             fs_nccl.AllReduce(m->scratch, m->scratch, 1, ncclFloat32, ncclSum, m->comm,
                               m->stream));
    FS_CHECK(leave(c, "barrier"));
    return fs_nccl_wait(c, m->timeout_s);
}

void fs_nccl_close(fs_comm *c)
{
    nccl_impl *m = c->impl;
    if (m->closed)
        return;
    fs_watchdog_stop(m->watch); /* first: it may abort the communicator */
    m->watch = NULL;
    if (m->comm) {
        /* ncclCommDestroy waits for pending work: abort instead when it has
         * not finished in time (or the process is already failing). */
        if (!atomic_load(&m->aborted) && fs_nccl_wait(c, m->timeout_s) == FS_OK)
            fs_nccl.CommDestroy(m->comm);
        else
            n_abort(c, NULL);
    }
    atomic_store(&m->aborted, 1); /* every later call is refused(), none reaches NCCL */
    m->closed = 1;
    /* Errors ignored: at interpreter exit the CUDA runtime may be gone. */
    if (m->scratch)
        cudaFree(m->scratch);
    if (m->ready)
        cudaEventDestroy(m->ready);
    if (m->done)
        cudaEventDestroy(m->done);
    if (m->stream)
        cudaStreamDestroy(m->stream);
    m->scratch = NULL;
    m->ready = m->done = NULL;
    m->stream = NULL;
}

static void n_destroy(fs_comm *c)
{
    nccl_impl *m = c->impl;
    fs_nccl_close(c);
    pthread_mutex_destroy(&m->mu);
    free(m);
    free(c);
}

static const fs_comm_ops nccl_ops = {
    "nccl", 0, n_all_gather, n_reduce_scatter, n_all_reduce, n_broadcast, n_barrier, n_destroy,
    n_abort, n_all_to_all,
};

fs_status fs_comm_nccl_create(const unsigned char id[128], int rank, int world_size, int device,
                              double timeout_s, fs_comm **out, char *err, size_t cap)
{
    if (!fs_nccl.lib) {
        snprintf(err, cap, "NCCL is not loaded");
        return FS_ERR_BACKEND;
    }
    if (world_size < 1 || rank < 0 || rank >= world_size || device < 0 || !(timeout_s > 0)) {
        snprintf(err, cap, "need 0 <= rank < world_size, device >= 0, timeout_s > 0");
        return FS_ERR_INVALID_ARG;
    }
    fs_comm *c = calloc(1, sizeof *c);
    nccl_impl *m = calloc(1, sizeof *m);
    if (!c || !m) {
        free(c);
        free(m);
        return FS_ERR_NO_MEMORY;
    }
    pthread_mutex_init(&m->mu, NULL);
    m->device = device;
    m->timeout_s = timeout_s;
    c->ops = &nccl_ops;
    c->rank = rank;
    c->world_size = world_size;
    c->impl = m;
    cudaError_t e;
    const char *what = "cudaSetDevice";
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (what = "cudaStreamCreate", e = cudaStreamCreateWithFlags(&m->stream,
                                                                  cudaStreamNonBlocking)) ||
        (what = "cudaEventCreate", e = cudaEventCreateWithFlags(&m->ready,
                                                                cudaEventDisableTiming)) ||
        (e = cudaEventCreateWithFlags(&m->done, cudaEventDisableTiming)) ||
        (what = "cudaMalloc", e = cudaMalloc((void **)&m->scratch, sizeof(float)))) {
        snprintf(err, cap, "%s on device %d: %s", what, device, cudaGetErrorString(e));
        n_destroy(c);
        return FS_ERR_BACKEND;
    }
    ncclUniqueId uid;
    memcpy(uid.internal, id, sizeof uid.internal);
    ncclResult_t r = fs_nccl.CommInitRank(&m->comm, world_size, uid, rank);
    if (r != ncclSuccess) {
        const char *detail = fs_nccl.GetLastError ? fs_nccl.GetLastError(NULL) : "";
        snprintf(err, cap, "ncclCommInitRank(rank %d of %d, device %d): %s%s%s", rank, world_size,
                 device, fs_nccl.GetErrorString(r), detail && *detail ? ": " : "",
                 detail ? detail : "");
        m->comm = NULL;
        n_destroy(c);
        return FS_ERR_BACKEND;
    }
    if (!(m->watch = fs_watchdog_start(device, rank, timeout_s, watch_abort, c, err, cap))) {
        n_destroy(c);
        return FS_ERR_BACKEND;
    }
    *out = c;
    return FS_OK;
}

void fs_nccl_set_caller_stream(fs_comm *c, cudaStream_t s) { ((nccl_impl *)c->impl)->caller = s; }

void fs_nccl_set_workspace(fs_comm *c, void *ptr, size_t bytes)
{
    nccl_impl *m = c->impl;
    m->ws = ptr;
    m->ws_bytes = ptr ? bytes : 0;
}

cudaStream_t fs_nccl_stream(fs_comm *c) { return ((nccl_impl *)c->impl)->stream; }

fs_status fs_nccl_group_start(fs_comm *c)
{
    nccl_impl *m = c->impl;
    if (m->in_group) {
        snprintf(c->last_error, sizeof c->last_error, "group_start: a group is already open");
        return FS_ERR_BAD_STATE;
    }
    FS_CHECK(enter(c, "group_start"));
    NCCL_TRY(c, "ncclGroupStart", fs_nccl.GroupStart());
    m->in_group = 1;
    return FS_OK;
}

fs_status fs_nccl_group_end(fs_comm *c)
{
    nccl_impl *m = c->impl;
    if (!m->in_group) {
        snprintf(c->last_error, sizeof c->last_error, "group_end: no group is open");
        return FS_ERR_BAD_STATE;
    }
    m->in_group = 0;
    NCCL_TRY(c, "ncclGroupEnd", fs_nccl.GroupEnd());
    return leave(c, "group_end");
}

void fs_nccl_set_defer(fs_comm *c, int defer) { ((nccl_impl *)c->impl)->defer = defer; }

fs_status fs_nccl_record(fs_comm *c, void **event)
{
    nccl_impl *m = c->impl;
    if (m->closed)
        return refused(c, "record");
    CUDA_TRY(c, "record", cudaSetDevice(m->device));
    if (!*event)
        CUDA_TRY(c, "record", cudaEventCreateWithFlags((cudaEvent_t *)event,
                                                       cudaEventDisableTiming));
    CUDA_TRY(c, "record", cudaEventRecord((cudaEvent_t)*event, m->stream));
    return FS_OK;
}

fs_status fs_nccl_follow_caller(fs_comm *c)
{
    if (((nccl_impl *)c->impl)->in_group)
        return FS_OK; /* group_start ordered the stream already */
    return enter(c, "follow_caller");
}
