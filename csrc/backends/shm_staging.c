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

int fs_stage_pick(fs_stage_tuner *t, int k, fs_stage_word w)
{
    const uint32_t n = t->count[k]++;
    const uint32_t every = (uint32_t)FS_STAGE_EXPLORE_EVERY << (w >> 1);
    const int pref = w & 1;
    return n == FS_STAGE_COLD || n % every == every - 1 ? !pref : pref;
}

static fs_stage_word word(int pref, int backoff) { return (fs_stage_word)(pref | backoff << 1); }

fs_stage_word fs_stage_learn(fs_stage_tuner *t, int k, int store, double ns, size_t bytes,
                             fs_stage_word w)
{
    if (t->count[k] <= FS_STAGE_COLD) /* first touches of the slot and the buffers */
        return w;
    const int pref = w & 1;
    int backoff = w >> 1;
    const double x = ns / (double)(bytes ? bytes : 1);
    double *e = &t->est_ns_per_byte[k][store];
    /* The preferred store, timed at every call: a running mean, in which a
     * sample far above it (a descheduled rank, not the store) moves it by a
     * bounded step. The other store, timed once in 16 to 256 calls: its last
     * try alone, since an older one may be from another placement. */
    if (store != pref || *e == 0)
        *e = x;
    else
        *e = 0.75 * *e + 0.25 * (x < 4 * *e ? x : 4 * *e);
    const double mine = t->est_ns_per_byte[k][pref], other = t->est_ns_per_byte[k][!pref];
    if (mine > 0 && other > 0 && other < FS_STAGE_SWITCH_BELOW * mine)
        return word(!pref, 0);
    if (store != pref) { /* a try of the other store */
        t->pref_at_try[k] = mine;
        backoff = other > FS_STAGE_WIDE * mine
                      ? (backoff < FS_STAGE_BACKOFF_MAX ? backoff + 1 : FS_STAGE_BACKOFF_MAX)
                      : 0;
    } else if (backoff && mine > FS_STAGE_WIDE * t->pref_at_try[k]) {
        backoff = 0; /* the preferred store slowed down: try the other soon */
    }
    return word(pref, backoff);
}
