/* optim.h - fused optimizer steps over flat fp32 buffers on the CPU.
 *
 * One pass over (param, grad, state...) per step: the loop is memory-bound,
 * so fusing every elementwise op of the update into one read and one write
 * of each buffer is the whole game. Math is f32, elementwise, in the order
 * torch's single-tensor implementations use (tests hold it to ~1e-6 relative
 * after many steps). Optionally the same pass writes a bf16/fp16 copy of the
 * updated parameters (the low-precision weights of mixed precision/offload).
 *
 * How fast a memory-bound loop runs depends on the machine more than on the
 * code: the vector width, unrolling, software prefetch distance, streaming
 * (non-temporal) stores of the copy, the number of threads and how they
 * split the buffers each win on one CPU and lose on another. Each of those
 * is a field of fs_optim_variant; optim_cpu.c runs any variant and
 * optim_tune.c picks one per size class by timing the candidates on
 * scratch buffers before the class's first step, or reads the choice an
 * earlier process stored (optim_cache.c; [Note: tuning] in optim_tune.c).
 * Every variant computes one formula, with fused multiply-adds ([Note: one
 * formula] in optim_cpu.c), held to a float64 evaluation within
 * FS_OPTIM_ULP ulps; each element is updated by exactly one thread.
 *
 * Indices are 64-bit. The caller releases the GIL.
 */
#ifndef FS_OPTIM_H
#define FS_OPTIM_H

#include <stddef.h>
#include <stdint.h>
#include "fs_dtype.h"
#include "fs_status.h"
#include "reduce.h"

typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;      /* already incremented: 1 on the first update */
    int decoupled;     /* 1: AdamW (decay the parameter); 0: Adam (L2 into the gradient) */
    int maximize;
} fs_adam_hparams;

typedef struct {
    float *param;          /* (n) updated in place */
    const float *grad;     /* (n) */
    float *exp_avg;        /* (n) */
    float *exp_avg_sq;     /* (n) */
    float *max_exp_avg_sq; /* (n) amsgrad, or NULL */
    void *copy;            /* (n) low-precision copy of the updated param, or NULL */
    fs_dtype copy_dtype;   /* FS_BF16 or FS_F16 when copy != NULL */
    int64_t n;
} fs_adam_buffers;

typedef struct {
    float lr, momentum, dampening, weight_decay;
    int nesterov, maximize;
    int first_step; /* momentum buffer is initialised to the gradient (torch's rule) */
} fs_sgd_hparams;

typedef struct {
    float *param;        /* (n) updated in place */
    const float *grad;   /* (n) */
    float *momentum_buf; /* (n) NULL when momentum == 0 */
    void *copy;          /* (n) as fs_adam_buffers' */
    fs_dtype copy_dtype;
    int64_t n;
} fs_sgd_buffers;

typedef enum { FS_OPTIM_ADAM = 0, FS_OPTIM_SGD = 1 } fs_optim_kind;

/* One step of either optimizer: the unit that variants run and tuning times. */
typedef struct {
    fs_optim_kind kind;
    fs_adam_buffers adam; /* kind == FS_OPTIM_ADAM */
    fs_adam_hparams adam_h;
    fs_sgd_buffers sgd;   /* kind == FS_OPTIM_SGD */
    fs_sgd_hparams sgd_h;
} fs_optim_job;

/* One way to run the loop. Name form (fs_optim_variant_name/_parse):
 * "avx512.u2.pf1024.nt.t2.c0" = simd.u<unroll>.pf<prefetch_bytes>.<st|nt>.<t|omp><threads>
 * .c<chunk_numel>, where simd "avx512bf16" is avx512 with bf16_insn. */
typedef struct {
    fs_simd simd;        /* instruction set; capped at what the CPU has */
    int unroll;          /* vectors per loop iteration: 1, 2 or 4 */
    int prefetch_bytes;  /* software prefetch distance per stream; 0: hardware prefetch only */
    int stream_copy;     /* 1: non-temporal stores for the write-only low-precision copy */
    int threads;         /* threads that share the step (>= 1) */
    int omp;             /* 1: those threads are the process's OpenMP team (torch's
                          * intra-op threads, already started), when the process has
                          * an OpenMP runtime; 0: threads started for the step */
    int64_t chunk_numel; /* 0: one contiguous slice per thread; else chunks of this many
                          * elements (a multiple of 16) claimed by whichever thread is free */
    int bf16_insn;       /* 1: the AVX-512 loop rounds a bf16 copy with vcvtneps2bf16
                          * (AVX512_BF16), same bits; needs simd avx512 and a CPU that has
                          * it (fs_optim_have_bf16_insn); no effect without a bf16 copy */
} fs_optim_variant;

#define FS_OPTIM_VARIANT_NAME_MAX 64

/* How far any variant's result may be from the update evaluated in float64
 * from the same f32 inputs, in ulps of the largest term of the operation that
 * makes each value (so that cancellation does not count against a correctly
 * rounded path): tests/test_optim_ulp.py holds every path to it. The
 * parameter's value passes through about seven roundings (the f32 step size
 * and bias correction, the decay, sqrt, the fused multiply-adds of the
 * moment and the denominator, the divide, the last fused multiply-add);
 * measured at most 3.9 ulps on the test's inputs. */
#define FS_OPTIM_ULP 6

/* ---------------------------------------------------------------------------
 * optim_cpu.c: run a given variant */

/* Elements [lo, hi) of the job's update with variant v. 0 <= lo <= hi <= n. */
fs_status fs_optim_run(const fs_optim_job *job, int64_t lo, int64_t hi, const fs_optim_variant *v);
/* The same, and *busy_s: the most CPU time any of its threads spent on it,
 * which leaves out waiting for a core (the tuning's measure of a loop). */
fs_status fs_optim_run_busy(const fs_optim_job *job, int64_t lo, int64_t hi,
                            const fs_optim_variant *v, double *busy_s);
/* Checks the job's buffers and hparams (n >= 0, step >= 1, copy dtype). */
fs_status fs_optim_check(const fs_optim_job *job);
/* [Note: step counts] Adam's count of steps is torch's state['step'], a
 * float32 the caller keeps, incremented and then used, as torch's AdamW
 * does. 1 when `step` can be: given, and finite, >= 1 and within int64 once
 * incremented. */
int fs_optim_step_count_ok(const float *step);
/* The n jobs' counts taken ([Note: step counts]): each Adam job's steps[i]
 * (none for a NULL array or entry) incremented and set as its step. */
void fs_optim_take_step_counts(fs_optim_job *js, float *const *steps, int n);
/* The variant used before (or without) tuning: the widest SIMD unrolled 4
 * times (scalar: once), no prefetch, regular stores, `threads` contiguous
 * slices on threads started for it. */
fs_optim_variant fs_optim_default_variant(fs_simd simd, int threads);
/* 1 when this process has an OpenMP runtime that omp variants can use. */
int fs_optim_have_omp(void);
/* 1 when the CPU has AVX512_BF16 (and AVX512DQ, AVX-512 F/BW): bf16_insn variants run. */
int fs_optim_have_bf16_insn(void);
/* "name" -> variant; FS_ERR_INVALID_ARG for a malformed name or field. */
fs_status fs_optim_variant_parse(const char *name, fs_optim_variant *out);
void fs_optim_variant_name(const fs_optim_variant *v, char out[FS_OPTIM_VARIANT_NAME_MAX]);

/* ---------------------------------------------------------------------------
 * optim_tune.c: the tuned steps (what the optimizers call) and their record */

/* One step with the variant chosen for this size class, choosing it first
 * if the class is new in this process. simd caps the instruction set (fs_simd_best()
 * for no cap); threads caps the thread count. */
fs_status fs_optim_step(const fs_optim_job *job, fs_simd simd, int threads);
/* fs_optim_step for each of the n jobs in order, each after its count is
 * taken (fs_optim_take_step_counts; steps may be NULL); stops at the first
 * failure. */
fs_status fs_optim_steps(fs_optim_job *js, float *const *steps, int n, fs_simd simd,
                         int threads);
fs_status fs_adam_step(const fs_adam_buffers *b, const fs_adam_hparams *h, fs_simd simd,
                       int threads);
fs_status fs_sgd_step(const fs_sgd_buffers *b, const fs_sgd_hparams *h, fs_simd simd, int threads);

/* What the tuning decided, for diagnostics: one record per size class. */
#define FS_TUNE_MAX_CANDIDATES 32
typedef enum {
    FS_TUNE_MEASURED = 0,   /* on scratch buffers before the class's first step */
    FS_TUNE_FROM_CACHE = 1, /* read from the disk cache */
    FS_TUNE_ON_STEPS = 2    /* on the class's own first steps ([Note: measured on the steps]) */
} fs_tune_source;
typedef struct {
    fs_optim_kind kind;
    int size_log2;     /* the class: steps of 2^size_log2 .. 2^(size_log2+1)-1 elements */
    int copy_dtype;    /* -1: no copy; else the fs_dtype of the copy */
    int amsgrad;
    int threads_max;
    fs_simd simd_max;
    int64_t tuned_numel;   /* n of the class's first step */
    fs_tune_source source; /* measured in this process (on scratch or on its steps), or read
                            * from the disk cache */
    int live_steps;        /* on its steps: how many of them (one per parameter or shard
                            * stepped) held timed runs */
    int tuned;             /* 0: no scratch memory to measure on; the default is used */
    int stored;            /* measured and written to the disk cache */
    int busy;              /* measured (or, from the cache, stored) while the machine was
                            * busy ([Note: busy machine] in optim_tune.c) */
    int cut_short;         /* the measurement hit its hard stop ([Note: hard stop] in
                            * optim_tune.c): candidates or stages left out */
    double tune_s;         /* seconds spent choosing (measuring, or reading the cache; on its
                            * steps: what the timed runs took beyond the stage's fastest run,
                            * since they did the steps' own work) */
    fs_optim_variant chosen;
    int ncandidates;
    struct {
        int stage;                /* 0 simd/unroll, 1 prefetch, 2 copy stores, 3 threads */
        fs_optim_variant variant;
        double ns_per_elem;       /* stages 0-2: best CPU time of the rounds; 3: median
                                   * wall-clock time */
        int rounds;               /* rounds the candidate ran (the stage's until its winner was
                                   * stable, fewer where it was dropped as hopeless) */
    } candidates[FS_TUNE_MAX_CANDIDATES];
} fs_tune_record;

/* Copies up to `cap` records into out; returns how many classes are tuned. */
int fs_tune_records(fs_tune_record *out, int cap);
/* Forgets every choice in memory: the next step of each class chooses again
 * (from the disk cache where it has the class). */
void fs_tune_reset(void);

/* ---------------------------------------------------------------------------
 * optim_cache.c: the choices on disk */

/* Where the cache file is (NULL or "": none) and flatshard's version, the
 * first field of every key. */
fs_status fs_tune_cache_set(const char *path, const char *version);
/* 1 and the path into out when a cache file is set, else 0. */
int fs_tune_cache_path(char *out, size_t cap);
/* The full key of class fields `cls` (version, CPU, then cls) into out; 0
 * when no cache is set. */
int fs_tune_cache_key(const char *cls, char *out, size_t cap);
/* 1, the stored variant for `key` and whether it was measured on a busy
 * machine, or 0 (no file, no valid line). */
int fs_tune_cache_load(const char *key, fs_optim_variant *out, int *busy);
/* Stores key -> v, busy (replacing key's line), atomically; 1 when written. */
int fs_tune_cache_store(const char *key, const fs_optim_variant *v, int busy);

#endif
