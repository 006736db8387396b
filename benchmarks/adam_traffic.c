/* adam_traffic.c - the memory traffic of an fp32 AdamW step without its
 * math, for bench_optim.py: read param, grad, exp_avg and exp_avg_sq, write
 * param, exp_avg and exp_avg_sq (28 bytes per element), each thread of the
 * OpenMP team its contiguous slice, as the step's own loops split it. No
 * optimizer moves these bytes faster than this loop does on the same
 * machine at the same moment: it is the step's speed limit, measured.
 *
 *   cc -O3 -march=native -fopenmp -shared -fPIC -o adam_traffic.so adam_traffic.c */
#include <omp.h>
#include <stdint.h>

void adam_traffic(float *restrict p, const float *restrict g, float *restrict m,
                  float *restrict v, int64_t n, int threads)
{
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t lo = n * t / nt / 16 * 16, hi = t == nt - 1 ? n : n * (t + 1) / nt / 16 * 16;
        for (int64_t i = lo; i < hi; i++) {
            const float x = g[i];
            p[i] += x;
            m[i] += x;
            v[i] += x;
        }
    }
}
