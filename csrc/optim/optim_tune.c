/* optim_tune.c - which variant of the fused optimizer loop (optim_cpu.c)
 * runs: chosen by timing the candidates on this machine, once per process
 * and size class, and the tuned entry points the optimizers call.
 *
 * Deliberately not a model of any CPU: nothing here says which variant wins
 * where, only how to measure. What the measurement chose, and the timings
 * it chose from, are kept for diagnostics (`python -m flatshard doctor`).
 */
#define _POSIX_C_SOURCE 200112L /* clock_gettime */
#include "optim.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* [Note: tuning]
 * A size class is (kind, floor(log2 n), copy dtype, amsgrad, thread and SIMD
 * caps). Its first step is its calibration: the step's elements are cut into
 * equal slices and each candidate variant updates some of them, timed.
 * Every variant gives the same bits ([Note: same bits] in optim_cpu.c) and
 * each element is updated exactly once, so the calibrating step's result is
 * the untuned one: tuning costs no extra pass over memory, and candidates
 * are timed on the real buffers, cold from the backward pass as in every
 * later step.
 *
 * Candidates are searched in stages, each keeping the winners so far:
 *   0  vector width x unrolling           (threads at the cap, no prefetch)
 *   1  software prefetch distance (0: leave it to the hardware prefetchers)
 *   2  copy stores: non-temporal or regular (only with a low-precision copy)
 *   3  thread count x split (contiguous slices, or chunks claimed in turn) x
 *      threads started for the step or the process's OpenMP team
 * Each candidate runs TUNE_ROUNDS times or more (as many as slices of
 * TUNE_SLICE_TARGET elements allow, up to TUNE_ROUNDS_MAX), interleaved with
 * its rivals in an order that turns by one each round (stage 3's trials
 * too); its score is its fastest round per element, so a round slowed
 * by another process on the machine does not decide. A round's time is CPU
 * time, not wall-clock: the most that any of its threads spent on its slice
 * (fs_optim_run_busy). Stages 0-2 choose how a thread runs the loop, and on
 * a machine with more runnable threads than cores the wall-clock time of a
 * slice is mostly how long its threads waited for a core (measured: on 2
 * busy vCPUs, slices of the same candidate varied 10x in wall-clock time
 * and 10% in CPU time). CPU time has a bias of its own, which every
 * candidate meets alike: a thread running while its partner waits for a
 * core has the memory to itself, and goes faster. A stage's first
 * candidate is the incumbent, the earlier stages' choice, and keeps its
 * rounds from those stages; it stays unless another is faster by
 * TUNE_MARGIN: a difference within the noise is no reason to change.
 *
 * [Note: unroll]
 * Stage 0's incumbent is the widest SIMD unrolled 4 times (as DeepSpeed's
 * loop, 8 times), not once: more independent vectors in flight per thread.
 * Measured on a 2-vCPU EPYC Zen 4, 2^24 elements, 2 threads on the OpenMP
 * team: unrolled 4 times, 2-10% faster than once in wall-clock time, and
 * never slower, from run to run; in the calibration's CPU times the
 * difference was within the margin, so a once-unrolled incumbent stayed.
 *
 * [Note: copy stores]
 * Stage 2's incumbent is the non-temporal store, not the regular one: the
 * step writes the copy and never reads it, and a regular store first reads
 * each line of the copy into the cache (2 more bytes per element on 28 or
 * 30), which streaming stores skip. Regular stores stay where they measure
 * faster by the margin (a copy small enough to stay in cache for its reader,
 * a CPU whose streaming stores are slow). Measured on a 2-vCPU EPYC Zen 4,
 * 2^24 elements: a bf16 copy cost 8% more CPU time per element with regular
 * stores than without a copy, and none with streaming ones; a 5% margin
 * against the regular stores as incumbent kept them in 5 calibrations of 6.
 *
 * A step too small to cut into slices of TUNE_SLICE_MIN elements is timed
 * on a scratch copy of its buffers instead, each candidate updating the
 * whole copy (repeated up to TUNE_SAMPLE elements or TUNE_SAMPLE_S seconds),
 * then the step runs with the winner.
 *
 * Stage 3 is timed on neither: each thread-split candidate pays a fixed
 * cost per call (starting its threads, or waking an OpenMP team, and on a
 * busy machine waiting for a core), which a slice would weigh many times
 * more than a whole step does, and whether torch's OpenMP threads are still
 * spinning from the work before shows only in real steps. So the class's
 * next steps each run whole with one stage-3 candidate in turn,
 * TUNE_STEP_ROUNDS rounds, and the winner is kept from then on; until then
 * those steps are the trials. A trial's score is its median round, not its
 * fastest, and wall-clock, not CPU time: a whole step is the real cost,
 * waiting for cores included, and a split that is fast only in the moments
 * when nothing else runs should not win. The incumbent there is all threads in
 * contiguous slices on the OpenMP team, as torch runs its own parallel
 * work (started threads where the process has no OpenMP runtime).
 *
 * [Note: whole-step incumbent]
 * Stage 3's first candidate is not the calibration's choice but the class's
 * default loop (widest SIMD unrolled 4 times, no prefetch, streaming copy
 * stores) with that incumbent split; the calibration's choice is one of the
 * rivals, with each split. So a loop chosen on CPU-time slices replaces the
 * default only when whole steps, waiting included, say it is faster by the
 * margin. Measured on a 2-vCPU EPYC Zen 4, 2^26 elements, interleaved with
 * torch's and DeepSpeed's steps: slices chose a 1 KiB prefetch (0.37 against
 * 0.46 ns/element), which ran whole steps 9% slower than the default, and the
 * bf16-copy class chose started threads after 5 rounds, 34% slower than the
 * OpenMP team in the median of 25 steps at 2^24 (its fastest steps equal).
 * Hence also TUNE_STEP_ROUNDS 7, not 5. */

#define TUNE_ROUNDS 3
#define TUNE_ROUNDS_MAX 8
#define TUNE_SLICE_TARGET (1 << 18)
#define TUNE_MARGIN 0.05
#define TUNE_STEP_ROUNDS 7
#define TUNE_SLICE_MIN (1 << 16)
#define TUNE_SAMPLE (1 << 18)
#define TUNE_SAMPLE_S 2e-4
#define TUNE_CLASSES 128
#define TUNE_CHUNK_LARGE (1 << 16)
#define TUNE_CHUNK_SMALL 2048

static const int prefetch_candidates[] = {0, 1024, 4096, 16384};

typedef struct {
    int state; /* 0 unused, 1 being calibrated, 2 chosen, 3 whole-step trials of stage 3 */
    fs_tune_record rec;
    int trial_first, trial_count; /* rec.candidates[trial_first ..] are stage 3's */
    int trials_started, trials_done;
    double trial_ns[FS_TUNE_MAX_CANDIDATES][TUNE_STEP_ROUNDS]; /* per element, per round */
} tune_entry;

static pthread_mutex_t tune_lock = PTHREAD_MUTEX_INITIALIZER;
static tune_entry tune_table[TUNE_CLASSES];

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int64_t job_numel(const fs_optim_job *j)
{
    return j->kind == FS_OPTIM_ADAM ? j->adam.n : j->sgd.n;
}

static int size_log2(int64_t n)
{
    int k = 0;
    while (k < 62 && ((int64_t)1 << (k + 1)) <= n)
        k++;
    return k;
}

static fs_tune_record class_of(const fs_optim_job *j, fs_simd simd, int threads)
{
    fs_tune_record r;
    memset(&r, 0, sizeof r);
    r.kind = j->kind;
    r.size_log2 = size_log2(job_numel(j));
    const void *copy = j->kind == FS_OPTIM_ADAM ? j->adam.copy : j->sgd.copy;
    r.copy_dtype = copy ? (int)(j->kind == FS_OPTIM_ADAM ? j->adam.copy_dtype : j->sgd.copy_dtype)
                        : -1;
    r.amsgrad = j->kind == FS_OPTIM_ADAM && j->adam.max_exp_avg_sq != NULL;
    r.threads_max = threads;
    r.simd_max = simd;
    return r;
}

static int same_class(const fs_tune_record *a, const fs_tune_record *b)
{
    return a->kind == b->kind && a->size_log2 == b->size_log2 && a->copy_dtype == b->copy_dtype &&
           a->amsgrad == b->amsgrad && a->threads_max == b->threads_max &&
           a->simd_max == b->simd_max;
}

/* The candidates of `stage`, each `best` with that stage's fields changed,
 * at most `cap` (stage 3's ladder stops early on a machine with very many
 * threads). `unit` is how many elements one timed run updates (sizes the
 * chunks). */
static int stage_candidates(int stage, const fs_tune_record *r, const fs_optim_variant *best,
                            int64_t unit, fs_optim_variant *out, int cap)
{
    int n = 0;
    fs_optim_variant v = *best;
    switch (stage) {
    case 0:
        if (r->simd_max < FS_SIMD_AVX2) {
            v.simd = FS_SIMD_SCALAR, v.unroll = 1, out[n++] = v;
            break;
        }
        /* The incumbent first: the widest SIMD unrolled 4 times ([Note: unroll]). */
        for (int s = (int)r->simd_max; s >= (int)FS_SIMD_AVX2; s--)
            for (int u = 4; u >= 1; u /= 2) {
                /* the bf16 instruction goes with AVX-512 (class_default) */
                v.simd = (fs_simd)s, v.unroll = u;
                v.bf16_insn = best->bf16_insn && s >= (int)FS_SIMD_AVX512;
                out[n++] = v;
            }
        break;
    case 1:
        if (r->simd_max < FS_SIMD_AVX2)
            break;
        for (size_t k = 0; k < sizeof prefetch_candidates / sizeof *prefetch_candidates; k++)
            v.prefetch_bytes = prefetch_candidates[k], out[n++] = v;
        break;
    case 2:
        /* Streaming stores first: the incumbent ([Note: copy stores]). */
        if (r->copy_dtype < 0 || r->simd_max < FS_SIMD_AVX2)
            break;
        for (int s = 1; s >= 0; s--)
            v.stream_copy = s, out[n++] = v;
        break;
    case 3:
        /* All threads first, then half as many, down to one: each count
         * adds at most 5 candidates, and a cap cuts the fewest threads. */
        for (int t = r->threads_max; t >= 1 && n + 5 <= cap; t = t > 1 ? t / 2 : 0) {
            v.threads = t, v.omp = 0, v.chunk_numel = 0, out[n++] = v;
            /* Chunks: large ones (each thread claims about eight), and small
             * ones that keep the threads' streams a few pages apart. */
            int64_t chunk = unit / (8 * (int64_t)t) / 16 * 16;
            if (chunk > TUNE_CHUNK_LARGE)
                chunk = TUNE_CHUNK_LARGE;
            if (t > 1 && chunk >= 1024)
                v.chunk_numel = chunk, out[n++] = v;
            if (t > 1 && chunk > TUNE_CHUNK_SMALL)
                v.chunk_numel = TUNE_CHUNK_SMALL, out[n++] = v;
            /* The process's OpenMP team ([Note: OpenMP team] in optim_cpu.c). */
            if (t > 1 && fs_optim_have_omp()) {
                v.omp = 1, v.chunk_numel = 0, out[n++] = v;
                if (chunk >= 1024)
                    v.chunk_numel = chunk, out[n++] = v;
            }
        }
        /* First the incumbent: all threads in contiguous slices, as torch
         * runs its own parallel work (on its OpenMP team where there is one). */
        for (int c = 1; c < n; c++) {
            if (out[c].threads == r->threads_max && !out[c].chunk_numel &&
                out[c].omp == (r->threads_max > 1 && fs_optim_have_omp())) {
                fs_optim_variant first = out[0];
                out[0] = out[c];
                out[c] = first;
            }
        }
        break;
    }
    return n;
}

static int count_candidates(const fs_tune_record *r, int64_t unit, int stages)
{
    fs_optim_variant tmp[FS_TUNE_MAX_CANDIDATES], v = fs_optim_default_variant(r->simd_max, 1);
    int total = 0;
    for (int stage = 0; stage < stages; stage++)
        total += stage_candidates(stage, r, &v, unit, tmp, FS_TUNE_MAX_CANDIDATES);
    return total;
}

/* ---------------------------------------------------------------------------
 * scratch copies of a step's buffers */

typedef struct {
    void *mem[6];
    int count;
} scratch;

static void *scratch_dup(scratch *s, const void *src, int64_t bytes)
{
    /* 64-byte aligned like torch's allocations, so alignment is as in the step. */
    size_t size = ((size_t)bytes + 63) / 64 * 64;
    void *p = aligned_alloc(64, size ? size : 64);
    if (!p)
        return NULL;
    s->mem[s->count++] = p;
    if (src)
        memcpy(p, src, (size_t)bytes);
    else
        memset(p, 0, size ? size : 64);
    return p;
}

static void scratch_free(scratch *s)
{
    while (s->count > 0)
        free(s->mem[--s->count]);
}

/* A copy of `j` on scratch buffers (same values, same n), or FS_ERR_NO_MEMORY. */
static fs_status scratch_job(const fs_optim_job *j, scratch *s, fs_optim_job *out)
{
    *out = *j;
    const int64_t n = job_numel(j), fb = 4 * n, hb = 2 * n;
    int ok = 1;
    if (j->kind == FS_OPTIM_ADAM) {
        fs_adam_buffers *b = &out->adam;
        ok = (b->param = scratch_dup(s, j->adam.param, fb)) &&
             (b->grad = scratch_dup(s, j->adam.grad, fb)) &&
             (b->exp_avg = scratch_dup(s, j->adam.exp_avg, fb)) &&
             (b->exp_avg_sq = scratch_dup(s, j->adam.exp_avg_sq, fb)) &&
             (!j->adam.max_exp_avg_sq ||
              (b->max_exp_avg_sq = scratch_dup(s, j->adam.max_exp_avg_sq, fb))) &&
             (!j->adam.copy || (b->copy = scratch_dup(s, NULL, hb)));
    } else {
        fs_sgd_buffers *b = &out->sgd;
        ok = (b->param = scratch_dup(s, j->sgd.param, fb)) &&
             (b->grad = scratch_dup(s, j->sgd.grad, fb)) &&
             (!j->sgd.momentum_buf ||
              (b->momentum_buf = scratch_dup(s, j->sgd.momentum_buf, fb))) &&
             (!j->sgd.copy || (b->copy = scratch_dup(s, NULL, hb)));
    }
    if (!ok) {
        scratch_free(s);
        return FS_ERR_NO_MEMORY;
    }
    return FS_OK;
}

/* ---------------------------------------------------------------------------
 * calibration */

static int same_variant(const fs_optim_variant *a, const fs_optim_variant *b)
{
    return a->simd == b->simd && a->unroll == b->unroll &&
           a->prefetch_bytes == b->prefetch_bytes && a->stream_copy == b->stream_copy &&
           a->threads == b->threads && a->omp == b->omp && a->chunk_numel == b->chunk_numel &&
           a->bf16_insn == b->bf16_insn;
}

/* The variant a class starts from: the widest SIMD the caps allow,
 * unrolled 4 times (with the bf16 instruction for a bf16 copy where the CPU
 * has it: [Note: bf16 instruction] in optim_cpu.c; the same bits with fewer
 * instructions, so it is not a candidate to time against the integer
 * rounding), no prefetch, regular stores, all threads in contiguous slices. */
static fs_optim_variant class_default(const fs_tune_record *r)
{
    fs_optim_variant v = fs_optim_default_variant(r->simd_max, r->threads_max);
    v.bf16_insn = r->copy_dtype == (int)FS_BF16 && v.simd >= FS_SIMD_AVX512 &&
                  fs_optim_have_bf16_insn();
    return v;
}

/* The fastest of `nc` times, but the first unless beaten by TUNE_MARGIN. */
static int pick(const double *t, int nc)
{
    if (nc < 2)
        return 0;
    int win = 0;
    for (int c = 1; c < nc; c++)
        if (t[c] < t[win])
            win = c;
    return t[win] < t[0] * (1.0 - TUNE_MARGIN) ? win : 0;
}

/* The median of `n` times (sorts them). */
static double median(double *t, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

/* Adds `c`'s candidates of one stage with their best times to `r`'s record. */
static void record_stage(fs_tune_record *r, int stage, const fs_optim_variant *cand, int nc,
                         const double *ns_per_elem)
{
    for (int c = 0; c < nc && r->ncandidates < FS_TUNE_MAX_CANDIDATES; c++) {
        int k = r->ncandidates++;
        r->candidates[k].stage = stage;
        r->candidates[k].variant = cand[c];
        r->candidates[k].ns_per_elem = ns_per_elem[c];
    }
}

/* Runs the step `j` while choosing stages 0-2 of its class's variant into
 * `r`, on slices of the step (r->in_place) or on scratch; stage 3 is left to
 * the class's next whole steps. */
static fs_status calibrate(const fs_optim_job *j, fs_tune_record *r)
{
    const int64_t n = job_numel(j);
    fs_optim_variant best = class_default(r);
    r->tuned_numel = n;
    r->chosen = best;
    const int64_t ncand = count_candidates(r, n, 3);
    int64_t rounds = n / (ncand * TUNE_SLICE_TARGET);
    rounds = rounds < TUNE_ROUNDS ? TUNE_ROUNDS
             : rounds > TUNE_ROUNDS_MAX ? TUNE_ROUNDS_MAX : rounds;
    const int64_t slice = n / (ncand * rounds) / 64 * 64;
    r->in_place = slice >= TUNE_SLICE_MIN;
    if (!r->in_place)
        rounds = TUNE_ROUNDS;

    scratch s = {{0}, 0};
    fs_optim_job sj;
    const fs_optim_job *timed = j;
    int64_t unit = slice, reps = 1;
    if (!r->in_place) {
        if (scratch_job(j, &s, &sj) != FS_OK)
            return fs_optim_run(j, 0, n, &best); /* r->tuned stays 0: the default runs */
        timed = &sj;
        unit = n;
        reps = n >= TUNE_SAMPLE ? 1 : TUNE_SAMPLE / (n > 0 ? n : 1);
    }

    fs_status st = FS_OK;
    double best_t = 1e30; /* seconds per timed run of `best` */
    int64_t pos = 0;      /* in place: the elements below pos are updated */
    for (int stage = 0; stage < 3 && st == FS_OK; stage++) {
        fs_optim_variant cand[FS_TUNE_MAX_CANDIDATES];
        const int nc = stage_candidates(stage, r, &best, unit, cand, FS_TUNE_MAX_CANDIDATES);
        if (nc == 0)
            continue;
        double t_best[FS_TUNE_MAX_CANDIDATES];
        for (int c = 0; c < nc; c++)
            t_best[c] = 1e30;
        for (int round = 0; round < rounds && st == FS_OK; round++) {
            /* Each round in another order: no candidate is always the one
             * right after the step began, or after a given rival. */
            for (int o = 0; o < nc && st == FS_OK; o++) {
                const int c = (o + round) % nc;
                double busy = 0.0, dt = 0.0; /* CPU seconds, as fs_optim_run_busy's */
                int64_t k = 0;
                if (r->in_place) {
                    st = fs_optim_run_busy(timed, pos, pos + unit, &cand[c], &busy);
                    pos += unit;
                    k = 1;
                    dt = busy;
                } else {
                    /* Repeat a small step to a measurable time, but bounded:
                     * thread start-up can make each repetition slow. */
                    const double t0 = now_s();
                    while (k < reps && st == FS_OK && now_s() - t0 < TUNE_SAMPLE_S) {
                        st = fs_optim_run_busy(timed, 0, n, &cand[c], &busy);
                        k++;
                        dt += busy;
                    }
                }
                if (dt / (double)k < t_best[c])
                    t_best[c] = dt / (double)k;
            }
        }
        /* The incumbent (the first candidate, the earlier stages' choice)
         * keeps its rounds from those stages too: its score is its fastest. */
        if (same_variant(&cand[0], &best) && best_t < t_best[0])
            t_best[0] = best_t;
        const int win = pick(t_best, nc);
        best_t = t_best[win];
        for (int c = 0; c < nc; c++)
            t_best[c] *= 1e9 / (double)unit;
        record_stage(r, stage, cand, nc, t_best);
        best = cand[win];
    }
    scratch_free(&s);
    if (st != FS_OK)
        return st;
    r->chosen = best;
    r->tuned = 1;
    /* In place: the rest of the step; on scratch: all of it. */
    return fs_optim_run(j, r->in_place ? pos : 0, n, &best);
}

/* After calibration: stage 3's candidates, timed on whole steps. */
static void start_trials(tune_entry *e)
{
    fs_tune_record *r = &e->rec;
    fs_optim_variant cand[FS_TUNE_MAX_CANDIDATES + 1];
    double untimed[FS_TUNE_MAX_CANDIDATES + 1];
    int nc = stage_candidates(3, r, &r->chosen, r->tuned_numel, cand + 1,
                              FS_TUNE_MAX_CANDIDATES);
    /* The incumbent, first: the class's default with stage 3's own incumbent
     * split ([Note: whole-step incumbent]), unless that is a candidate already. */
    fs_optim_variant def = class_default(r);
    def.stream_copy = r->copy_dtype >= 0 && r->simd_max >= FS_SIMD_AVX2;
    if (nc > 0)
        def.threads = cand[1].threads, def.omp = cand[1].omp, def.chunk_numel = cand[1].chunk_numel;
    int have = 0;
    for (int c = 1; c <= nc; c++)
        have |= same_variant(&cand[c], &def);
    if (nc > 0 && !have) {
        cand[0] = def;
        nc++;
    } else {
        memmove(cand, cand + 1, (size_t)nc * sizeof *cand);
    }
    if (nc > FS_TUNE_MAX_CANDIDATES - r->ncandidates)
        nc = FS_TUNE_MAX_CANDIDATES - r->ncandidates;
    for (int c = 0; c < nc; c++)
        untimed[c] = 1e30;
    e->trial_first = r->ncandidates;
    e->trial_count = nc;
    e->trials_started = e->trials_done = 0;
    record_stage(r, 3, cand, nc, untimed);
    e->state = nc > 0 ? 3 : 2;
}

/* One whole step of stage 3's trials in class `e`, or of its choice so far
 * when every trial has been handed out (to concurrent steps). */
static fs_status trial_step(const fs_optim_job *job, tune_entry *e)
{
    int k = -1, round = 0;
    fs_optim_variant v;
    pthread_mutex_lock(&tune_lock);
    if (e->trials_started < e->trial_count * TUNE_STEP_ROUNDS) {
        round = e->trials_started / e->trial_count;
        /* each round in another order, as calibrate's */
        k = e->trial_first + (e->trials_started++ + round) % e->trial_count;
        v = e->rec.candidates[k].variant;
    } else {
        v = e->rec.chosen;
    }
    pthread_mutex_unlock(&tune_lock);
    const int64_t n = job_numel(job);
    double t0 = now_s();
    fs_status st = fs_optim_run(job, 0, n, &v);
    double ns = 1e9 * (now_s() - t0) / (double)n;
    if (k < 0 || st != FS_OK)
        return st;
    pthread_mutex_lock(&tune_lock);
    fs_tune_record *r = &e->rec;
    e->trial_ns[k - e->trial_first][round] = ns;
    if (++e->trials_done == e->trial_count * TUNE_STEP_ROUNDS) {
        double t[FS_TUNE_MAX_CANDIDATES];
        for (int c = 0; c < e->trial_count; c++) {
            t[c] = median(e->trial_ns[c], TUNE_STEP_ROUNDS);
            r->candidates[e->trial_first + c].ns_per_elem = t[c];
        }
        r->chosen = r->candidates[e->trial_first + pick(t, e->trial_count)].variant;
        e->state = 2;
    }
    pthread_mutex_unlock(&tune_lock);
    return st;
}

fs_status fs_optim_step(const fs_optim_job *job, fs_simd simd, int threads)
{
    FS_CHECK(fs_optim_check(job));
    const int64_t n = job_numel(job);
    if (n == 0)
        return FS_OK;
    if (threads < 1)
        threads = 1;
    if (simd > fs_simd_best())
        simd = fs_simd_best();
    fs_tune_record key = class_of(job, simd, threads);

    tune_entry *mine = NULL, *trials = NULL;
    fs_optim_variant v = class_default(&key);
    pthread_mutex_lock(&tune_lock);
    int k = 0;
    for (; k < TUNE_CLASSES && tune_table[k].state != 0; k++)
        if (same_class(&tune_table[k].rec, &key))
            break;
    if (k < TUNE_CLASSES) {
        if (tune_table[k].state == 2) {
            v = tune_table[k].rec.chosen;
        } else if (tune_table[k].state == 3) {
            trials = &tune_table[k];
        } else if (tune_table[k].state == 0) {
            mine = &tune_table[k];
            mine->state = 1;
            mine->rec = key;
        }
        /* state 1: another thread is calibrating this class; the default runs here. */
    }
    pthread_mutex_unlock(&tune_lock);
    if (trials)
        return trial_step(job, trials);
    if (!mine)
        return fs_optim_run(job, 0, n, &v); /* chosen, being chosen, or the table is full */

    fs_tune_record rec = key;
    fs_status st = calibrate(job, &rec);
    pthread_mutex_lock(&tune_lock);
    if (st == FS_OK) {
        mine->rec = rec;
        if (rec.tuned)
            start_trials(mine);
        else
            mine->state = 2;
    } else {
        mine->state = 0; /* try again next step */
    }
    pthread_mutex_unlock(&tune_lock);
    return st;
}

fs_status fs_adam_step(const fs_adam_buffers *b, const fs_adam_hparams *h, fs_simd simd,
                       int threads)
{
    fs_optim_job j;
    memset(&j, 0, sizeof j);
    j.kind = FS_OPTIM_ADAM;
    j.adam = *b;
    j.adam_h = *h;
    return fs_optim_step(&j, simd, threads);
}

fs_status fs_sgd_step(const fs_sgd_buffers *b, const fs_sgd_hparams *h, fs_simd simd, int threads)
{
    fs_optim_job j;
    memset(&j, 0, sizeof j);
    j.kind = FS_OPTIM_SGD;
    j.sgd = *b;
    j.sgd_h = *h;
    return fs_optim_step(&j, simd, threads);
}

int fs_tune_records(fs_tune_record *out, int cap)
{
    int count = 0;
    pthread_mutex_lock(&tune_lock);
    for (int k = 0; k < TUNE_CLASSES; k++) {
        if (tune_table[k].state != 2)
            continue;
        if (count < cap)
            out[count] = tune_table[k].rec;
        count++;
    }
    pthread_mutex_unlock(&tune_lock);
    return count;
}

void fs_tune_reset(void)
{
    pthread_mutex_lock(&tune_lock);
    for (int k = 0; k < TUNE_CLASSES; k++)
        if (tune_table[k].state >= 2)
            tune_table[k].state = 0;
    pthread_mutex_unlock(&tune_lock);
}
