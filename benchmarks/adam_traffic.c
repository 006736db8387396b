/* adam_traffic.c - the memory traffic of an fp32 AdamW step without its
 * math, for bench_optim.py: read param, grad, exp_avg and exp_avg_sq, write
 * param, exp_avg and exp_avg_sq (28 bytes per element), each thread its
 * contiguous slice, as the step's own loops split it. No optimizer moves
 * these bytes much faster than this loop does on the same machine at the
 * same moment: it is the step's speed limit, measured.
 *
 * The threads are the process's OpenMP team, torch's (GOMP_parallel found
 * at run time, as flatshard's own loop finds it): a second OpenMP runtime
 * linked here would start threads of its own beside torch's still-spinning
 * ones and measure the two teams' fight, not the memory. Without such a
 * runtime in the process it runs on the calling thread.
 *
 *   cc -O3 -march=native -shared -fPIC -o adam_traffic.so adam_traffic.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>

typedef struct {
    float *p, *m, *v;
    const float *g;
    int64_t n;
} job;

static int (*thread_num)(void), (*num_threads)(void);

static void slice(const job *j, int64_t lo, int64_t hi)
{
    float *restrict p = j->p, *restrict m = j->m, *restrict v = j->v;
    const float *restrict g = j->g;
    for (int64_t i = lo; i < hi; i++) {
        const float x = g[i];
        p[i] += x;
        m[i] += x;
        v[i] += x;
    }
}

static void member(void *arg)
{
    const job *j = arg;
    const int64_t t = thread_num(), nt = num_threads();
    const int64_t lo = j->n * t / nt / 16 * 16;
    const int64_t hi = t == nt - 1 ? j->n : j->n * (t + 1) / nt / 16 * 16;
    slice(j, lo, hi);
}

/* Returns the threads it ran on. */
int adam_traffic(float *p, const float *g, float *m, float *v, int64_t n, int threads)
{
    void (*parallel)(void (*)(void *), void *, unsigned, unsigned) =
        (void (*)(void (*)(void *), void *, unsigned, unsigned))dlsym(RTLD_DEFAULT,
                                                                        "GOMP_parallel");
    thread_num = (int (*)(void))dlsym(RTLD_DEFAULT, "omp_get_thread_num");
    num_threads = (int (*)(void))dlsym(RTLD_DEFAULT, "omp_get_num_threads");
    job j = {p, m, v, g, n};
    if (!parallel || !thread_num || !num_threads || threads < 2) {
        slice(&j, 0, n);
        return 1;
    }
    parallel(member, &j, (unsigned)threads, 0);
    return threads;
}
