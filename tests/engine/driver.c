/* driver.c - the engine (csrc/engine/) driven without Python.
 *
 * One process per rank, on the shared-memory backend (comm_shm.c) and a host
 * table (engine.h: fs_env) made of malloc and free. Each rank builds one
 * unit of flat float32 groups (layout.c sizes them, copy.c fills the shards),
 * then trains it for a few steps as FSDP would drive it:
 *
 *   PRE_FORWARD -> POST_FORWARD -> PRE_BACKWARD -> POST_BACKWARD (each group,
 *   reducing its gradient into the shard gradient) -> FINALIZE
 *
 * (repeated `accum` times, the later backward passes accumulating), then a
 * plain SGD step on the shard. The "gradient" is computed from the gathered
 * compute buffer, in the compute dtype:
 *
 *   grad[i] = full[i] * (rank + 1 + micro) + i * 1e-3   at parameter elements
 *   grad[i] = 0                                          in the padding
 *
 * every operation rounded to float32 (then to the compute dtype), so that
 * tests/test_engine_driver.py can repeat it with numpy and _C.Unit and
 * compare bytes. At the end each rank gathers the full-precision parameters
 * once more and writes, to `out`: every group's shard, then every group's
 * gathered full buffer (raw little-endian float32); and prints one JSON line
 * on stdout: the actions each event returned and the unit's collective
 * counts.
 *
 * Besides the numbers, the driver checks the engine's contract with its host
 * (engine.h) and exits non-zero naming what broke: every taken handle is
 * released exactly once (none twice, none leaked at fs_unit_destroy), a
 * transient one within the engine call that took it, only tensor handles
 * reach data/set_storage/hold, the persistent shard is never resized, the
 * unsharded storages are empty after each FINALIZE (sharded strategies), and
 * FULL_SHARD gathers the same bytes for backward that forward saw.
 *
 * Arguments are key=value:
 *   rank= world= shm= out=            this rank, the group, the segment
 *                                     (rank 0 creates it, the others attach),
 *                                     the output file
 *   strategy=1|2|3|6                  FULL_SHARD, SHARD_GRAD_OP, NO_SHARD,
 *                                     SHARD_OPTIM (fs_strategy's values)
 *   compute=0|2 reduce=0|2            fs_dtype codes (F32, BF16); the
 *                                     parameters are always F32
 *   steps= accum= lr= align=          optimizer steps, backward passes per
 *                                     step, SGD rate, layout alignment
 *   coalesce=0|1                      1: the groups' gathers in one all-gather
 *                                     and their reductions in a bucket flushed
 *                                     at FINALIZE ([Note: coalesced gathers],
 *                                     [Note: reduction buckets]): the same bytes
 *   slot= timeout=                    shm slot bytes, shm wait timeout (s)
 *   group=3,0,5,17 (repeatable)       one flat group's parameter sizes
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "comm.h"
#include "comm_shm.h"
#include "copy.h"
#include "layout.h"
#include "ledger.h"
#include "unit.h"

#define MAX_GROUPS 8
#define MAX_PARAMS 16
#define MAX_ACTIONS 4096

static int g_rank = -1;

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "driver rank %d: ", g_rank);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

/* ---------------------------------------------------------------------------
 * the host table: handles are hbufs */

enum {
    H_TENSOR = 0x7e45012, /* a tensor (and its storage) the driver owns */
    H_TAKEN = 0x7a4e0a1,  /* memory handed out by take */
    H_DEAD = 0xdead0ff,   /* a taken handle already released */
};

typedef struct hbuf {
    unsigned magic;
    void *data;
    int64_t nbytes;
    int resizable;  /* a storage whose bytes come and go (set_storage) */
    int transient;  /* FS_TAKE_TRANSIENT */
    int holds;      /* extra references (hold) not yet released */
    const char *what;
    struct hbuf *next; /* every taken handle, so that none leaks unseen */
} hbuf;

typedef struct {
    hbuf *taken;           /* taken handles, live or dead (kept to catch double releases) */
    long live_taken;       /* taken and not yet released */
    long live_transient;   /* of which transient */
    long n_take, n_release_taken, n_hold, n_release_held;
    int errors;
} host;

static void host_error(host *h, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "driver rank %d: host table misuse: ", g_rank);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    h->errors++;
}

/* New bytes are not zero (as torch's are not): NaN everywhere, so that a
 * read before a write shows in the results. */
static void poison(void *p, int64_t nbytes)
{
    memset(p, 0xff, (size_t)nbytes);
}

static fs_status env_data(void *ctx, void *tensor, void **ptr)
{
    hbuf *b = tensor;
    if (!b || b->magic != H_TENSOR) {
        host_error(ctx, "data() on a handle that is not a tensor (magic %#x)", b ? b->magic : 0);
        return FS_ERR_HOST;
    }
    *ptr = b->data;
    return FS_OK;
}

/* The host table's rule (hooks/storage.c): the same size is a no-op, anything else
 * drops the bytes and gives fresh (uninitialised) ones. */
static fs_status env_set_storage(void *ctx, void *storage, int64_t nbytes, void **data)
{
    hbuf *b = storage;
    *data = NULL;
    if (!b || b->magic != H_TENSOR) {
        host_error(ctx, "set_storage() on a handle that is not a storage");
        return FS_ERR_HOST;
    }
    if (!b->resizable) {
        host_error(ctx, "set_storage(%lld) on the persistent %s", (long long)nbytes, b->what);
        return FS_ERR_HOST;
    }
    if (nbytes < 0) {
        host_error(ctx, "set_storage(%lld) on %s", (long long)nbytes, b->what);
        return FS_ERR_HOST;
    }
    if (nbytes == b->nbytes) {
        *data = b->data;
        return FS_OK;
    }
    free(b->data);
    b->data = NULL;
    b->nbytes = 0;
    if (nbytes > 0) {
        if (!(b->data = malloc((size_t)nbytes))) {
            host_error(ctx, "out of memory (%lld bytes)", (long long)nbytes);
            return FS_ERR_HOST;
        }
        poison(b->data, nbytes);
        b->nbytes = nbytes;
    }
    *data = b->data;
    return FS_OK;
}

static fs_status env_take(void *ctx, int64_t nbytes, unsigned flags, void **data, void **handle)
{
    host *h = ctx;
    *data = *handle = NULL;
    if (nbytes < 1) {
        host_error(h, "take(%lld): at least one byte is promised", (long long)nbytes);
        return FS_ERR_HOST;
    }
    hbuf *b = calloc(1, sizeof *b);
    void *p = flags & FS_TAKE_ZERO ? calloc(1, (size_t)nbytes) : malloc((size_t)nbytes);
    if (!b || !p) {
        free(b);
        free(p);
        host_error(h, "out of memory (%lld bytes)", (long long)nbytes);
        return FS_ERR_HOST;
    }
    if (!(flags & FS_TAKE_ZERO))
        poison(p, nbytes);
    b->magic = H_TAKEN;
    b->data = p;
    b->nbytes = nbytes;
    b->transient = (flags & FS_TAKE_TRANSIENT) != 0;
    b->what = "taken memory";
    b->next = h->taken;
    h->taken = b;
    h->live_taken++;
    h->live_transient += b->transient;
    h->n_take++;
    *data = p;
    *handle = b;
    return FS_OK;
}

static void env_release(void *ctx, void *handle)
{
    host *h = ctx;
    hbuf *b = handle;
    if (!b) {
        host_error(h, "release(NULL)");
        return;
    }
    switch (b->magic) {
    case H_TAKEN:
        free(b->data);
        b->data = NULL;
        b->magic = H_DEAD; /* the struct stays on the list: a second release is seen */
        h->live_taken--;
        h->live_transient -= b->transient;
        h->n_release_taken++;
        return;
    case H_TENSOR:
        if (b->holds <= 0) {
            host_error(h, "release of %s, which the engine was lent, not given", b->what);
            return;
        }
        b->holds--;
        h->n_release_held++;
        return;
    case H_DEAD:
        host_error(h, "taken memory (%lld bytes) released twice", (long long)b->nbytes);
        return;
    default:
        host_error(h, "release of an unknown handle (magic %#x)", b->magic);
    }
}

static void *env_hold(void *ctx, void *tensor)
{
    host *h = ctx;
    hbuf *b = tensor;
    if (!b || b->magic != H_TENSOR) {
        host_error(h, "hold() on a handle that is not a tensor");
        return NULL;
    }
    b->holds++;
    h->n_hold++;
    return b;
}

static hbuf *tensor(const char *what, int64_t nbytes, int resizable)
{
    hbuf *b = calloc(1, sizeof *b);
    if (!b)
        die("out of memory");
    b->magic = H_TENSOR;
    b->what = what;
    b->resizable = resizable;
    if (nbytes > 0) {
        if (!(b->data = malloc((size_t)nbytes)))
            die("out of memory");
        poison(b->data, nbytes);
        b->nbytes = nbytes;
    }
    return b;
}

static void tensor_free(hbuf *b)
{
    if (!b)
        return;
    free(b->data);
    b->magic = 0;
    free(b);
}

/* ---------------------------------------------------------------------------
 * arguments */

typedef struct {
    int rank, world, strategy, steps, accum, coalesce;
    fs_dtype compute, reduce;
    double lr, timeout;
    int64_t align, slot;
    const char *shm, *out;
    int ngroups;
    int nparams[MAX_GROUPS];
    int64_t numels[MAX_GROUPS][MAX_PARAMS];
} config;

static long long parse_int(const char *key, const char *v)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end)
        die("%s=%s: not an integer", key, v);
    return x;
}

static void parse_args(int argc, char **argv, config *c)
{
    memset(c, 0, sizeof *c);
    c->rank = -1;
    c->strategy = FS_FULL_SHARD;
    c->steps = 3;
    c->accum = 1;
    c->compute = c->reduce = FS_F32;
    c->lr = 0.05;
    c->timeout = 20.0;
    c->align = 4;
    c->slot = 4096;
    int reduce_set = 0;
    for (int i = 1; i < argc; i++) {
        char *eq = strchr(argv[i], '=');
        if (!eq)
            die("argument %s: expected key=value", argv[i]);
        *eq = '\0';
        const char *k = argv[i], *v = eq + 1;
        if (!strcmp(k, "rank")) c->rank = (int)parse_int(k, v);
        else if (!strcmp(k, "world")) c->world = (int)parse_int(k, v);
        else if (!strcmp(k, "shm")) c->shm = v;
        else if (!strcmp(k, "out")) c->out = v;
        else if (!strcmp(k, "strategy")) c->strategy = (int)parse_int(k, v);
        else if (!strcmp(k, "compute")) c->compute = (fs_dtype)parse_int(k, v);
        else if (!strcmp(k, "reduce")) { c->reduce = (fs_dtype)parse_int(k, v); reduce_set = 1; }
        else if (!strcmp(k, "steps")) c->steps = (int)parse_int(k, v);
        else if (!strcmp(k, "accum")) c->accum = (int)parse_int(k, v);
        else if (!strcmp(k, "align")) c->align = parse_int(k, v);
        else if (!strcmp(k, "slot")) c->slot = parse_int(k, v);
        else if (!strcmp(k, "coalesce")) c->coalesce = (int)parse_int(k, v);
        else if (!strcmp(k, "lr")) c->lr = strtod(v, NULL);
        else if (!strcmp(k, "timeout")) c->timeout = strtod(v, NULL);
        else if (!strcmp(k, "group")) {
            if (c->ngroups == MAX_GROUPS)
                die("at most %d groups", MAX_GROUPS);
            int g = c->ngroups++, n = 0;
            char *save = NULL, *buf = (char *)v;
            for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                if (n == MAX_PARAMS)
                    die("at most %d parameters per group", MAX_PARAMS);
                c->numels[g][n++] = parse_int("group", tok);
            }
            c->nparams[g] = n;
        } else {
            die("unknown argument %s", k);
        }
    }
    if (!reduce_set)
        c->reduce = c->compute;
    if (c->world < 1 || c->rank < 0 || c->rank >= c->world || !c->shm || !c->out ||
        c->ngroups < 1 || c->steps < 0 || c->accum < 1)
        die("usage: driver rank=R world=W shm=/name out=FILE group=3,0,5 [group=...] "
            "[strategy=1|2|3|6 compute=0|2 reduce=0|2 steps= accum= lr= align= slot= "
            "timeout=]");
    if ((c->compute != FS_F32 && c->compute != FS_BF16) ||
        (c->reduce != FS_F32 && c->reduce != FS_BF16))
        die("compute and reduce dtypes: 0 (float32) or 2 (bfloat16)");
}

/* ---------------------------------------------------------------------------
 * the shm group: rank 0 creates the segment, the others attach once it is
 * ready (comm_shm.c refuses to map a segment still being made: retry) */

static fs_comm *connect_shm(const config *c, const fs_ledger *ledger)
{
    fs_comm *comm = NULL;
    char err[512] = "";
    if (c->rank == 0) {
        fs_status s = fs_comm_shm_create(c->shm, 0, c->world, (size_t)c->slot, c->timeout,
                                         FS_STAGE_AUTO, 1, ledger, &comm, err, sizeof err);
        if (s != FS_OK)
            die("creating shm segment %s: %s (%s)", c->shm, err, fs_status_str(s));
        return comm;
    }
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        fs_status s = fs_comm_shm_create(c->shm, c->rank, c->world, (size_t)c->slot, c->timeout,
                                         FS_STAGE_AUTO, 0, ledger, &comm, err, sizeof err);
        if (s == FS_OK)
            return comm;
        if (s != FS_ERR_BACKEND) /* not ready yet / not there yet: retry; else give up */
            die("attaching shm segment %s: %s (%s)", c->shm, err, fs_status_str(s));
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - t0.tv_sec) + (now.tv_nsec - t0.tv_nsec) * 1e-9 > c->timeout)
            die("attaching shm segment %s: gave up after %.0f s: %s", c->shm, c->timeout, err);
        struct timespec pause = {0, 5 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
}

/* ---------------------------------------------------------------------------
 * the toy model */

typedef struct {
    int nparams;
    fs_flat_entry entries[MAX_PARAMS];
    fs_flat_layout layout;
    hbuf *shard, *full, *lp;    /* full doubles as its own storage handle, lp too */
    hbuf *grad;                 /* padded_numel of compute: the unsharded gradient */
    hbuf *sgrad;                /* the shard gradient (SHARD_OPTIM: padded_numel) */
    int64_t sgrad_numel;
    void *snapshot;             /* the compute buffer as forward saw it */
} group;

/* Parameter j of group g, element k: multiples of 1/8, exact in float32. */
static float init_value(int g, int j, int64_t k)
{
    return (float)((int)((g * 31 + j * 7 + k) % 9) - 4) * 0.125f;
}

static float load(const void *p, fs_dtype t, int64_t i)
{
    return t == FS_BF16 ? fs_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void store(void *p, fs_dtype t, int64_t i, float v)
{
    if (t == FS_BF16)
        ((uint16_t *)p)[i] = fs_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static int in_param(const group *gr, int64_t i)
{
    for (int j = 0; j < gr->nparams; j++)
        if (i >= gr->entries[j].flat_offset &&
            i < gr->entries[j].flat_offset + gr->entries[j].numel)
            return 1;
    return 0;
}

typedef struct {
    host h;
    fs_unit u;
    int sharded; /* the unsharded buffers are freed between uses */
    int coalesce; /* the groups' gathers in one all-gather, reductions in a bucket */
    fs_reduce_bucket bucket;
    unsigned actions[MAX_ACTIONS];
    int nactions;
} driver;

static void check(driver *d, fs_status s, const char *what)
{
    if (d->h.errors)
        die("%s: the host table was misused (above)", what);
    if (s != FS_OK)
        die("%s: %s: %s [%s, group %d%s]", what, fs_status_str(s), d->u.core.err,
            d->u.core.err_what ? d->u.core.err_what : "-", d->u.core.err_group,
            d->u.core.err_collective ? ", collective" : "");
    if (d->h.live_transient)
        die("%s: %ld transient buffer(s) still taken after the call", what, d->h.live_transient);
}

/* flatshard._C.Unit.event (csrc/glue/py_unit.c): the engine's fs_unit_dispatch,
 * after the root's bucket flush at the end of backward (fsdp/api.py). */
static unsigned event(driver *d, fs_event ev, unsigned flags, int gi, hbuf *grad, hbuf *out,
                      int accumulate)
{
    fs_unit *u = &d->u;
    unsigned act = 0;
    fs_status s = FS_OK;
    if (ev == FS_EV_FINALIZE && d->bucket.nparts) { /* the root's flush (fsdp/api.py) */
        int failed;
        for (int i = 0; i < d->bucket.nparts; i++)
            if (!fs_group_owns_part(&u->core, &d->bucket, i))
                die("the bucket's part %d is not the unit's", i);
        s = fs_group_flush_bucket(&d->bucket, &u->core, &failed);
    }
    if (s == FS_OK) {
        const fs_unit_event_work w = {flags, gi, grad, out, accumulate, 0,
                                      d->coalesce ? &d->bucket : NULL, NULL, 0, d->coalesce};
        int failed;
        s = fs_unit_dispatch(u, ev, &w, &act, &failed);
    }
    char what[64];
    snprintf(what, sizeof what, "event %s (group %d)", fs_event_name(ev), gi);
    check(d, s, what);
    if (d->nactions == MAX_ACTIONS)
        die("too many events");
    d->actions[d->nactions++] = act;
    return act;
}

static void *compute_data(group *gr)
{
    return gr->lp ? gr->lp->data : gr->full->data;
}

int main(int argc, char **argv)
{
    config cfg;
    parse_args(argc, argv, &cfg);
    g_rank = cfg.rank;
    static driver dv; /* fs_unit is large-ish; keep it off the stack */
    driver *d = &dv;
    const int world = cfg.world, rank = cfg.rank;
    const int no_shard = cfg.strategy == FS_NO_SHARD;
    const int optim = cfg.strategy == FS_SHARD_OPTIM;
    const int mixed = cfg.compute != FS_F32;
    d->sharded = cfg.strategy == FS_FULL_SHARD || cfg.strategy == FS_SHARD_GRAD_OP;
    d->coalesce = cfg.coalesce;
    const size_t cs = fs_dtype_size(cfg.compute);

    static fs_ledger ledger;
    fs_ledger_init(&ledger);
    fs_comm *comm = connect_shm(&cfg, &ledger);

    /* Layout and shards, as fsdp/flat_param.py makes them: NO_SHARD lays
     * every group out for one rank (nothing is sharded). */
    group groups[MAX_GROUPS];
    fs_unit_group ug[MAX_GROUPS];
    memset(groups, 0, sizeof groups);
    memset(ug, 0, sizeof ug);
    for (int g = 0; g < cfg.ngroups; g++) {
        group *gr = &groups[g];
        gr->nparams = cfg.nparams[g];
        fs_status s = fs_layout_flat(cfg.numels[g], gr->nparams, no_shard ? 1 : world,
                                     no_shard ? 0 : rank, cfg.align, gr->entries, &gr->layout);
        if (s != FS_OK)
            die("fs_layout_flat (group %d): %s", g, fs_status_str(s));
        const int64_t sn = gr->layout.shard_numel, pn = gr->layout.padded_numel;
        gr->shard = tensor("shard", sn * 4, 0);
        fs_piece pieces[MAX_PARAMS];
        float *params[MAX_PARAMS];
        int np = 0;
        for (int j = 0; j < gr->nparams; j++) {
            const fs_flat_entry *e = &gr->entries[j];
            params[j] = malloc((size_t)(e->numel ? e->numel : 1) * 4);
            if (!params[j])
                die("out of memory");
            for (int64_t k = 0; k < e->numel; k++)
                params[j][k] = init_value(g, j, k);
            if (e->piece_numel > 0)
                pieces[np++] = (fs_piece){params[j], FS_F32, e->param_offset, e->shard_offset,
                                          e->piece_numel};
        }
        if ((s = fs_gather_pieces(gr->shard->data, FS_F32, sn, pieces, np)) != FS_OK)
            die("fs_gather_pieces (group %d): %s", g, fs_status_str(s));
        for (int j = 0; j < gr->nparams; j++)
            free(params[j]);
        /* The unsharded buffers start with no bytes; NO_SHARD's full buffer
         * is the shard itself. */
        gr->full = no_shard ? gr->shard : tensor("full", 0, 1);
        gr->lp = mixed ? tensor("lp", 0, 1) : NULL;
        gr->grad = tensor("grad", pn * (int64_t)cs, 0);
        gr->sgrad_numel = optim ? pn : sn;
        gr->sgrad = tensor("shard grad", gr->sgrad_numel * 4, 0);
        if (!(gr->snapshot = malloc((size_t)(pn ? pn : 1) * cs)))
            die("out of memory");
        ug[g] = (fs_unit_group){
            .shard = gr->shard, .full = gr->full, .storage = gr->full,
            .lp = gr->lp, .lp_storage = gr->lp,
            .shard_numel = sn, .padded_numel = pn,
            .dtype = FS_F32, .compute = cfg.compute, .reduce = cfg.reduce,
        };
    }

    fs_env env = {&d->h, env_data, env_set_storage, env_take, env_release, env_hold};
    /* no lock to hand back around collectives: a program without an interpreter */
    fs_link link = {.comm = comm, .ledger = &ledger}, none = {0};
    uint64_t mask = cfg.ngroups >= 64 ? ~0ull : (1ull << cfg.ngroups) - 1;
    fs_status s = fs_unit_init(&d->u, "driver.unit", env, link, none,
                               (fs_strategy)cfg.strategy, mask, ug, cfg.ngroups, 0);
    check(d, s, "fs_unit_init");

    /* SHARD_OPTIM: gathered once and kept whole (zero1.py does this). */
    if (optim)
        check(d, fs_unit_unshard(&d->u, 0, 0), "first unshard");

    const float lr = (float)cfg.lr;
    for (int step = 0; step < cfg.steps; step++) {
        for (int m = 0; m < cfg.accum; m++) {
            event(d, FS_EV_PRE_FORWARD, FS_FLAG_GRAD_ENABLED, -1, NULL, NULL, 0);
            for (int g = 0; g < cfg.ngroups; g++) { /* forward reads the compute buffer */
                group *gr = &groups[g];
                memcpy(gr->snapshot, compute_data(gr), (size_t)gr->layout.padded_numel * cs);
            }
            event(d, FS_EV_POST_FORWARD, FS_FLAG_GRAD_ENABLED, -1, NULL, NULL, 0);
            if (cfg.strategy == FS_FULL_SHARD) /* ZeRO-3 frees right after forward */
                for (int g = 0; g < cfg.ngroups; g++)
                    if (groups[g].full->nbytes || (groups[g].lp && groups[g].lp->nbytes))
                        die("FULL_SHARD: group %d's unsharded storage kept its bytes after "
                            "forward", g);
            event(d, FS_EV_PRE_BACKWARD, 0, -1, NULL, NULL, 0);
            const float mult = (float)(rank + 1 + m), step_i = (float)1e-3;
            for (int g = 0; g < cfg.ngroups; g++) {
                group *gr = &groups[g];
                const int64_t pn = gr->layout.padded_numel;
                const void *x = compute_data(gr);
                if (pn && memcmp(x, gr->snapshot, (size_t)pn * cs) != 0)
                    die("group %d: backward gathered other bytes than forward saw", g);
                for (int64_t i = 0; i < pn; i++) {
                    float v = 0.0f;
                    if (in_param(gr, i)) {
                        float a = load(x, cfg.compute, i) * mult;
                        float b = (float)i * step_i;
                        v = a + b;
                    }
                    store(gr->grad->data, cfg.compute, i, v);
                }
            }
            for (int g = 0; g < cfg.ngroups; g++)
                event(d, FS_EV_POST_BACKWARD, 0, g, groups[g].grad, groups[g].sgrad, m > 0);
            event(d, FS_EV_FINALIZE, 0, -1, NULL, NULL, 0);
            for (int g = 0; g < cfg.ngroups; g++) {
                group *gr = &groups[g];
                /* NO_SHARD frees only its compute-dtype cast (full is the shard). */
                if ((d->sharded && gr->full->nbytes) || (!optim && gr->lp && gr->lp->nbytes))
                    die("group %d: unsharded storage still has bytes after FINALIZE", g);
            }
        }
        /* SGD on this rank's shard (SHARD_OPTIM: its slice of the whole gradient). */
        for (int g = 0; g < cfg.ngroups; g++) {
            group *gr = &groups[g];
            float *p = gr->shard->data;
            const float *gp = gr->sgrad->data;
            if (optim)
                gp += (int64_t)rank * gr->layout.shard_numel;
            for (int64_t k = 0; k < gr->layout.shard_numel; k++) {
                float t = lr * gp[k];
                p[k] = p[k] - t;
            }
        }
        if (optim)
            check(d, fs_unit_regather(&d->u), "regather");
    }

    /* The full-precision parameters, gathered once more (summon). */
    check(d, fs_unit_unshard(&d->u, 1, 0), "final unshard");
    FILE *f = fopen(cfg.out, "wb");
    if (!f)
        die("cannot write %s: %s", cfg.out, strerror(errno));
    for (int g = 0; g < cfg.ngroups; g++)
        if (fwrite(groups[g].shard->data, 4, (size_t)groups[g].layout.shard_numel, f) !=
            (size_t)groups[g].layout.shard_numel)
            die("writing %s", cfg.out);
    for (int g = 0; g < cfg.ngroups; g++) {
        group *gr = &groups[g];
        const int64_t pn = gr->layout.padded_numel;
        if (pn && (!gr->full->data || gr->full->nbytes < pn * 4))
            die("group %d: the final unshard left the full buffer without bytes", g);
        if (fwrite(gr->full->data, 4, (size_t)pn, f) != (size_t)pn)
            die("writing %s", cfg.out);
    }
    if (fclose(f) != 0)
        die("writing %s: %s", cfg.out, strerror(errno));
    check(d, fs_unit_reshard(&d->u), "final reshard");

    unsigned long long n_gather = d->u.core.n_all_gather, n_reduce = d->u.core.n_reduce;
    fs_unit_destroy(&d->u);
    if (d->h.errors)
        die("the host table was misused (above)");
    if (d->h.live_taken)
        die("%ld taken buffer(s) never released (of %ld taken)", d->h.live_taken, d->h.n_take);
    for (int g = 0; g < cfg.ngroups; g++)
        if (groups[g].grad->holds || groups[g].sgrad->holds)
            die("group %d: a gradient is still held after fs_unit_destroy", g);

    printf("{\"rank\": %d, \"all_gather\": %llu, \"reduce\": %llu, \"taken\": %ld, "
           "\"held\": %ld, \"ledger\": %llu, \"actions\": [",
           rank, n_gather, n_reduce, d->h.n_take, d->h.n_hold, (unsigned long long)ledger.count);
    for (int i = 0; i < d->nactions; i++)
        printf("%s%u", i ? ", " : "", d->actions[i]);
    printf("]}\n");

    fs_comm_destroy(comm);
    for (hbuf *b = d->h.taken, *next; b; b = next) {
        next = b->next;
        free(b);
    }
    for (int g = 0; g < cfg.ngroups; g++) {
        group *gr = &groups[g];
        if (gr->full != gr->shard)
            tensor_free(gr->full);
        tensor_free(gr->shard);
        tensor_free(gr->lp);
        tensor_free(gr->grad);
        tensor_free(gr->sgrad);
        free(gr->snapshot);
    }
    return 0;
}
