/* device_host.c - the host device table (fs_device.h): copy.h's loops,
 * streams ignored, collectives already complete when they return. A
 * Comm(kind='device') over a host backend with this table runs the units'
 * device path on any machine (the CUDA table is flatshard._C_cuda's);
 * flatshard._C exports it as host_device_api. */
#include <stdio.h>
#include <string.h>

#include "copy.h"
#include "fs_device.h"

static fs_status host_cast(void *dst, fs_dtype dt, const void *src, fs_dtype st, int64_t n,
                           void *stream, char *err, size_t cap)
{
    (void)stream;
    fs_status s = fs_cast(dst, dt, src, st, n);
    if (s != FS_OK)
        snprintf(err, cap, "host cast %s -> %s: %s", fs_dtype_name(st), fs_dtype_name(dt),
                 fs_status_str(s));
    return s;
}

static fs_status host_scale_accumulate(void *dst, fs_dtype dt, const void *src, fs_dtype st,
                                       int64_t n, double scale, int accumulate, void *stream,
                                       char *err, size_t cap)
{
    (void)stream;
    fs_status s = fs_scale_accumulate(dst, dt, src, st, n, scale, accumulate);
    if (s != FS_OK)
        snprintf(err, cap, "host scale_accumulate %s -> %s: %s", fs_dtype_name(st),
                 fs_dtype_name(dt), fs_status_str(s));
    return s;
}

static void host_set_caller_stream(struct fs_comm *c, void *stream) { (void)c, (void)stream; }
static void host_set_workspace(struct fs_comm *c, void *p, size_t n) { (void)c, (void)p, (void)n; }
static void host_set_defer(struct fs_comm *c, int defer) { (void)c, (void)defer; }

/* Host collectives are complete when they return: a mark is always reached. */
static char host_mark;
static fs_status host_record(struct fs_comm *c, void **event, char *err, size_t cap)
{
    (void)c, (void)err, (void)cap;
    *event = &host_mark;
    return FS_OK;
}

static fs_status host_wait(void *event, void *stream, char *err, size_t cap)
{
    if (event != &host_mark) {
        snprintf(err, cap, "host wait: not a host mark");
        return FS_ERR_INVALID_ARG;
    }
    (void)stream;
    return FS_OK;
}

static void host_event_free(void *event) { (void)event; }
static void *host_comm_stream(struct fs_comm *c) { (void)c; return NULL; }

static fs_status host_copy(void *dst, const void *src, size_t nbytes, void *stream, char *err,
                           size_t cap)
{
    (void)stream, (void)err, (void)cap;
    if (nbytes)
        memcpy(dst, src, nbytes);
    return FS_OK;
}

static fs_status host_synchronize(void *stream, char *err, size_t cap)
{
    (void)stream, (void)err, (void)cap;
    return FS_OK;
}

static fs_status host_follow_caller(struct fs_comm *c, char *err, size_t cap)
{
    (void)c, (void)err, (void)cap;
    return FS_OK;
}

static fs_status host_cast2d(void *dst, int64_t dst_pitch, fs_dtype dt, const void *src,
                             int64_t src_pitch, fs_dtype st, int64_t width, int64_t height,
                             void *stream, char *err, size_t cap)
{
    const size_t ds = fs_dtype_size(dt), ss = fs_dtype_size(st);
    for (int64_t j = 0; j < height; j++) {
        fs_status s = host_cast((char *)dst + (size_t)(j * dst_pitch) * ds, dt,
                                (const char *)src + (size_t)(j * src_pitch) * ss, st, width,
                                stream, err, cap);
        if (s != FS_OK)
            return s;
    }
    return FS_OK;
}

const fs_device_api fs_host_device_api = {
    FS_DEVICE_API_VERSION, "host", host_cast, host_scale_accumulate, host_set_caller_stream,
    host_set_workspace, host_set_defer, host_record, host_wait, host_event_free,
    host_comm_stream, host_copy, host_synchronize, host_follow_caller, host_cast2d,
};
