/* emu_rt.cc - the CUDA runtime of fs_emu_rt.h over host memory: one device,
 * streams as queues of work, events as positions in a queue, and the
 * faults the tests inject. Every call holds one lock. Queued work runs only
 * on the thread that loaded this library (the rank's main thread, which
 * issues everything): another thread (the NCCL watchdog) querying an event
 * sees how far that thread has got, as a host thread watching a GPU would. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <pthread.h>

#include <deque>
#include <map>
#include <mutex>
#include <string>

#include "fs_emu.h"

struct fs_emu_stream {
    std::deque<std::function<void()>> work;
    unsigned long long issued = 0, done = 0;
    int running = 0;
};

struct fs_emu_event {
    cudaStream_t stream = nullptr;
    unsigned long long pos = 0;
};

namespace {

std::recursive_mutex mu;
const pthread_t main_thread = pthread_self();
#define LOCK std::lock_guard<std::recursive_mutex> lock_(mu)

bool on_main_thread() { return pthread_equal(pthread_self(), main_thread); }

std::map<std::string, int> faults;
std::deque<cudaStream_t> streams;

/* Runs s's work up to position pos (work queued by that work included). */
void run_until(cudaStream_t s, unsigned long long pos)
{
    if (!s || s->running || !on_main_thread())
        return;
    s->running = 1;
    while (s->done < pos && !s->work.empty()) {
        std::function<void()> w = std::move(s->work.front());
        s->work.pop_front();
        w();
        s->done++;
    }
    s->running = 0;
}

bool stalled() { return fs_emu_fault_value("event_never_ready") != 0; }

} // namespace

void fs_emu_enqueue(cudaStream_t s, std::function<void()> work)
{
    LOCK;
    if (!s) {
        work();
        return;
    }
    s->work.push_back(std::move(work));
    s->issued++;
}

extern "C" {

void fs_emu_fault(const char *what, int value)
{
    LOCK;
    faults[what] = value;
}

int fs_emu_fault_value(const char *what)
{
    LOCK;
    auto it = faults.find(what);
    return it == faults.end() ? 0 : it->second;
}

int fs_emu_take_fault(const char *what)
{
    LOCK;
    int v = fs_emu_fault_value(what);
    faults.erase(what);
    return v;
}

long fs_emu_pending(void)
{
    LOCK;
    long n = 0;
    for (cudaStream_t s : streams)
        n += (long)s->work.size();
    return n;
}

cudaError_t cudaGetDevice(int *dev)
{
    LOCK;
    *dev = 0;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int dev) { return dev == 0 ? cudaSuccess : cudaErrorInvalidDevice; }

cudaError_t cudaGetDeviceCount(int *n)
{
    LOCK;
    *n = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev)
{
    LOCK;
    if (attr != cudaDevAttrMultiProcessorCount || dev != 0)
        return cudaErrorInvalidValue;
    *value = FS_EMU_SMS;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *v)
{
    LOCK;
    *v = 12080;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *v)
{
    LOCK;
    *v = 12080;
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void)
{
    LOCK;
    return fs_emu_take_fault("launch_error") ? cudaErrorLaunchFailure : cudaSuccess;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorCudartUnloading: return "cudaErrorCudartUnloading";
    case cudaErrorContextIsDestroyed: return "cudaErrorContextIsDestroyed";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorCudartUnloading: return "driver shutting down";
    case cudaErrorContextIsDestroyed: return "context is destroyed";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    }
    return "unknown error";
}

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    LOCK;
    *p = nullptr;
    if (posix_memalign(p, 256, bytes ? bytes : 1) != 0)
        return cudaErrorMemoryAllocation;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    LOCK;
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s)
{
    LOCK;
    (void)kind;
    if (bytes && (!dst || !src))
        return cudaErrorInvalidValue;
    fs_emu_enqueue(s, [=] { memmove(dst, src, bytes); });
    return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t s)
{
    LOCK;
    (void)kind;
    if (width && height && (!dst || !src || dpitch < width || spitch < width))
        return cudaErrorInvalidValue;
    fs_emu_enqueue(s, [=] {
        for (size_t j = 0; j < height; j++)
            memmove((char *)dst + j * dpitch, (const char *)src + j * spitch, width);
    });
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s)
{
    LOCK;
    if (bytes && !dst)
        return cudaErrorInvalidValue;
    fs_emu_enqueue(s, [=] { memset(dst, value, bytes); });
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    LOCK;
    (void)flags;
    *s = new fs_emu_stream;
    streams.push_back(*s);
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    LOCK;
    if (!s)
        return cudaErrorInvalidResourceHandle;
    if (!stalled())
        run_until(s, s->issued); /* CUDA finishes a destroyed stream's work */
    for (auto it = streams.begin(); it != streams.end(); ++it)
        if (*it == s) {
            streams.erase(it);
            break;
        }
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    LOCK;
    if (s && stalled()) {
        fprintf(stderr, "fs_emu: cudaStreamSynchronize on a stalled stream would never return\n");
        abort();
    }
    if (s)
        run_until(s, s->issued);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    LOCK;
    (void)flags;
    if (!e)
        return cudaErrorInvalidResourceHandle;
    cudaStream_t from = e->stream;
    const unsigned long long pos = e->pos; /* the event's state now, as CUDA takes it */
    if (!from)
        return cudaSuccess;
    if (!s) { /* the caller's stream: what follows on it runs at once, so catch up now */
        if (!stalled())
            run_until(from, pos);
        return cudaSuccess;
    }
    fs_emu_enqueue(s, [=] { run_until(from, pos); });
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    LOCK;
    (void)flags;
    *e = new fs_emu_event;
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    LOCK;
    delete e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    LOCK;
    if (!e)
        return cudaErrorInvalidResourceHandle;
    e->stream = s;
    e->pos = s ? s->issued : 0;
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e)
{
    LOCK;
    if (!e)
        return cudaErrorInvalidResourceHandle;
    if (!e->stream)
        return cudaSuccess;
    if (int code = fs_emu_fault_value("event_error"))
        return (cudaError_t)code;
    if (stalled())
        return e->stream->done >= e->pos ? cudaSuccess : cudaErrorNotReady;
    run_until(e->stream, e->pos); /* a device makes progress on its own */
    return cudaSuccess;
}

} // extern "C"
