/* shm_staging.c - the staging store's choice ([Note: staging stores],
 * shm_staging.h). */
#include "shm_staging.h"

int fs_stage_class(int op, size_t bytes)
{
    int lg = 0;
    while (lg < 63 && ((size_t)1 << (lg + 1)) <= bytes)
        lg++;
    int size = lg - 12;
    size = size < 0 ? 0 : size >= FS_STAGE_SIZES ? FS_STAGE_SIZES - 1 : size;
    op = op < 0 ? 0 : op >= FS_STAGE_OPS ? FS_STAGE_OPS - 1 : op;
    return op * FS_STAGE_SIZES + size;
}

int fs_stage_pick(fs_stage_tuner *t, int k, int pref)
{
    const uint32_t n = t->count[k]++;
    const int explore = n == FS_STAGE_COLD || n % FS_STAGE_EXPLORE_EVERY == FS_STAGE_EXPLORE_EVERY - 1;
    return explore ? !pref : pref;
}

int fs_stage_learn(fs_stage_tuner *t, int k, int store, double ns, size_t bytes, int pref)
{
    if (t->count[k] <= FS_STAGE_COLD) /* first touches of the slot and the buffers */
        return pref;
    const double x = ns / (double)(bytes ? bytes : 1);
    double *e = &t->est_ns_per_byte[k][store];
    /* A sample far above the estimate is a descheduled rank, not the
     * store: it moves the estimate by at most a bounded step. */
    *e = *e == 0 ? x : 0.75 * *e + 0.25 * (x < 4 * *e ? x : 4 * *e);
    const double mine = t->est_ns_per_byte[k][pref], other = t->est_ns_per_byte[k][!pref];
    return mine > 0 && other > 0 && other < FS_STAGE_SWITCH_BELOW * mine ? !pref : pref;
}
