/* optim_tune.c - which variant of the fused optimizer loop (optim_cpu.c)
 * runs: chosen by timing the candidates on this machine, once per size
 * class, on scratch buffers before the class's first step, and remembered
 * in memory and on disk (optim_cache.c); and the tuned entry points the
 * optimizers call.
 *
 * Deliberately not a model of any CPU: nothing here says which variant wins
 * where, only how to measure. What the measurement chose, and the timings
 * it chose from, are kept for diagnostics (`python -m flatshard doctor`).
 */
#define _DEFAULT_SOURCE /* getloadavg */
#include "optim.h"
#include "pool.h" /* fs_map_resident */

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* [Note: tuning]
 * A size class is (kind, floor(log2 n), copy dtype, amsgrad, thread and SIMD
 * caps). Its variant is decided before its first step runs, and that step
 * and every later one run it: no live step is ever a trial.
 *
 * 1. In memory: a class chosen earlier in this process.
 * 2. On disk (optim_cache.c): a choice made by an earlier process with the
 *    same flatshard version, CPU (vendor, family, model, stepping, brand),
 *    instruction set cap, OpenMP runtime or none, and class. It costs one
 *    small file read per class and process.
 * 3. Else it is measured, here, on scratch buffers of min(n, TUNE_SCRATCH)
 *    elements (zero-filled: the loop's speed does not depend on the
 *    values; larger than the last-level cache of the CPUs measured, so the
 *    runs stream from memory as real steps do), within a time budget
 *    (tune_budget_s: about 4% of 60 steps of the class at memory speed, 17 ms
 *    at 2^24, capped at TUNE_BUDGET_MAX_S; the scratch buffers' first touch
 *    comes on top, 8-57 ms for 64 MiB on 2 threads: huge pages where they
 *    come at once, else plain ones), and the result
 *    stored on disk.
 *
 * The candidates are searched in stages, each keeping the winners so far:
 *   0  vector width x unrolling
 *   1  software prefetch distance (0: leave it to the hardware prefetchers)
 *   2  copy stores: non-temporal or regular (only with a low-precision copy)
 *   3  thread count x split (contiguous slices or chunks claimed in turn) x
 *      threads started for the step or the process's OpenMP team
 * A stage's candidates run in rounds, each round every candidate once, in an
 * order that turns by one each round (no candidate always runs right after a
 * given rival, whose stores may still be draining or whose OpenMP threads may
 * still be spinning), each run on the next slice of the scratch buffers (so
 * it starts cold, as a step after the backward pass does). Rounds repeat
 * until the stage's winner has stayed the same for TUNE_STABLE rounds (at
 * least TUNE_ROUNDS_MIN, at most TUNE_ROUNDS_MAX, or until the stage's share
 * of the budget is spent, but never fewer than one round): a round
 * that another process on the machine slowed decides nothing by itself.
 * The winner is the fastest, unless it beats the stage's first candidate,
 * the incumbent (the earlier stages' choice), by less than TUNE_MARGIN: a
 * difference within the noise is no reason to change.
 *
 * Stages 0-2 choose how a thread runs the loop and are timed in CPU time
 * (the busiest thread's: fs_optim_run_busy), best of the rounds: on a machine
 * with more runnable threads than cores the wall-clock time of a slice is
 * mostly how long its threads waited for a core (measured: on 2 busy vCPUs,
 * slices of one candidate varied 10x in wall-clock time and 10% in CPU
 * time). Stage 3 chooses how the threads are started and split, whose cost
 * is waiting (for a core, for a spinning OpenMP thread, for the slowest
 * slice), so it is timed in wall-clock time on runs of TUNE_SPLIT_UNIT
 * elements, median of the rounds: a split that is fast only in the moments
 * when nothing else runs should not win.
 *
 * [Note: busy machine]
 * A choice measured while the machine had more runnable work than cores
 * (the 1-minute load average above the online CPU count) may say more about
 * the other work than about the loop (measured on 2 vCPUs at load 11: the
 * OpenMP team waited 16 ms for a core per call, and one thread won at 2^24),
 * and a stored choice outlives the load. So on a busy machine the thread
 * split is not measured at all (stage 3 keeps its incumbent, the default
 * split: a split measured then would say which threads the other work left
 * running), and the choice is stored marked busy, and is
 * provisional: a process that finds it while the machine is not busy
 * measures again and replaces it; one that finds it while the machine is
 * busy uses it (measuring then would be no better). A choice measured on a
 * quiet machine is used whatever the load.
 *
 * [Note: hard stop]
 * One round per stage is a floor only while the whole measurement stays
 * within TUNE_HARD_FACTOR times its budget: on a machine so loaded that
 * every run waits for a core (measured on 2 vCPUs at load 23: 6.8 s for one
 * round of each stage at 2^24, the budget 80 ms), the candidates not yet run
 * are skipped and so are the stages after, which keep their incumbents. The
 * choice is then mostly the default, marked busy ([Note: busy machine]).
 *
 * [Note: incumbents]
 * Every stage starts from the class's default loop (class_default): the
 * widest SIMD unrolled 4 times, no prefetch, streaming copy stores, all
 * threads in contiguous slices on the OpenMP team where the process has
 * one (as torch runs its own parallel work). Measured on a 2-vCPU EPYC
 * Zen 4 and Zen 5 at 2^24 with torch's steps in between: unrolled 4 times was
 * never slower than once; streaming stores of a write-only copy cost no more
 * than no copy, regular ones 8% ([Note: copy stores]); threads started for the
 * step beside torch's still-spinning OpenMP threads ran 15-34% slower than
 * the team. So the default is what a slower, noisier measurement has to beat
 * by the margin.
 *
 * [Note: copy stores]
 * The step writes the copy and never reads it, and a regular store first
 * reads each line of the copy into the cache (2 more bytes per element on 28
 * or 30), which streaming stores skip. Regular stores stay where they measure
 * faster by the margin (a copy small enough to stay in cache for its reader,
 * a CPU whose streaming stores are slow). */

#define TUNE_SCRATCH (1 << 22)    /* elements of the scratch buffers, at most */
#define TUNE_SLICE (1 << 18)      /* elements per timed run in stages 0-2, at most */
#define TUNE_SPLIT_UNIT (1 << 20) /* elements per timed run in stage 3, at most */
#define TUNE_SAMPLE (1 << 16)     /* a smaller run is repeated up to this many elements */
#define TUNE_SAMPLE_S 2e-4        /* or for this long */
#define TUNE_ROUNDS_MIN 3
#define TUNE_ROUNDS_MAX 24
#define TUNE_STABLE 3
#define TUNE_MARGIN 0.05
#define TUNE_BUDGET_NS_PER_ELEM 1.0 /* ~4% of 60 steps at ~0.4 ns per element */
#define TUNE_BUDGET_MIN_S 2e-3
#define TUNE_BUDGET_MAX_S 0.08
#define TUNE_HARD_FACTOR 3.0 /* [Note: hard stop] */
#define TUNE_CLASSES 128
#define TUNE_CHUNK_LARGE (1 << 16)
#define TUNE_CHUNK_SMALL 2048
#define TUNE_KEY_MAX 400

static const int prefetch_candidates[] = {0, 1024, 4096, 16384};

typedef struct {
    int state; /* 0 unused, 1 being chosen, 2 chosen */
    fs_tune_record rec;
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


/* The variant a class starts from ([Note: incumbents]), with the bf16
 * instruction for a bf16 copy where the CPU has it ([Note: bf16 instruction]
 * in optim_cpu.c: the same bits with fewer instructions, so not a candidate
 * to time against the integer rounding). */
static fs_optim_variant class_default(const fs_tune_record *r)
{
    fs_optim_variant v = fs_optim_default_variant(r->simd_max, r->threads_max);
    v.bf16_insn = r->copy_dtype == (int)FS_BF16 && v.simd >= FS_SIMD_AVX512 &&
                  fs_optim_have_bf16_insn();
    v.stream_copy = r->copy_dtype >= 0 && v.simd >= FS_SIMD_AVX2;
    v.omp = r->threads_max > 1 && fs_optim_have_omp();
    return v;
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
        /* First the incumbent ([Note: incumbents]). */
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


/* ---------------------------------------------------------------------------
 * scratch buffers */

typedef struct {
    void *mem;
    size_t bytes;
} scratch;

/* `j` on zero-filled scratch buffers of n elements (same kind, flags and
 * copy dtype), or FS_ERR_NO_MEMORY. One resident mapping made as the state
 * is (fs_map_resident: populated by `threads` threads, huge pages only where
 * they come without a stall, [Note: state populated in parallel] in
 * csrc/engine/pool.c): the measurement runs on pages like the steps', and
 * its first touch, 64 MiB at 2^24, is split as theirs is. A huge-page fault
 * that compacts memory synchronously once took 1.4 s for 64 MiB on a loaded
 * machine (benchmarks/RESULTS.md), more than the whole measurement's budget;
 * the populate gives up huge pages at the first slow one. */
static fs_status scratch_job(const fs_optim_job *j, int64_t n, int threads, scratch *s,
                             fs_optim_job *out)
{
    *out = *j;
    const size_t fb = ((size_t)n * 4 + 4095) / 4096 * 4096, hb = ((size_t)n * 2 + 4095) / 4096 * 4096;
    const int adam = j->kind == FS_OPTIM_ADAM;
    const int nf = adam ? 4 + (j->adam.max_exp_avg_sq != NULL) : 2 + (j->sgd.momentum_buf != NULL);
    const int copy = adam ? j->adam.copy != NULL : j->sgd.copy != NULL;
    if (fs_map_resident(nf * fb + (copy ? hb : 0), threads, &s->mem, &s->bytes) != FS_OK) {
        s->mem = NULL;
        return FS_ERR_NO_MEMORY;
    }
    char *p = s->mem;
    float *f[5] = {NULL, NULL, NULL, NULL, NULL};
    for (int k = 0; k < nf; k++)
        f[k] = (float *)(p + k * fb);
    void *half = copy ? p + nf * fb : NULL;
    if (adam) {
        out->adam.param = f[0], out->adam.grad = f[1], out->adam.exp_avg = f[2];
        out->adam.exp_avg_sq = f[3];
        out->adam.max_exp_avg_sq = nf == 5 ? f[4] : NULL;
        out->adam.copy = half, out->adam.n = n;
    } else {
        out->sgd.param = f[0], out->sgd.grad = f[1];
        out->sgd.momentum_buf = nf == 3 ? f[2] : NULL;
        out->sgd.copy = half, out->sgd.n = n;
    }
    return FS_OK;
}

static void scratch_free(scratch *s)
{
    if (s->mem)
        fs_unmap(s->mem, s->bytes);
    s->mem = NULL;
}

/* ---------------------------------------------------------------------------
 * measuring */

/* The fastest of `nc` scores, but the first unless beaten by TUNE_MARGIN. */
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

/* The median of `n` times (sorts a copy). */
static double median(const double *t, int n)
{
    double s[TUNE_ROUNDS_MAX];
    memcpy(s, t, (size_t)n * sizeof *s);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && s[j] < s[j - 1]; j--) {
            double x = s[j];
            s[j] = s[j - 1];
            s[j - 1] = x;
        }
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

/* Adds one stage's candidates with their scores to `r`'s record. */
static void record_stage(fs_tune_record *r, int stage, const fs_optim_variant *cand, int nc,
                         const double *ns_per_elem, int rounds)
{
    for (int c = 0; c < nc && r->ncandidates < FS_TUNE_MAX_CANDIDATES; c++) {
        int k = r->ncandidates++;
        r->candidates[k].stage = stage;
        r->candidates[k].variant = cand[c];
        r->candidates[k].ns_per_elem = ns_per_elem[c];
        r->candidates[k].rounds = rounds;
    }
}

/* More runnable work than cores: [Note: busy machine]. */
static int machine_busy(void)
{
    double load[1] = {0.0};
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return getloadavg(load, 1) == 1 && load[0] > (double)(cpus > 0 ? cpus : 1);
}

/* How long a class of n elements may spend being measured. */
static double tune_budget_s(int64_t n)
{
    double b = TUNE_BUDGET_NS_PER_ELEM * 1e-9 * (double)n;
    return b < TUNE_BUDGET_MIN_S ? TUNE_BUDGET_MIN_S : b > TUNE_BUDGET_MAX_S ? TUNE_BUDGET_MAX_S : b;
}

/* Chooses r's variant on the scratch job `sj` (n elements; the class's own
 * step has r->tuned_numel), stage by stage ([Note: tuning]). */
static fs_status measure(const fs_optim_job *sj, int64_t n, fs_tune_record *r)
{
    const double t_start = now_s(), budget = tune_budget_s(r->tuned_numel);
    fs_optim_variant best = class_default(r);
    /* Stages 0-2 time the loop in CPU time: on threads started for the run,
     * which cost no waiting for an OpenMP team that may be asleep or
     * descheduled; stage 3 puts the split back (its incumbent is the
     * default's). */
    best.omp = 0;
    fs_status st = FS_OK;
    int64_t pos = 0; /* the next slice of the scratch buffers */
    int split_measured = 0;
    for (int stage = 0; stage < 4 && st == FS_OK; stage++) {
        const int64_t cap = stage == 3 ? TUNE_SPLIT_UNIT : TUNE_SLICE;
        const int64_t unit = n < cap ? n : cap;
        /* stage 3 times whole runs: its fixed costs per call are what it measures */
        const int64_t reps = stage == 3 || unit >= TUNE_SAMPLE ? 1 : TUNE_SAMPLE / (unit > 0 ? unit : 1);
        fs_optim_variant cand[FS_TUNE_MAX_CANDIDATES];
        int nc = stage_candidates(stage, r, &best, unit, cand, FS_TUNE_MAX_CANDIDATES);
        if (nc == 0)
            continue;
        const double deadline = t_start + budget * (stage + 1) / 4.0;
        if (now_s() > t_start + TUNE_HARD_FACTOR * budget) {
            r->cut_short = 1; /* [Note: hard stop] */
            break;
        }
        if (stage == 3 && machine_busy())
            break; /* [Note: busy machine]: the split stays the default */
        double t[FS_TUNE_MAX_CANDIDATES][TUNE_ROUNDS_MAX], score[FS_TUNE_MAX_CANDIDATES];
        int rounds = 0, win = 0, same = 0;
        /* One round at least; then within the budget until stable. */
        while (st == FS_OK && rounds < TUNE_ROUNDS_MAX &&
               (rounds == 0 || (now_s() < deadline &&
                                (rounds < TUNE_ROUNDS_MIN || same < TUNE_STABLE)))) {
            for (int o = 0; o < nc && st == FS_OK; o++) {
                const int c = (o + rounds) % nc;
                if (rounds == 0 && o > 0 && now_s() > t_start + TUNE_HARD_FACTOR * budget) {
                    nc = o; /* [Note: hard stop]: the rest are not run, nor recorded */
                    r->cut_short = 1;
                    break;
                }
                if (pos + unit > n)
                    pos = 0;
                double sum = 0.0;
                int64_t k = 0;
                const double t_run = now_s();
                /* a small run repeated to a measurable time, but bounded */
                while (k < reps && st == FS_OK && (k == 0 || now_s() - t_run < TUNE_SAMPLE_S)) {
                    double busy = 0.0;
                    const double t0 = now_s();
                    st = fs_optim_run_busy(sj, pos, pos + unit, &cand[c], &busy);
                    sum += stage == 3 ? now_s() - t0 : busy;
                    k++;
                }
                pos += unit;
                t[c][rounds] = sum / (double)(k * unit) * 1e9;
            }
            rounds++;
            for (int c = 0; c < nc; c++) {
                if (stage == 3) {
                    score[c] = median(t[c], rounds);
                } else {
                    score[c] = t[c][0];
                    for (int k = 1; k < rounds; k++)
                        score[c] = t[c][k] < score[c] ? t[c][k] : score[c];
                }
            }
            const int w = pick(score, nc);
            same = rounds > 1 && w == win ? same + 1 : 1;
            win = w;
        }
        if (st != FS_OK)
            break;
        record_stage(r, stage, cand, nc, score, rounds);
        best = cand[win];
        split_measured |= stage == 3;
    }
    r->tune_s = now_s() - t_start;
    if (st == FS_OK) {
        /* A split not measured (busy machine, hard stop) is the default's:
         * stages 0-2 ran on started threads only to time the loop. Measured
         * on EPYC Zen 3 at 2^24, 2 threads, load 2: started threads beside
         * torch's spinning team ran 0.74-0.85x torch fused, the team 0.96-1.08x
         * ([Note: incumbents]). */
        if (!split_measured)
            best.omp = class_default(r).omp;
        r->chosen = best;
        r->tuned = 1;
    }
    return st;
}

/* The class as a cache key's last fields. */
static void class_key(const fs_tune_record *r, char *out, size_t cap)
{
    const char *copy = r->copy_dtype < 0 ? "none" : r->copy_dtype == (int)FS_BF16 ? "bf16" : "f16";
    snprintf(out, cap, "simd=%s%s omp=%d %s 2^%d copy=%s amsgrad=%d threads=%d",
             fs_simd_name(r->simd_max), fs_optim_have_bf16_insn() ? "+bf16" : "",
             fs_optim_have_omp(), r->kind == FS_OPTIM_ADAM ? "adam" : "sgd", r->size_log2, copy,
             r->amsgrad, r->threads_max);
}

/* A variant from the cache is used only if this class could have chosen it. */
static int fits_class(const fs_optim_variant *v, const fs_tune_record *r)
{
    return v->simd <= r->simd_max && v->threads >= 1 && v->threads <= r->threads_max &&
           (!v->omp || fs_optim_have_omp()) && (!v->bf16_insn || r->copy_dtype == (int)FS_BF16);
}

/* Decides class `key`'s variant into *rec: from the disk cache, else
 * measured (on scratch like `job`) and stored there. */
static void choose(const fs_optim_job *job, const fs_tune_record *key, fs_tune_record *rec)
{
    *rec = *key;
    rec->chosen = class_default(key);
    rec->tuned_numel = job_numel(job);
    char cls[160], ck[TUNE_KEY_MAX];
    class_key(key, cls, sizeof cls);
    const int cached = fs_tune_cache_key(cls, ck, sizeof ck);
    fs_optim_variant v;
    const double t0 = now_s();
    int stored_busy = 0;
    const int busy = machine_busy();
    if (cached && fs_tune_cache_load(ck, &v, &stored_busy) && fits_class(&v, key) &&
        (!stored_busy || busy)) { /* [Note: busy machine] */
        rec->chosen = v;
        rec->tuned = 1;
        rec->busy = stored_busy;
        rec->source = FS_TUNE_FROM_CACHE;
        rec->tune_s = now_s() - t0;
        return;
    }
    const int64_t n = rec->tuned_numel < TUNE_SCRATCH ? rec->tuned_numel : TUNE_SCRATCH;
    scratch s = {NULL, 0};
    fs_optim_job sj;
    rec->source = FS_TUNE_MEASURED;
    if (scratch_job(job, n, key->threads_max, &s, &sj) != FS_OK)
        return; /* rec->tuned stays 0: the default runs */
    const fs_status st = measure(&sj, n, rec);
    scratch_free(&s);
    rec->tune_s = now_s() - t0; /* the scratch buffers' pages included */
    rec->busy = busy || machine_busy();
    if (st == FS_OK && cached)
        rec->stored = fs_tune_cache_store(ck, &rec->chosen, rec->busy);
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

    tune_entry *mine = NULL;
    fs_optim_variant v = class_default(&key);
    pthread_mutex_lock(&tune_lock);
    int k = 0;
    for (; k < TUNE_CLASSES && tune_table[k].state != 0; k++)
        if (same_class(&tune_table[k].rec, &key))
            break;
    if (k < TUNE_CLASSES) {
        if (tune_table[k].state == 2) {
            v = tune_table[k].rec.chosen;
        } else if (tune_table[k].state == 0) {
            mine = &tune_table[k];
            mine->state = 1;
            mine->rec = key;
        }
        /* state 1: another thread is choosing this class; the default runs here. */
    }
    pthread_mutex_unlock(&tune_lock);
    if (mine) {
        fs_tune_record rec;
        choose(job, &key, &rec);
        pthread_mutex_lock(&tune_lock);
        mine->rec = rec;
        mine->state = 2;
        pthread_mutex_unlock(&tune_lock);
        v = rec.chosen;
    }
    return fs_optim_run(job, 0, n, &v);
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
