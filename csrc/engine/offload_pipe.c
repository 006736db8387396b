/* offload_pipe.c - see offload_pipe.h: the queue, its worker thread, the
 * bound on units in flight, and the engine groups' wait before a gather. */
#define _POSIX_C_SOURCE 200112L /* clock_gettime */
#include "offload_pipe.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* One slot's submitted steps, queued until the worker has run them. */
typedef struct step_batch {
    int slot;
    int n;
    fs_simd simd;
    int threads;
    int64_t grad_bytes;
    struct step_batch *next;
    fs_optim_job jobs[]; /* (n) */
} step_batch;

struct fs_offload_pipe {
    pthread_mutex_t mu;
    pthread_cond_t work;  /* the worker: a batch queued, or stop */
    pthread_cond_t done;  /* the host: a batch finished */
    pthread_t thread;
    int stop;
    int max_units, nslots;
    step_batch *head, *tail; /* queued, not yet taken by the worker */
    int *pending;            /* (nslots) batches submitted and not finished */
    fs_status failed;        /* the first failed step's status, FS_OK while none */
    char err[256];
    fs_offload_pipe_stats st;
    fs_step_gate gate;       /* what the attached groups wait at */
};

static fs_status gate_wait(void *ctx, int slot, void *(*unlock)(void), void (*lock)(void *));
static const char *gate_error(void *ctx);

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *worker(void *arg)
{
    fs_offload_pipe *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stop)
            pthread_cond_wait(&p->work, &p->mu);
        if (!p->head)
            break; /* stop, and nothing left */
        step_batch *b = p->head;
        p->head = b->next;
        if (!p->head)
            p->tail = NULL;
        const int skip = p->failed != FS_OK; /* after a failure nothing more is written */
        pthread_mutex_unlock(&p->mu);
        fs_status s = FS_OK;
        int failed_job = -1;
        const double t0 = now_s();
        for (int i = 0; i < b->n && s == FS_OK && !skip; i++)
            if ((s = fs_optim_step(&b->jobs[i], b->simd, b->threads)) != FS_OK)
                failed_job = i;
        const double t1 = now_s();
        pthread_mutex_lock(&p->mu);
        p->st.step_s += t1 - t0;
        if (!skip)
            p->st.steps_run += b->n;
        if (s != FS_OK && p->failed == FS_OK) {
            p->failed = s;
            snprintf(p->err, sizeof p->err, "the offloaded step of slot %d (parameter %d of "
                     "the batch) failed: %s", b->slot, failed_job, fs_status_str(s));
        }
        p->st.grad_bytes_in_flight -= b->grad_bytes;
        if (--p->pending[b->slot] == 0)
            p->st.units_in_flight--;
        free(b);
        pthread_cond_broadcast(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

fs_status fs_offload_pipe_new(int max_units, int nslots, fs_offload_pipe **out)
{
    *out = NULL;
    if (max_units < 1 || nslots < 1)
        return FS_ERR_INVALID_ARG;
    fs_offload_pipe *p = calloc(1, sizeof *p);
    if (!p)
        return FS_ERR_NO_MEMORY;
    p->pending = calloc((size_t)nslots, sizeof *p->pending);
    if (!p->pending) {
        free(p);
        return FS_ERR_NO_MEMORY;
    }
    p->max_units = p->st.max_units = max_units;
    p->nslots = nslots;
    p->gate = (fs_step_gate){p, gate_wait, gate_error};
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    if (pthread_create(&p->thread, NULL, worker, p) != 0) {
        pthread_cond_destroy(&p->done);
        pthread_cond_destroy(&p->work);
        pthread_mutex_destroy(&p->mu);
        free(p->pending);
        free(p);
        return FS_ERR_BACKEND;
    }
    *out = p;
    return FS_OK;
}

void fs_offload_pipe_free(fs_offload_pipe *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1; /* the worker runs what is queued, then ends */
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->work);
    pthread_mutex_destroy(&p->mu);
    free(p->pending);
    free(p);
}

/* Called with p->mu held: until blocked(p, arg) is false, waiting on
 * p->done with the caller's lock handed back. The predicate is checked
 * under the mutex before every wait, so no finish is missed; the mutex is
 * let go around handing the caller's lock back and taking it again, so that
 * lock is never awaited under it. Returns with p->mu held. */
static void block_while(fs_offload_pipe *p, int (*blocked)(const fs_offload_pipe *, int), int arg,
                        void *(*unlock)(void), void (*lock)(void *))
{
    if (!blocked(p, arg))
        return;
    void *tok = NULL;
    if (unlock) {
        pthread_mutex_unlock(&p->mu);
        tok = unlock();
        pthread_mutex_lock(&p->mu);
    }
    while (blocked(p, arg))
        pthread_cond_wait(&p->done, &p->mu);
    if (unlock) { /* only the worker runs meanwhile, and it only lowers the counts */
        pthread_mutex_unlock(&p->mu);
        lock(tok);
        pthread_mutex_lock(&p->mu);
    }
}

static int bound_reached(const fs_offload_pipe *p, int slot)
{
    (void)slot;
    return p->failed == FS_OK && p->st.units_in_flight >= p->max_units;
}

static int busy_locked(const fs_offload_pipe *p, int slot)
{
    return slot < 0 ? p->st.units_in_flight > 0 : p->pending[slot] > 0;
}

fs_status fs_offload_pipe_submit(fs_offload_pipe *p, int slot, const fs_optim_job *jobs,
                                 float *const *steps, int n, fs_simd simd, int threads,
                                 int bounded, void *(*unlock)(void), void (*lock)(void *))
{
    if (slot < 0 || slot >= p->nslots || n < 0 || threads < 1)
        return FS_ERR_INVALID_ARG;
    for (int i = 0; i < n; i++)
        if (fs_optim_check(&jobs[i]) != FS_OK)
            return FS_ERR_INVALID_ARG;
    if (n == 0)
        return FS_OK;
    step_batch *b = malloc(sizeof *b + (size_t)n * sizeof b->jobs[0]);
    if (!b)
        return FS_ERR_NO_MEMORY;
    b->slot = slot;
    b->n = n;
    b->simd = simd;
    b->threads = threads;
    b->next = NULL;
    b->grad_bytes = 0;
    for (int i = 0; i < n; i++) {
        b->jobs[i] = jobs[i];
        const fs_optim_job *j = &jobs[i];
        b->grad_bytes += 4 * (j->kind == FS_OPTIM_ADAM ? j->adam.n : j->sgd.n);
    }
    pthread_mutex_lock(&p->mu);
    fs_status s = p->failed;
    if (s == FS_OK && bounded && p->pending[slot] == 0 && p->st.units_in_flight >= p->max_units) {
        const double t0 = now_s();
        p->st.submits_blocked++;
        block_while(p, bound_reached, slot, unlock, lock);
        p->st.wait_s += now_s() - t0;
        s = p->failed;
    }
    if (s != FS_OK) {
        pthread_mutex_unlock(&p->mu);
        free(b);
        return s;
    }
    /* the counts as the steps will use them, set before the worker can run */
    fs_optim_take_step_counts(b->jobs, steps, n);
    if (p->pending[slot]++ == 0)
        p->st.units_in_flight++;
    if (p->st.units_in_flight > p->st.peak_units_in_flight)
        p->st.peak_units_in_flight = p->st.units_in_flight;
    p->st.grad_bytes_in_flight += b->grad_bytes;
    if (p->st.grad_bytes_in_flight > p->st.peak_grad_bytes_in_flight)
        p->st.peak_grad_bytes_in_flight = p->st.grad_bytes_in_flight;
    if (p->tail)
        p->tail->next = b;
    else
        p->head = b;
    p->tail = b;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
    return FS_OK;
}

fs_status fs_offload_pipe_wait(fs_offload_pipe *p, int slot, void *(*unlock)(void),
                               void (*lock)(void *))
{
    if (slot < -1 || slot >= p->nslots)
        return FS_ERR_INVALID_ARG;
    pthread_mutex_lock(&p->mu);
    if (busy_locked(p, slot)) {
        const double t0 = now_s();
        p->st.gathers_waited++;
        block_while(p, busy_locked, slot, unlock, lock);
        p->st.wait_s += now_s() - t0;
    }
    fs_status s = p->failed;
    pthread_mutex_unlock(&p->mu);
    return s;
}

int fs_offload_pipe_busy(fs_offload_pipe *p, int slot)
{
    if (slot < -1 || slot >= p->nslots)
        return 0;
    pthread_mutex_lock(&p->mu);
    int b = busy_locked(p, slot);
    pthread_mutex_unlock(&p->mu);
    return b;
}

void fs_offload_pipe_get_stats(fs_offload_pipe *p, fs_offload_pipe_stats *out)
{
    pthread_mutex_lock(&p->mu);
    *out = p->st;
    pthread_mutex_unlock(&p->mu);
}

const char *fs_offload_pipe_error(const fs_offload_pipe *p)
{
    return p->err;
}

/* ---------------------------------------------------------------------------
 * the engine's side: the gate its groups wait at (group.h) */

static fs_status gate_wait(void *ctx, int slot, void *(*unlock)(void), void (*lock)(void *))
{
    return fs_offload_pipe_wait(ctx, slot, unlock, lock);
}

static const char *gate_error(void *ctx)
{
    return fs_offload_pipe_error(ctx);
}

const fs_step_gate *fs_offload_pipe_gate(fs_offload_pipe *p)
{
    return &p->gate;
}
