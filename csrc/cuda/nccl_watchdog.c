/* nccl_watchdog.c - nccl_watchdog.h.
 *
 * Collectives of one communicator run in issue order on its stream, so the
 * oldest unfinished one is the one to time: the issuing thread records an
 * event after each and queues it here; the watchdog retires finished events
 * from the front and fires when the front one is older than the timeout.
 * A full queue drops new entries (the front one, still unfinished, is the
 * one that matters). The issuing thread never waits for the watchdog beyond
 * a short lock. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, pthread_condattr_setclock */

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl_watchdog.h"

#define WATCH_CAP 256

typedef struct {
    cudaEvent_t ev; /* created on first use of the slot, reused */
    double issued;  /* CLOCK_MONOTONIC seconds */
    uint64_t seq;   /* 1, 2, ... collectives watched on this communicator */
    char op[24];
    char what[48];
} watch_rec;

struct fs_watchdog {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop, fired;
    int device, rank;
    double timeout_s, period_s;
    void (*abort_fn)(void *ctx);
    void *ctx;
    watch_rec ring[WATCH_CAP];
    unsigned head, count;
    uint64_t seq;
    char verdict[480];
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Drop finished collectives from the front. Returns the front's state:
 * cudaSuccess (queue empty), cudaErrorNotReady, or a device error. */
static cudaError_t retire(fs_watchdog *w)
{
    while (w->count) {
        cudaError_t e = cudaEventQuery(w->ring[w->head].ev);
        if (e != cudaSuccess)
            return e;
        w->head = (w->head + 1) % WATCH_CAP;
        w->count--;
    }
    return cudaSuccess;
}

static void *watch_main(void *arg)
{
    fs_watchdog *w = arg;
    cudaSetDevice(w->device); /* errors show up as query failures below */
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        double t = until.tv_sec + until.tv_nsec * 1e-9 + w->period_s;
        until.tv_sec = (time_t)t;
        until.tv_nsec = (long)((t - (double)until.tv_sec) * 1e9);
        pthread_cond_timedwait(&w->cv, &w->mu, &until);
        if (w->stop)
            break;
        cudaError_t e = retire(w);
        if (e == cudaSuccess)
            continue;
        if (e == cudaErrorCudartUnloading || e == cudaErrorContextIsDestroyed)
            break; /* the process is exiting: nothing left to watch, nobody to tell */
        const watch_rec *r = &w->ring[w->head];
        const double age = now_s() - r->issued;
        if (e == cudaErrorNotReady && age <= w->timeout_s)
            continue;
        char why[160];
        if (e == cudaErrorNotReady)
            snprintf(why, sizeof why, "did not finish within %.0f s (a peer died, stopped, or "
                     "issued a different collective)", w->timeout_s);
        else
            snprintf(why, sizeof why, "failed on the device: %s (%s)", cudaGetErrorName(e),
                     cudaGetErrorString(e));
        snprintf(w->verdict, sizeof w->verdict, "rank %d: NCCL %s%s%s%s (collective %llu on this "
                 "communicator) %s; communicator aborted so that this rank does not hang",
                 w->rank, r->op, r->what[0] ? " for '" : "", r->what, r->what[0] ? "'" : "",
                 (unsigned long long)r->seq, why);
        w->fired = 1;
        pthread_mutex_unlock(&w->mu);
        w->abort_fn(w->ctx);
        fprintf(stderr, "flatshard watchdog: %s\n", w->verdict);
        fflush(stderr);
        return NULL;
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

fs_watchdog *fs_watchdog_start(int device, int rank, double timeout_s,
                               void (*abort_fn)(void *ctx), void *ctx, char *err, size_t cap)
{
    fs_watchdog *w = calloc(1, sizeof *w);
    if (!w) {
        snprintf(err, cap, "out of memory");
        return NULL;
    }
    w->device = device;
    w->rank = rank;
    w->timeout_s = timeout_s;
    /* a tenth of the timeout, between 10 ms and 1 s: fires within 10% late */
    w->period_s = timeout_s / 10 < 0.01 ? 0.01 : timeout_s / 10 > 1.0 ? 1.0 : timeout_s / 10;
    w->abort_fn = abort_fn;
    w->ctx = ctx;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc = pthread_create(&w->thread, NULL, watch_main, w);
    if (rc != 0) {
        snprintf(err, cap, "cannot start the NCCL watchdog thread: %s", strerror(rc));
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return NULL;
    }
    return w;
}

void fs_watchdog_track(fs_watchdog *w, cudaStream_t stream, const char *op, const char *what)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    if (!w->fired && !w->stop) {
        if (w->count == WATCH_CAP)
            retire(w);
        if (w->count < WATCH_CAP) {
            watch_rec *r = &w->ring[(w->head + w->count) % WATCH_CAP];
            if ((r->ev || cudaEventCreateWithFlags(&r->ev, cudaEventDisableTiming) ==
                              cudaSuccess) &&
                cudaEventRecord(r->ev, stream) == cudaSuccess) {
                r->issued = now_s();
                r->seq = ++w->seq;
                snprintf(r->op, sizeof r->op, "%s", op);
                snprintf(r->what, sizeof r->what, "%s", what ? what : "");
                w->count++;
            }
        }
    }
    pthread_mutex_unlock(&w->mu);
}

int fs_watchdog_fired(fs_watchdog *w, char *buf, size_t cap)
{
    if (!w)
        return 0;
    pthread_mutex_lock(&w->mu);
    int fired = w->fired;
    if (fired && buf)
        snprintf(buf, cap, "%s", w->verdict);
    pthread_mutex_unlock(&w->mu);
    return fired;
}

void fs_watchdog_stop(fs_watchdog *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    for (unsigned k = 0; k < WATCH_CAP; k++)
        if (w->ring[k].ev)
            cudaEventDestroy(w->ring[k].ev); /* at exit the runtime may be gone: ignored */
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}
