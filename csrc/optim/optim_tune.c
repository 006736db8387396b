/* optim_tune.c - which variant of the fused optimizer loop (optim_cpu.c)
 * runs: chosen by timing the candidates on this machine, once per size
 * class (on scratch buffers before a small class's first step, on slices of
 * a larger class's own first steps), and remembered in memory and on disk
 * (optim_cache.c); and the tuned entry points the optimizers call.
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
 * caps). Its variant comes from:
 *
 * 1. In memory: a class chosen earlier in this process.
 * 2. On disk (optim_cache.c): a choice made by an earlier process with the
 *    same flatshard version, CPU (vendor, family, model, stepping, brand),
 *    instruction set cap, OpenMP runtime or none, and class. It costs one
 *    small file read per class and process.
 * 3. Else it is measured here, within a time budget (tune_budget_s: about
 *    4% of 60 steps of the class at memory speed, 17 ms at 2^24, capped at
 *    TUNE_BUDGET_MAX_S), and the result stored on disk:
 *    - a class of TUNE_LIVE_MIN elements and more on its own first steps
 *      ([Note: measured on the steps]);
 *    - a smaller one on scratch buffers of n elements before its first step
 *      (zero-filled: the loop's speed does not depend on the values), whose
 *      small runs are repeated to a measurable time, which a step's elements
 *      cannot be.
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
 * it starts cold, as a step after the backward pass does; on the steps,
 * the next slice of the step). Rounds repeat
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
 * [Note: measured on the steps]
 * Every variant gives every element the same bits ([Note: one formula] in
 * optim_cpu.c), so a step can be cut into slices, each run by another
 * candidate, and give the bits of a step run by one. A class of
 * TUNE_LIVE_MIN elements and more is measured that way: each timed run is
 * the next slice of the class's step (TUNE_SLICE elements in stages 0-2,
 * TUNE_SPLIT_UNIT in stage 3, once each), as many runs as the step has
 * slices, the rest of the step with the winner so far (on the default's
 * threads until stage 3 has measured them); the next step of the class goes
 * on where this one stopped, until every stage is done. The runs are the
 * steps' own work, so the measurement costs only what a candidate takes
 * beyond the stage's fastest run so far: that is what the budget counts
 * (`spent`), and the later rounds, without the hopeless ([Note: hopeless]),
 * cost little, so a stage runs TUNE_ROUNDS_MIN rounds before its share of
 * the budget can end it. The scratch buffers it replaces were 64 MiB at
 * 2^24, whose first touch took 17-57 ms, more than the measurement itself;
 * a fresh AdamW's first step at 2^24 took 101-108 ms with them and 59-68 ms
 * now, torch's fused one 46-62 ms (EPYC Zen 3, 2 threads,
 * benchmarks/results/optim.md, "CPU AdamW: tuning on the steps"). While a
 * step of the class is being measured by one
 * thread, another thread's step of it runs the default.
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

#define TUNE_SLICE (1 << 18)      /* elements per timed run in stages 0-2, at most */
#define TUNE_SPLIT_UNIT (1 << 20) /* elements per timed run in stage 3, at most */
#define TUNE_SAMPLE (1 << 16)     /* a smaller run is repeated up to this many elements */
#define TUNE_LIVE_MIN TUNE_SAMPLE /* classes from here on are measured on their steps */
#define TUNE_SAMPLE_S 2e-4        /* or for this long */
#define TUNE_ROUNDS_MIN 3
#define TUNE_ROUNDS_MAX 24
#define TUNE_STABLE 3
#define TUNE_MARGIN 0.05
#define TUNE_HOPELESS 2.0 /* [Note: hopeless] */
#define TUNE_BUDGET_NS_PER_ELEM 1.0 /* ~4% of 60 steps at ~0.4 ns per element */
#define TUNE_BUDGET_MIN_S 2e-3
#define TUNE_BUDGET_MAX_S 0.08
#define TUNE_HARD_FACTOR 3.0 /* [Note: hard stop] */
#define TUNE_CLASSES 128
#define TUNE_CHUNK_LARGE (1 << 16)
#define TUNE_CHUNK_SMALL 2048
#define TUNE_KEY_MAX 400

static const int prefetch_candidates[] = {0, 1024, 4096, 16384};


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
 * copy dtype), or FS_ERR_NO_MEMORY: one resident mapping (fs_map_resident,
 * [Note: state populated in parallel] in csrc/engine/pool.c), at most a
 * few MiB since only classes under TUNE_LIVE_MIN elements are measured on
 * scratch. */
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
                         const double *ns_per_elem, const int *runs)
{
    for (int c = 0; c < nc && r->ncandidates < FS_TUNE_MAX_CANDIDATES; c++) {
        int k = r->ncandidates++;
        r->candidates[k].stage = stage;
        r->candidates[k].variant = cand[c];
        r->candidates[k].ns_per_elem = ns_per_elem[c];
        r->candidates[k].rounds = runs[c];
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

/* A measurement in progress ([Note: measured on the steps]): the stages'
 * loop as state, so that it can run a timed run at a time, on scratch
 * buffers in one go or on a class's own steps across calls. */
typedef struct {
    int stage;   /* the stage being measured; 4: done */
    int nc;      /* its candidates (0: not set up yet) */
    int rounds;  /* rounds completed */
    int o;       /* the next run's place in the round */
    int win, same, split_measured;
    int64_t unit, reps;
    int on_steps;  /* the runs are the class's own steps' work */
    double spent;  /* seconds the runs cost: their time, or on the steps what they took
                    * beyond the stage's fastest run so far ([Note: measured on the steps]) */
    double wall_best; /* on the steps: the stage's fastest run so far, seconds per element */
    double budget; /* tune_budget_s of the class */
    fs_optim_variant best;
    fs_optim_variant cand[FS_TUNE_MAX_CANDIDATES];
    double t[FS_TUNE_MAX_CANDIDATES][TUNE_ROUNDS_MAX], score[FS_TUNE_MAX_CANDIDATES];
    int runs[FS_TUNE_MAX_CANDIDATES]; /* timed runs of each candidate */
    int dropped[FS_TUNE_MAX_CANDIDATES]; /* out of the later rounds ([Note: hopeless]) */
} measuring;

typedef struct {
    int state; /* 0 unused, 1 being chosen (or stepped while measured) by one thread,
                * 2 chosen, 3 measured on its steps, between two of them */
    fs_tune_record rec;
    measuring live; /* states 1 and 3, where measured on the steps */
} tune_entry;

static pthread_mutex_t tune_lock = PTHREAD_MUTEX_INITIALIZER;
static tune_entry tune_table[TUNE_CLASSES];

static void measuring_init(measuring *m, const fs_tune_record *r, int on_steps)
{
    memset(m, 0, sizeof *m);
    m->on_steps = on_steps;
    m->budget = tune_budget_s(r->tuned_numel);
    m->best = class_default(r);
    /* Stages 0-2 time the loop in CPU time: on threads started for the run,
     * which cost no waiting for an OpenMP team that may be asleep or
     * descheduled; stage 3 puts the split back (its incumbent is the
     * default's). */
    m->best.omp = 0;
}

/* The variant a step runs while its class is measured: the winner so far,
 * on the default's threads and split until stage 3 has chosen them. */
static fs_optim_variant measuring_current(const measuring *m, const fs_tune_record *r)
{
    fs_optim_variant v = m->best;
    if (!m->split_measured) {
        const fs_optim_variant d = class_default(r);
        v.threads = d.threads, v.omp = d.omp, v.chunk_numel = d.chunk_numel;
    }
    return v;
}

/* Sets up the next stage with candidates (n: elements a run may take at
 * most); 0 when the measurement is over. */
static int measuring_stage(measuring *m, fs_tune_record *r, int64_t n)
{
    while (m->nc == 0 && m->stage < 4) {
        const int64_t cap = m->stage == 3 ? TUNE_SPLIT_UNIT : TUNE_SLICE;
        m->unit = n < cap ? n : cap;
        /* stage 3 times whole runs: its fixed costs per call are what it measures */
        m->reps = m->stage == 3 || m->unit >= TUNE_SAMPLE ? 1
                                                          : TUNE_SAMPLE / (m->unit > 0 ? m->unit : 1);
        m->nc = stage_candidates(m->stage, r, &m->best, m->unit, m->cand, FS_TUNE_MAX_CANDIDATES);
        m->rounds = m->o = m->win = m->same = 0;
        memset(m->runs, 0, sizeof m->runs);
        m->wall_best = -1.0;
        memset(m->dropped, 0, sizeof m->dropped);
        if (m->nc == 0) {
            m->stage++;
            continue;
        }
        if (m->spent > TUNE_HARD_FACTOR * m->budget) {
            r->cut_short = 1; /* [Note: hard stop] */
            m->stage = 4;
        } else if (m->stage == 3 && machine_busy()) {
            m->stage = 4; /* [Note: busy machine]: the split stays the default */
        }
    }
    if (m->stage >= 4) {
        m->nc = 0;
        return 0;
    }
    return 1;
}

/* The candidate of the next timed run. */
static int measuring_slot(const measuring *m)
{
    return (m->o + m->rounds) % m->nc;
}

static const fs_optim_variant *measuring_next(const measuring *m)
{
    return &m->cand[measuring_slot(m)];
}

/* Ends the stage: its candidates into the record, its winner the best. */
static void measuring_end_stage(measuring *m, fs_tune_record *r)
{
    record_stage(r, m->stage, m->cand, m->nc, m->score, m->runs);
    m->best = m->cand[m->win];
    m->split_measured |= m->stage == 3;
    m->stage++;
    m->nc = 0;
}

/* Moves o past the candidates out of this round. */
static void skip_dropped(measuring *m)
{
    while (m->o < m->nc && m->dropped[measuring_slot(m)])
        m->o++;
}

/* [Note: hopeless]
 * After a round, a candidate slower than TUNE_HOPELESS times the round's
 * leader runs no more rounds: it cannot come back to win by the margin, and
 * on the class's own steps each of its runs is paid by a step (started
 * threads beside torch's spinning OpenMP team ran 3-6x slower than the
 * team, EPYC Zen 3, 2^20-element runs). Its score stays as measured. */
static void drop_hopeless(measuring *m)
{
    double lead = m->score[0];
    for (int k = 1; k < m->nc; k++)
        lead = m->score[k] < lead ? m->score[k] : lead;
    for (int k = 0; k < m->nc; k++)
        if (m->score[k] > TUNE_HOPELESS * lead)
            m->dropped[k] = 1;
}

/* Takes the time of the run measuring_next named (ns per element) and
 * moves on: the next run, round or stage. One round at least; then within
 * the stage's share of the budget until stable. */
static void measuring_record(measuring *m, fs_tune_record *r, double ns_per_elem, double run_s)
{
    const int c = measuring_slot(m);
    m->t[c][m->runs[c]++] = ns_per_elem;
    if (m->on_steps) {
        const double per = run_s / (double)m->unit;
        if (m->wall_best < 0 || per < m->wall_best)
            m->wall_best = per;
        m->spent += run_s - m->wall_best * (double)m->unit;
    } else {
        m->spent += run_s;
    }
    m->o++;
    if (m->rounds == 0 && m->o < m->nc && m->spent > TUNE_HARD_FACTOR * m->budget) {
        m->nc = m->o; /* [Note: hard stop]: the rest are not run, nor recorded */
        r->cut_short = 1;
    }
    skip_dropped(m);
    if (m->o < m->nc)
        return;
    m->o = 0;
    m->rounds++;
    for (int k = 0; k < m->nc; k++) {
        if (m->stage == 3) {
            m->score[k] = median(m->t[k], m->runs[k]);
        } else {
            m->score[k] = m->t[k][0];
            for (int q = 1; q < m->runs[k]; q++)
                m->score[k] = m->t[k][q] < m->score[k] ? m->t[k][q] : m->score[k];
        }
    }
    const int w = pick(m->score, m->nc);
    m->same = m->rounds > 1 && w == m->win ? m->same + 1 : 1;
    m->win = w;
    /* On the steps the later rounds cost little (the hopeless are out), so
     * the stage's share of the budget ends it only after TUNE_ROUNDS_MIN;
     * the hard stop still ends it at once. */
    const double deadline = m->budget * (m->stage + 1) / 4.0;
    const int min_rounds = m->on_steps ? TUNE_ROUNDS_MIN : 1;
    if (m->spent > TUNE_HARD_FACTOR * m->budget)
        r->cut_short = 1; /* [Note: hard stop] */
    if (r->cut_short || m->rounds >= TUNE_ROUNDS_MAX ||
        (m->rounds >= min_rounds && m->spent >= deadline) ||
        (m->rounds >= TUNE_ROUNDS_MIN && m->same >= TUNE_STABLE)) {
        measuring_end_stage(m, r);
        return;
    }
    drop_hopeless(m);
    skip_dropped(m);
}

/* One timed run of the next candidate on [lo, lo + unit) of `job`, `reps`
 * times at most (scratch only: a live range runs once). */
static fs_status measuring_run(measuring *m, fs_tune_record *r, const fs_optim_job *job,
                               int64_t lo, int64_t reps)
{
    const fs_optim_variant *v = measuring_next(m);
    double sum = 0.0;
    int64_t k = 0;
    fs_status st = FS_OK;
    const double t_run = now_s();
    /* a small run repeated to a measurable time, but bounded */
    while (k < reps && st == FS_OK && (k == 0 || now_s() - t_run < TUNE_SAMPLE_S)) {
        double busy = 0.0;
        const double t0 = now_s();
        st = fs_optim_run_busy(job, lo, lo + m->unit, v, &busy);
        sum += m->stage == 3 ? now_s() - t0 : busy;
        k++;
    }
    if (st == FS_OK)
        measuring_record(m, r, sum / (double)(k * m->unit) * 1e9, now_s() - t_run);
    return st;
}

/* The measurement's end: the winner into the record. A split not measured
 * (busy machine, hard stop) is the default's: stages 0-2 ran on started
 * threads only to time the loop. Measured on EPYC Zen 3 at 2^24, 2 threads,
 * load 2: started threads beside torch's spinning team ran 0.74-0.85x torch
 * fused, the team 0.96-1.08x ([Note: incumbents]). */
static void measuring_done(measuring *m, fs_tune_record *r)
{
    r->chosen = measuring_current(m, r);
    r->tuned = 1;
    r->tune_s = m->spent;
}

/* Chooses r's variant on the scratch job `sj` (n elements; the class's own
 * step has r->tuned_numel), stage by stage ([Note: tuning]), in one go. */
static fs_status measure_scratch(const fs_optim_job *sj, int64_t n, fs_tune_record *r)
{
    measuring m;
    measuring_init(&m, r, 0);
    int64_t pos = 0; /* the next slice of the scratch buffers */
    while (measuring_stage(&m, r, n)) {
        if (pos + m.unit > n)
            pos = 0;
        const fs_status st = measuring_run(&m, r, sj, pos, m.reps);
        if (st != FS_OK)
            return st;
        pos += m.unit;
    }
    measuring_done(&m, r);
    return FS_OK;
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

/* Stores a measured choice in the disk cache (where one is set). */
static void store_choice(fs_tune_record *rec)
{
    char cls[160], ck[TUNE_KEY_MAX];
    class_key(rec, cls, sizeof cls);
    if (fs_tune_cache_key(cls, ck, sizeof ck))
        rec->stored = fs_tune_cache_store(ck, &rec->chosen, rec->busy);
}

/* Decides class `key`'s variant into *rec, from the disk cache or measured
 * on scratch like `job` (and stored): 0. Or, for a class whose steps are
 * long enough to time ([Note: measured on the steps]), begins measuring on
 * them in *live: 1. */
static int choose(const fs_optim_job *job, const fs_tune_record *key, fs_tune_record *rec,
                  measuring *live)
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
        return 0;
    }
    rec->busy = busy;
    if (rec->tuned_numel >= TUNE_LIVE_MIN) {
        rec->source = FS_TUNE_ON_STEPS;
        measuring_init(live, rec, 1);
        return 1;
    }
    const int64_t n = rec->tuned_numel; /* under TUNE_LIVE_MIN */
    scratch s = {NULL, 0};
    fs_optim_job sj;
    rec->source = FS_TUNE_MEASURED;
    if (scratch_job(job, n, key->threads_max, &s, &sj) != FS_OK)
        return 0; /* rec->tuned stays 0: the default runs */
    const fs_status st = measure_scratch(&sj, n, rec);
    scratch_free(&s);
    rec->tune_s = now_s() - t0; /* the scratch buffers' pages included */
    rec->busy = busy || machine_busy();
    if (st == FS_OK)
        store_choice(rec);
    return 0;
}

/* The class's step `job` while its measurement runs on its steps: timed
 * runs of the candidates on its first slices, as many as fit (each element
 * updated once, every variant giving the same bits: [Note: one formula] in
 * optim_cpu.c), the rest with the winner so far. Called with the entry
 * owned (state 1); leaves it chosen (2) or to go on at the next step (3). */
static fs_status step_measuring(tune_entry *e, const fs_optim_job *job, int64_t n)
{
    measuring *m = &e->live;
    fs_tune_record *r = &e->rec;
    /* runs no longer than the class's smallest step, so that every step of
     * it can hold one */
    const int64_t class_min = (int64_t)1 << r->size_log2;
    int64_t pos = 0;
    fs_status st = FS_OK;
    int ran = 0;
    while (st == FS_OK && measuring_stage(m, r, class_min) && pos + m->unit <= n) {
        st = measuring_run(m, r, job, pos, 1);
        pos += m->unit;
        ran = 1;
    }
    r->live_steps += ran;
    const int done = st != FS_OK || m->stage >= 4;
    if (done && st == FS_OK) {
        measuring_done(m, r);
        r->busy = r->busy || machine_busy();
        store_choice(r);
    }
    const fs_optim_variant v = st == FS_OK ? measuring_current(m, r) : r->chosen;
    if (st == FS_OK && pos < n)
        st = fs_optim_run(job, pos, n, &v);
    pthread_mutex_lock(&tune_lock);
    e->state = done ? 2 : 3;
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

    tune_entry *mine = NULL;
    int resume = 0;
    fs_optim_variant v = class_default(&key);
    pthread_mutex_lock(&tune_lock);
    int k = 0;
    for (; k < TUNE_CLASSES && tune_table[k].state != 0; k++)
        if (same_class(&tune_table[k].rec, &key))
            break;
    if (k < TUNE_CLASSES) {
        tune_entry *e = &tune_table[k];
        if (e->state == 2) {
            v = e->rec.chosen;
        } else if (e->state == 0 || e->state == 3) {
            mine = e;
            resume = e->state == 3;
            if (!resume)
                mine->rec = key;
            mine->state = 1;
        }
        /* state 1: another thread is choosing this class, or stepping it while
         * it is measured; the default runs here. */
    }
    pthread_mutex_unlock(&tune_lock);
    if (!mine)
        return fs_optim_run(job, 0, n, &v);
    if (!resume) {
        fs_tune_record rec;
        if (!choose(job, &key, &rec, &mine->live)) {
            pthread_mutex_lock(&tune_lock);
            mine->rec = rec;
            mine->state = 2;
            pthread_mutex_unlock(&tune_lock);
            return fs_optim_run(job, 0, n, &rec.chosen);
        }
        mine->rec = rec; /* the owner's alone while state 1 and 3 */
    }
    return step_measuring(mine, job, n);
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

fs_status fs_optim_steps(fs_optim_job *js, float *const *steps, int n, fs_simd simd,
                         int threads)
{
    fs_status s = FS_OK;
    for (int i = 0; i < n && s == FS_OK; i++) {
        fs_optim_take_step_counts(&js[i], steps ? &steps[i] : NULL, 1);
        s = fs_optim_step(&js[i], simd, threads);
    }
    return s;
}
