/* fs_device.h - the device interface of the C core: what a unit needs, besides
 * collectives, to move its buffers when they live in an accelerator's memory.
 *
 * A unit over device memory cannot cast or accumulate with the host loops of
 * copy.h: it enqueues the same operations on a stream instead. A device
 * fills an fs_device_api table; flatshard._C_cuda exports the CUDA one as a
 * capsule (FS_DEVICE_API_CAPSULE), and flatshard._C exports a host one (the
 * copy.h loops, streams ignored) so that the device path of the units is
 * exercised on any machine. No CUDA header is needed to use the table:
 * streams are opaque pointers (a cudaStream_t for CUDA).
 *
 * Ordering: every call is enqueued on `stream`, the caller's current stream
 * (torch's), and a Comm bound to a device orders its collectives against the
 * same stream (set_caller_stream): each collective waits for the caller's
 * work so far, and the caller's later work waits for the collective, unless
 * the collective is deferred (set_defer): then the caller waits only where
 * it uses the result (record, then wait), which lets a prefetched all-gather
 * run beside the compute before it. Nothing here waits on the host. */
#ifndef FS_DEVICE_H
#define FS_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "fs_dtype.h"
#include "fs_status.h"

struct fs_comm;

#define FS_DEVICE_API_VERSION 6

typedef struct {
    int version; /* FS_DEVICE_API_VERSION: check before use */
    const char *name;
    /* copy.h's fs_cast / fs_scale_accumulate, enqueued on `stream`. On failure
     * the device's own words go to err (cap bytes) and FS_ERR_BACKEND is
     * returned (FS_ERR_INVALID_ARG for a broken precondition). */
    fs_status (*cast)(void *dst, fs_dtype dst_t, const void *src, fs_dtype src_t, int64_t n,
                      void *stream, char *err, size_t cap);
    fs_status (*scale_accumulate)(void *dst, fs_dtype dst_t, const void *src, fs_dtype src_t,
                                  int64_t n, double scale, int accumulate, void *stream,
                                  char *err, size_t cap);
    /* The Comm (of this device's backend) orders its next collectives after
     * `stream` and makes `stream` wait for them. */
    void (*set_caller_stream)(struct fs_comm *c, void *stream);
    /* float32 staging for bfloat16/float16 reductions (they accumulate in
     * float32): device memory of the caller's, or NULL to drop it. */
    void (*set_workspace)(struct fs_comm *c, void *ptr, size_t bytes);
    /* While defer is set, the next collectives do not make the caller's
     * stream wait for them. */
    void (*set_defer)(struct fs_comm *c, int defer);
    /* Mark everything the backend has issued so far in *event (made on the
     * first call; free it with event_free). */
    fs_status (*record)(struct fs_comm *c, void **event, char *err, size_t cap);
    /* `stream` waits (on the device, not the host) for the mark. */
    fs_status (*wait)(void *event, void *stream, char *err, size_t cap);
    void (*event_free)(void *event);
    /* The backend's own stream: work that must follow a deferred collective
     * is enqueued there (NULL on the host, where nothing is asynchronous). */
    void *(*comm_stream)(struct fs_comm *c);
    /* Parameter offload: copy nbytes between host (pinned) and device memory,
     * either way, enqueued on `stream`; and the host waits for `stream`
     * (before host code reads what a copy wrote). */
    fs_status (*copy)(void *dst, const void *src, size_t nbytes, void *stream, char *err,
                      size_t cap);
    fs_status (*synchronize)(void *stream, char *err, size_t cap);
    /* The backend's stream waits for the caller's work so far: work put on
     * comm_stream before a deferred collective (a prefetch's host-to-device
     * copy and cast) then runs beside the caller's compute. */
    fs_status (*follow_caller)(struct fs_comm *c, char *err, size_t cap);
    /* cast of `height` rows of `width` elements, row j from src + j *
     * src_pitch to dst + j * dst_pitch (pitches in elements): a parameter
     * sharded on a dim other than its first, copied in one call. */
    fs_status (*cast2d)(void *dst, int64_t dst_pitch, fs_dtype dst_t, const void *src,
                        int64_t src_pitch, fs_dtype src_t, int64_t width, int64_t height,
                        void *stream, char *err, size_t cap);
} fs_device_api;

#define FS_DEVICE_API_CAPSULE "flatshard.fs_device_api"

/* The host's table (device_host.c). */
extern const fs_device_api fs_host_device_api;
/* An fs_comm* exported by its owner (flatshard._C.Comm.capsule(),
 * flatshard._C_cuda.NcclComm.capsule()); valid while the owner lives. */
#define FS_COMM_CAPSULE "flatshard.fs_comm"

#endif
