/* comm_shm.c - collective backend for ranks on one host, through one
 * POSIX shared-memory segment.
 *
 * Segment: a header (barrier words, abort flag and message),
 * one control block per rank (pid, chunk counts, current collective), then
 * one staging slot per rank, cut into NSECT sections that successive chunks
 * use in turn *across* collectives. A collective's first chunk is one
 * barrier (which also checks that every rank is in the same collective);
 * its later chunks need none: each rank publishes how many chunks it has
 * staged and how many it has finished reading, and waits only for the
 * counts it needs ([Note: chunk pipeline]). So a collective of one chunk is
 * one hand-off between the ranks, the least a collective can cost, and a
 * large one lets a rank run up to NSECT - 1 chunks ahead of a peer that is
 * descheduled, instead of stopping at every chunk.
 *
 * Speed: every rank copies at once (into its slot, then out of its peers'
 * slots); outputs larger than the cache are written with streaming stores
 * ([Note: streaming stores]), so that a large collective runs at the
 * memory's speed (benchmarks/bench_comm.py measures it against memcpy in the
 * same run). The slots themselves are written with plain or streaming
 * stores, whichever the group measures faster where its ranks' CPUs lie
 * ([Note: staging stores], shm_staging.h).
 *
 * Lifetime: rank 0 creates the segment under a unique name that the Python
 * layer passes to the others through the process group; the last rank to map
 * it unlinks the name at once. From then on the segment lives only as long
 * as some rank maps it, so a crash of any rank can never leak it in /dev/shm.
 * Before then, the set-up removes the name on every rank's way out
 * (python/flatshard/runtime/comm.py, [Note: shm set-up]).
 *
 * Waiting: a short spin, then futex waits in slices (no core burnt: tests
 * run 4 ranks on 2 cores). Between slices a waiter checks the shared abort
 * flag, whether the ranks it waits for are still alive, and its deadline.
 * Any failure sets the abort flag with a message, so every other rank fails
 * fast with the same cause instead of waiting out its own timeout.
 *
 * Desync: at each collective a rank publishes what it is (its Comm ledger's
 * newest entry: sequence number, op, unit, size, dtype) in its control
 * block; after the collective's first barrier every rank checks that all
 * ranks are in the same one, before any data is read. A rank that skipped
 * or added a collective (a data-dependent branch around a wrapped module)
 * fails there, naming both sides, instead of mixing data or hanging later.
 *
 * Buffer rules are those of comm.h. Reductions accumulate in f32 (reduce.c).
 * Linux only (futex, /proc); other systems use the torch backend.
 */
#define _GNU_SOURCE
#include "comm_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ledger.h"
#include "reduce.h"
#include "shm_staging.h"
#include "stream_copy.h"

#define SHM_MAGIC 0x35304D4853534655ULL /* "UFSSHM05" */
#define SPIN_ITERS 256
/* Sections per slot: how far (NSECT - 1 chunks) a rank may run ahead of the
 * slowest reader of its slot ([Note: chunk pipeline]). */
#define NSECT FS_SHM_SECTIONS
/* [Note: spin before sleeping] A rank that reaches a barrier first spins
 * this long before it sleeps on the futex, when every rank of the segment
 * can have a CPU of its own: waking from a futex costs tens of
 * microseconds (more under a hypervisor), which for small units is more
 * than the unit's compute, and ranks usually arrive within microseconds
 * of each other. The spin yields between its checks: a late peer waiting
 * for this CPU gets it at once (measured on a 2-CPU host at load 11-13: the
 * median 1 MiB all-gather of 2 ranks went from 2.7-3.1 to 8.8-29.6 GB/s),
 * and on an idle host the yield returns at once. With more ranks than CPUs
 * the peer that is late is most often the one sharing this CPU: then the
 * spin yields after every few checks (SPIN_ITERS_SHARED) rather than
 * sleeping at once, since a futex sleep there leaves the CPU idle whenever
 * its other rank is itself waiting, and the wake-up is a cross-CPU
 * interrupt. (Measured only together with [Note: chunk pipeline]: 4 ranks
 * on 2 CPUs, benchmarks/results/comm.md, "The shm backend's chunk
 * pipeline".) */
#define SPIN_NS (200 * 1000)
#define SPIN_ITERS_SHARED 4
#define SLICE_NS (20 * 1000 * 1000) /* futex slice: how often liveness is checked */

enum { OP_NONE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_REDUCE, OP_BROADCAST, OP_BARRIER,
       OP_ALL_TO_ALL };
static const char *op_names[] = {"none", "all_gather", "reduce_scatter", "all_reduce",
                                 "broadcast", "barrier", "all_to_all"};

typedef struct {
    _Atomic uint64_t magic; /* written last by the creator */
    uint32_t world_size;
    uint32_t pad0;
    uint64_t slot_bytes;
    _Atomic uint32_t attached;
    _Atomic uint32_t aborted;
    char abort_msg[512];
    uint32_t abort_kind; /* fs_fail_kind, written with the message */
    alignas(64) _Atomic uint32_t arrive;
    alignas(64) _Atomic uint32_t generation; /* futex word: barriers completed */
    _Atomic uint32_t sleepers;               /* ranks in futex_wait on it */
    /* Each class's staging store and how often the other is tried, as rank
     * 0 measured them ([Note: staging stores]): an fs_stage_word. */
    _Atomic uint8_t stage_choice[FS_STAGE_CLASSES];
} shm_header;

/* What a rank's collective is, as the other ranks see it. */
typedef struct {
    uint64_t seq;          /* this backend's collective count */
    uint32_t op;           /* OP_* */
    fs_ledger_entry entry; /* the ledger's record of it (entry.seq 0: no ledger) */
} shm_desc;

typedef struct {
    alignas(64) _Atomic int32_t pid;
    _Atomic uint32_t entered; /* barriers this rank has entered */
    _Atomic uint32_t op;      /* collective it is in (OP_*) */
    _Atomic uint64_t seq;     /* its collective count */
    /* [Note: chunk pipeline] Chunks, counted across collectives (mod 2^32),
     * that this rank has written into its slot / finished reading from its
     * peers'. Each is a futex word: a waiter sleeps on the one count it
     * needs, and only its own publisher wakes it. */
    alignas(64) _Atomic uint32_t staged;
    _Atomic uint32_t staged_sleepers;
    alignas(64) _Atomic uint32_t consumed;
    _Atomic uint32_t consumed_sleepers;
    /* Collective `seq` is at desc[seq & 1]: a rank can be one collective
     * ahead of a slow reader but not two (it would need the reader at the
     * next barrier), so the slot being read is never rewritten meanwhile. */
    shm_desc desc[2];
} shm_rank;

typedef struct {
    shm_header *hdr;
    shm_rank *ranks;
    char *slots; /* world_size * slot_bytes */
    size_t map_bytes;
    uint64_t sect_bytes; /* slot_bytes / NSECT */
    size_t chunk_cap;    /* at most sect_bytes: [Note: chunk size] */
    size_t stream_above; /* outputs larger are streamed: [Note: streaming stores] */
    uint64_t chunk_counter; /* chunks begun, across collectives: picks the section */
    uint64_t seq;
    double timeout_s;
    fs_simd simd;
    const void **srcs; /* world_size scratch pointers for reductions */
    const fs_ledger *ledger; /* the Comm's, or NULL */
    int check_pending;       /* the collective's first barrier is still to come */
    int64_t spin_ns;         /* [Note: spin before sleeping] */
    int spin_iters;          /* checks between yields */
    /* [Note: staging stores] */
    fs_stage_policy staging;
    fs_stage_tuner tuner;    /* every rank counts; rank 0 alone measures */
    int stage_class;         /* the current collective's, or -1 */
    int store;               /* the current collective's FS_STORE_* */
    size_t stage_bytes;      /* the current collective's size, for its class */
    double t_enter, t_wait0; /* its start, and its first barrier's wait */
    uint64_t stores_used[2]; /* collectives staged with each store */
} shm_impl;

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static size_t header_bytes(int world)
{
    return align_up(sizeof(shm_header), 64) + align_up((size_t)world * sizeof(shm_rank), 4096);
}

/* CPUs this process may run on (its affinity mask; the online count if
 * that cannot be read). */
static int cpus_allowed(void)
{
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0)
        return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* Bytes of the data cache at `level` (2, 3) of CPU 0: sysfs first (what the
 * kernel was told, right in a virtual machine, where the C library's CPUID
 * figure can be the whole host's: 384 MiB of L3 for a guest whose CPUs share
 * 32 MiB), the C library's otherwise; 0 when neither says. */
static size_t cache_bytes(int level)
{
    for (int i = 0; i < 8; i++) {
        char path[96], buf[32];
        int lvl = 0;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
        FILE *f = fopen(path, "r");
        if (!f)
            break;
        if (fscanf(f, "%d", &lvl) != 1)
            lvl = 0;
        fclose(f);
        if (lvl != level)
            continue;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        f = fopen(path, "r");
        if (!f)
            break;
        size_t kib = 0;
        if (fgets(buf, sizeof buf, f))
            kib = (size_t)strtoul(buf, NULL, 10); /* "1024K" */
        fclose(f);
        if (kib)
            return kib << 10;
    }
#ifdef _SC_LEVEL2_CACHE_SIZE
    long v = sysconf(level == 2 ? _SC_LEVEL2_CACHE_SIZE : _SC_LEVEL3_CACHE_SIZE);
    if (v > 0)
        return (size_t)v;
#endif
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A pid that exists and is not a zombie. Ranks are siblings, not parent
 * and child, so a dead rank may linger as a zombie until its parent reaps. */
static int pid_alive(int32_t pid)
{
    if (pid <= 0)
        return 1; /* not attached yet: the deadline decides */
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* state follows the command name */
    return !(p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'));
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val)
{
    struct timespec ts = {0, SLICE_NS};
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

/* Record the cause for every rank (first writer wins) and fail. */
static fs_status shm_abort(fs_comm *c, fs_fail_kind kind, const char *msg)
{
    shm_impl *s = c->impl;
    uint32_t expected = 0;
    if (atomic_compare_exchange_strong(&s->hdr->aborted, &expected, 1u)) {
        snprintf(s->hdr->abort_msg, sizeof s->hdr->abort_msg, "%s", msg);
        s->hdr->abort_kind = (uint32_t)kind;
        atomic_thread_fence(memory_order_seq_cst);
        atomic_store(&s->hdr->aborted, 2u); /* message complete */
        futex_wake_all(&s->hdr->generation);
        for (int r = 0; r < c->world_size; r++) { /* [Note: chunk pipeline]'s sleepers */
            futex_wake_all(&s->ranks[r].staged);
            futex_wake_all(&s->ranks[r].consumed);
        }
    }
    snprintf(c->last_error, sizeof c->last_error, "%s", msg);
    c->last_fail = kind;
    return FS_ERR_BACKEND;
}

static fs_status aborted_elsewhere(fs_comm *c)
{
    shm_impl *s = c->impl;
    while (atomic_load(&s->hdr->aborted) == 1u)
        cpu_relax(); /* the writer is finishing its message */
    snprintf(c->last_error, sizeof c->last_error, "shm group aborted: %s", s->hdr->abort_msg);
    c->last_fail = (fs_fail_kind)s->hdr->abort_kind;
    return FS_ERR_BACKEND;
}

/* Rank r's current (or last) collective: "all_gather #41 for 'blocks.3'
 * (1.5 KiB float32)" from its ledger entry, else the backend's own count. */
static void describe(shm_impl *s, int r, char *buf, size_t cap)
{
    shm_rank *k = &s->ranks[r];
    shm_desc d = k->desc[atomic_load(&k->seq) & 1]; /* a copy: it may change under us */
    if (d.entry.seq)
        fs_ledger_format(&d.entry, 0, buf, cap);
    else
        snprintf(buf, cap, "%s #%llu", op_names[d.op <= OP_ALL_TO_ALL ? d.op : OP_NONE],
                 (unsigned long long)d.seq);
}

/* "rank r (pid p) died" or "... has not arrived" appended to msg (cap
 * bytes, *len written so far); whether what it is in may follow (alive,
 * room left). */
static int append_late(char *msg, size_t cap, int *len, int r, int32_t pid, int dead)
{
    *len += snprintf(msg + *len, (size_t)*len < cap ? cap - (size_t)*len : 0,
                     "%srank %d (pid %d) %s", *len ? "; " : "", r, pid,
                     dead ? "died" : "has not arrived");
    return !dead && (size_t)*len < cap;
}

/* A wait that failed, with the late ranks' words (found: any), as the
 * group's abort. */
static fs_status fail_waiting(fs_comm *c, int dead_only, int found, int any_dead,
                              const char *msg)
{
    char full[512], what[160];
    describe(c->impl, c->rank, what, sizeof what);
    snprintf(full, sizeof full, "rank %d waiting in %s%s: %s", c->rank, what,
             dead_only ? "" : " timed out", found ? msg : "no rank identified");
    return shm_abort(c, !found ? FS_FAIL_OTHER : any_dead ? FS_FAIL_DEAD : FS_FAIL_ABSENT, full);
}

/* Why the barrier `gen` is not complete: the ranks that have not entered it. */
static fs_status report_stuck(fs_comm *c, uint32_t gen, int dead_only)
{
    shm_impl *s = c->impl;
    char msg[480], what[160];
    int len = 0, found = 0, any_dead = 0;
    for (int r = 0; r < c->world_size; r++) {
        shm_rank *k = &s->ranks[r];
        int32_t pid = atomic_load(&k->pid);
        int dead = !pid_alive(pid);
        if ((int32_t)(atomic_load(&k->entered) - (gen + 1)) >= 0 && !dead)
            continue; /* it arrived */
        if (dead_only && !dead)
            continue;
        found = 1;
        any_dead |= dead;
        if (append_late(msg, sizeof msg, &len, r, pid, dead)) {
            describe(s, r, what, sizeof what);
            len += snprintf(msg + len, sizeof msg - len, atomic_load(&k->op) != OP_NONE
                            ? ", it is in %s" : ", it is in no collective (its last: %s)", what);
        }
    }
    if (dead_only && !found)
        return FS_OK;
    return fail_waiting(c, dead_only, found, any_dead, msg);
}

static int same_collective(const shm_desc *a, const shm_desc *b)
{
    return a->seq == b->seq && a->op == b->op && a->entry.seq == b->entry.seq &&
           a->entry.op == b->entry.op && a->entry.bytes == b->entry.bytes &&
           a->entry.dtype == b->entry.dtype &&
           strncmp(a->entry.unit, b->entry.unit, FS_LEDGER_UNIT) == 0;
}

/* After the first barrier of a collective: is every rank in this one? */
static fs_status check_peers(fs_comm *c)
{
    shm_impl *s = c->impl;
    const shm_desc *mine = &s->ranks[c->rank].desc[s->seq & 1];
    for (int r = 0; r < c->world_size; r++) {
        if (r == c->rank || same_collective(mine, &s->ranks[r].desc[s->seq & 1]))
            continue;
        /* Lower rank first: both sides of the pair write the same words. */
        int lo = r < c->rank ? r : c->rank, hi = r < c->rank ? c->rank : r;
        char a[160], b[160], msg[512];
        describe(s, lo, a, sizeof a);
        describe(s, hi, b, sizeof b);
        const shm_desc *other = &s->ranks[r].desc[s->seq & 1];
        if (other->entry.seq == mine->entry.seq && other->entry.op == mine->entry.op &&
            strncmp(other->entry.unit, mine->entry.unit, FS_LEDGER_UNIT) == 0)
            /* the same collective of the same unit, another size: not a skipped
             * collective but a unit whose parameters differ between the ranks */
            snprintf(msg, sizeof msg, "ranks disagree on the size of one collective: rank %d "
                     "is in %s while rank %d is in %s; that unit's parameters differ between "
                     "the ranks (a model built or loaded differently on one rank?): every "
                     "rank must wrap the same model", lo, a, hi, b);
        else
            snprintf(msg, sizeof msg, "ranks are in different collectives: rank %d is in %s "
                     "while rank %d is in %s; a rank skipped or added a collective (a "
                     "data-dependent branch around a wrapped module?): every rank must run "
                     "the same wrapped modules in the same order", lo, a, hi, b);
        return shm_abort(c, FS_FAIL_DESYNC, msg);
    }
    return FS_OK;
}

static fs_status rendezvous(fs_comm *c)
{
    shm_impl *s = c->impl;
    shm_header *h = s->hdr;
    if (atomic_load(&h->aborted))
        return aborted_elsewhere(c);
    uint32_t gen = atomic_load_explicit(&h->generation, memory_order_acquire);
    atomic_store(&s->ranks[c->rank].entered, gen + 1);
    if (atomic_fetch_add_explicit(&h->arrive, 1, memory_order_acq_rel) ==
        (uint32_t)c->world_size - 1) {
        atomic_store_explicit(&h->arrive, 0, memory_order_relaxed);
        atomic_store(&h->generation, gen + 1);
        if (atomic_load(&h->sleepers)) /* seq_cst against the sleeper's count and check */
            futex_wake_all(&h->generation);
        return FS_OK;
    }
    { /* [Note: spin before sleeping] */
        const double until = now_s() + s->spin_ns * 1e-9;
        do {
            for (int i = 0; i < s->spin_iters; i++) {
                if (atomic_load_explicit(&h->generation, memory_order_acquire) != gen)
                    return FS_OK;
                cpu_relax();
            }
            sched_yield(); /* a peer waiting for this CPU */
        } while (now_s() < until);
    }
    double deadline = now_s() + s->timeout_s;
    while (atomic_load_explicit(&h->generation, memory_order_acquire) == gen) {
        if (atomic_load(&h->aborted))
            return aborted_elsewhere(c);
        atomic_fetch_add(&h->sleepers, 1);
        if (atomic_load(&h->generation) == gen)
            futex_wait(&h->generation, gen);
        atomic_fetch_sub(&h->sleepers, 1);
        if (atomic_load_explicit(&h->generation, memory_order_acquire) != gen)
            break;
        fs_status st = report_stuck(c, gen, 1); /* a dead rank: fail now */
        if (st != FS_OK)
            return st;
        if (now_s() > deadline)
            return report_stuck(c, gen, 0);
    }
    return FS_OK;
}

/* ---------------------------------------------------------------------------
 * [Note: chunk pipeline] Chunk g (counted across collectives, the same on
 * every rank) uses section g % NSECT of every slot. Rank r, for chunk g:
 *   1. waits until every rank that reads its slot has consumed chunk
 *      g - NSECT (the last one in that section): consumed >= g - NSECT + 1;
 *   2. writes the section and publishes staged = g + 1;
 *   3. waits for staged >= g + 1 of each peer it reads (the collective's
 *      first chunk: the barrier instead, which also checks that every rank
 *      is in this collective before anything is read);
 *   4. reads, and publishes consumed = g + 1.
 * A rank that writes nothing in a chunk (a broadcast's receivers) still
 * publishes staged, so that one count per rank says how far it got. Counts
 * only grow, so a rank is never more than NSECT - 1 chunks ahead of the
 * slowest reader of its slot, and a section is never rewritten while read.
 * A fast rank can be at most one collective ahead of a slow one (the next
 * collective's first chunk is a barrier): the collective descriptors'
 * parity rule (shm_rank.desc) still holds. Barriers and counts are
 * separate words; a collective may mix both, since every chunk's section is
 * guarded by the counts whatever guarded the chunk before. Counts are 32
 * bits and compared by their difference: ranks are never 2^31 chunks
 * apart. */

enum { COUNT_STAGED, COUNT_CONSUMED };

static _Atomic uint32_t *count_word(shm_impl *s, int r, int which)
{
    return which == COUNT_STAGED ? &s->ranks[r].staged : &s->ranks[r].consumed;
}

static _Atomic uint32_t *sleepers_word(shm_impl *s, int r, int which)
{
    return which == COUNT_STAGED ? &s->ranks[r].staged_sleepers : &s->ranks[r].consumed_sleepers;
}

static uint32_t count_of(shm_impl *s, int r, int which)
{
    return atomic_load_explicit(count_word(s, r, which), memory_order_acquire);
}

static int count_ok(uint32_t count, uint32_t need) { return (int32_t)(count - need) >= 0; }

/* The first rank behind `need`: rank `only`, or with -1 any rank but this
 * one; -1 when none is. */
static int first_behind(fs_comm *c, int which, uint32_t need, int only)
{
    shm_impl *s = c->impl;
    if (only >= 0)
        return count_ok(count_of(s, only, which), need) ? -1 : only;
    for (int r = 0; r < c->world_size; r++)
        if (r != c->rank && !count_ok(count_of(s, r, which), need))
            return r;
    return -1;
}

static void publish(fs_comm *c, int which, uint32_t value)
{
    shm_impl *s = c->impl;
    atomic_store(count_word(s, c->rank, which), value);
    if (atomic_load(sleepers_word(s, c->rank, which))) /* seq_cst against the waiter's */
        futex_wake_all(count_word(s, c->rank, which));
}

/* Why the counts are not there: the ranks behind (report_stuck's words). */
static fs_status report_behind(fs_comm *c, int which, uint32_t need, int only, int dead_only)
{
    shm_impl *s = c->impl;
    char msg[480], what[160];
    int len = 0, found = 0, any_dead = 0;
    for (int r = 0; r < c->world_size; r++) {
        if (r == c->rank || (only >= 0 && r != only))
            continue;
        int32_t pid = atomic_load(&s->ranks[r].pid);
        int dead = !pid_alive(pid);
        if ((count_ok(count_of(s, r, which), need) && !dead) || (dead_only && !dead))
            continue;
        found = 1;
        any_dead |= dead;
        if (append_late(msg, sizeof msg, &len, r, pid, dead)) {
            describe(s, r, what, sizeof what);
            len += snprintf(msg + len, sizeof msg - len, ", it is in %s (its %s chunks: %u, "
                            "this rank waits for %u)", what,
                            which == COUNT_STAGED ? "staged" : "consumed",
                            count_of(s, r, which), need);
        }
    }
    if (dead_only && !found)
        return FS_OK;
    return fail_waiting(c, dead_only, found, any_dead, msg);
}

/* Wait for counts_reached, as rendezvous waits: spin, then futex slices
 * with the abort flag, liveness and the deadline checked between them. */
static fs_status wait_counts(fs_comm *c, int which, uint32_t need, int only)
{
    shm_impl *s = c->impl;
    shm_header *h = s->hdr;
    if (first_behind(c, which, need, only) < 0)
        return FS_OK;
    const double until = now_s() + s->spin_ns * 1e-9; /* [Note: spin before sleeping] */
    do {
        for (int i = 0; i < s->spin_iters; i++) {
            if (first_behind(c, which, need, only) < 0)
                return FS_OK;
            cpu_relax();
        }
        if (atomic_load(&h->aborted))
            return aborted_elsewhere(c);
        sched_yield();
    } while (now_s() < until);
    double deadline = now_s() + s->timeout_s;
    for (;;) {
        if (atomic_load(&h->aborted))
            return aborted_elsewhere(c);
        const int r = first_behind(c, which, need, only);
        if (r < 0)
            return FS_OK;
        /* Sleep on the count of the rank behind; its publish wakes us. */
        atomic_fetch_add(sleepers_word(s, r, which), 1);
        uint32_t seen = count_of(s, r, which);
        if (!count_ok(seen, need))
            futex_wait(count_word(s, r, which), seen);
        atomic_fetch_sub(sleepers_word(s, r, which), 1);
        if (first_behind(c, which, need, only) < 0)
            return FS_OK;
        fs_status st = report_behind(c, which, need, only, 1); /* a dead rank: fail now */
        if (st != FS_OK)
            return st;
        if (now_s() > deadline)
            return report_behind(c, which, need, only, 0);
    }
}

/* Steps 1 and 2 of [Note: chunk pipeline] around the caller's writes:
 * chunk_begin before writing this rank's section, chunk_staged after. */
static fs_status chunk_begin(fs_comm *c)
{
    shm_impl *s = c->impl;
    const uint64_t g = s->chunk_counter;
    return g + 1 > NSECT ? wait_counts(c, COUNT_CONSUMED, (uint32_t)(g + 1 - NSECT), -1) : FS_OK;
}

static fs_status barrier(fs_comm *c);

/* Steps 2 and 3: publish the staged chunk, then wait for the peer `from`
 * to have staged it too (-1: every peer; this rank: none). */
static fs_status chunk_staged(fs_comm *c, int from)
{
    shm_impl *s = c->impl;
    const uint32_t g1 = (uint32_t)(s->chunk_counter + 1);
    publish(c, COUNT_STAGED, g1);
    if (s->check_pending) /* the collective's first chunk */
        return barrier(c);
    return wait_counts(c, COUNT_STAGED, g1, from);
}

/* Step 4: this rank is done reading chunk g; the next chunk's section. */
static void chunk_end(fs_comm *c)
{
    shm_impl *s = c->impl;
    publish(c, COUNT_CONSUMED, (uint32_t)++s->chunk_counter);
}

/* Every chunk's rendezvous; the collective's first also checks the peers. */
static fs_status barrier(fs_comm *c)
{
    shm_impl *s = c->impl;
    const double t0 = s->check_pending && s->stage_class >= 0 ? now_s() : 0;
    fs_status st = rendezvous(c);
    if (t0) /* the wait for the last rank to arrive is not the stores' time */
        s->t_wait0 = now_s() - t0;
    if (st == FS_OK && s->check_pending) {
        s->check_pending = 0;
        st = check_peers(c);
    }
    return st;
}

/* [Note: staging stores]: the store this collective stages with. */
static void pick_store(shm_impl *s, int op, size_t bytes)
{
    s->stage_class = op == OP_BARRIER ? -1 : fs_stage_class(op, bytes);
    s->stage_bytes = bytes;
    if (s->stage_class < 0)
        return;
    if (s->staging != FS_STAGE_AUTO) {
        s->store = s->staging == FS_STAGE_STREAMED ? FS_STORE_STREAMED : FS_STORE_CACHED;
    } else {
        const fs_stage_word w = atomic_load_explicit(&s->hdr->stage_choice[s->stage_class],
                                                     memory_order_relaxed);
        s->store = fs_stage_pick(&s->tuner, s->stage_class, w);
    }
    s->stores_used[s->store]++;
    s->t_wait0 = 0;
    s->t_enter = now_s();
}

/* Rank 0, after a collective that staged: what its store cost. */
static void learn_store(fs_comm *c)
{
    shm_impl *s = c->impl;
    if (c->rank != 0 || s->staging != FS_STAGE_AUTO || s->stage_class < 0)
        return;
    const double ns = (now_s() - s->t_enter - s->t_wait0) * 1e9;
    _Atomic uint8_t *choice = &s->hdr->stage_choice[s->stage_class];
    const fs_stage_word was = atomic_load_explicit(choice, memory_order_relaxed);
    const fs_stage_word now = fs_stage_learn(&s->tuner, s->stage_class, s->store,
                                             ns > 0 ? ns : 0, s->stage_bytes, was);
    if (now != was)
        atomic_store_explicit(choice, now, memory_order_relaxed);
}

/* Write this rank's staged bytes into its slot, with the collective's store. */
static void stage(shm_impl *s, void *dst, const void *src, size_t n)
{
    if (s->store == FS_STORE_STREAMED)
        fs_copy_stream(dst, src, n, s->simd);
    else
        memcpy(dst, src, n);
}

static void enter(fs_comm *c, int op, size_t bytes)
{
    shm_impl *s = c->impl;
    pick_store(s, op, bytes);
    shm_rank *me = &s->ranks[c->rank];
    shm_desc *d = &me->desc[(s->seq + 1) & 1];
    d->seq = s->seq + 1;
    d->op = (uint32_t)op;
    /* The caller recorded this collective in the ledger just before. */
    const fs_ledger_entry *e = s->ledger ? fs_ledger_get(s->ledger, s->ledger->count) : NULL;
    if (e)
        d->entry = *e;
    else
        memset(&d->entry, 0, sizeof d->entry);
    atomic_store(&me->seq, ++s->seq); /* published by the barrier that follows */
    atomic_store(&me->op, (uint32_t)op);
    s->check_pending = 1;
}

static fs_status leave(fs_comm *c, fs_status st)
{
    shm_impl *s = c->impl;
    if (st == FS_OK) {
        atomic_store(&s->ranks[c->rank].op, (uint32_t)OP_NONE);
        learn_store(c);
    }
    return st;
}

/* Rank `rank`'s section for the current chunk ([Note: chunk pipeline]). */
static char *section(shm_impl *s, int rank)
{
    return s->slots + ((size_t)rank * NSECT + s->chunk_counter % NSECT) * s->sect_bytes;
}

/* Units per chunk for `total` units of `unit_bytes`: the fewest chunks of at
 * most chunk_cap bytes, split evenly (no short last chunk); at least one
 * unit. */
static size_t chunk_units(const shm_impl *s, size_t total, size_t unit_bytes)
{
    size_t cap = s->chunk_cap / unit_bytes;
    cap = cap ? cap : 1;
    size_t chunks = (total + cap - 1) / cap;
    return (total + chunks - 1) / chunks;
}

/* Write part of a collective's output, which the caller reads later. */
static void put(shm_impl *s, void *dst, const void *src, size_t n, int stream)
{
    if (stream)
        fs_copy_stream(dst, src, n, s->simd);
    else
        memcpy(dst, src, n);
}

/* ---------------------------------------------------------------------------
 * collectives */

/* [Note: shm all-gather] Per chunk, each rank copies its piece into its
 * slot ([Note: staging stores]), then to its own place in recv (in place:
 * nothing) from whichever copy is cached, and copies every peer's section
 * into recv as soon as that peer has staged it, starting with the next rank
 * so that the ranks do not all read one slot at once. Per rank and byte of send:
 * one read of send, world writes of recv, world - 1 reads of the peers'
 * slots and one cached read of its own piece. */
static fs_status s_all_gather(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t)
{
    shm_impl *s = c->impl;
    const size_t bytes = (size_t)count * fs_dtype_size(t);
    const int me = c->rank, w = c->world_size;
    const int stream = bytes * (size_t)w > s->stream_above;
    const int in_place = (const char *)recv + me * bytes == (const char *)send;
    const size_t step = chunk_units(s, bytes, 1);
    fs_status st = FS_OK;
    enter(c, OP_ALL_GATHER, bytes);
    for (size_t off = 0; off < bytes && st == FS_OK; off += step) {
        size_t n = bytes - off < step ? bytes - off : step;
        if ((st = chunk_begin(c)) != FS_OK)
            break;
        char *mine = section(s, me);
        stage(s, mine, (const char *)send + off, n);
        /* Cached, the staged copy is the nearer source; streamed, it is in
         * memory and send is still in the cache. */
        if (!in_place)
            put(s, (char *)recv + me * bytes + off,
                s->store == FS_STORE_CACHED ? mine : (const char *)send + off, n, stream);
        /* Each peer is waited for just before it is read. */
        st = chunk_staged(c, me);
        for (int k = 1; k < w && st == FS_OK; k++) {
            int r = (me + k) % w;
            st = wait_counts(c, COUNT_STAGED, (uint32_t)(s->chunk_counter + 1), r);
            if (st == FS_OK)
                put(s, (char *)recv + r * bytes + off, section(s, r), n, stream);
        }
        chunk_end(c);
    }
    return leave(c, st);
}

static fs_status s_reduce_scatter(fs_comm *c, const void *send, void *recv, int64_t recv_count,
                                  fs_dtype t, fs_redop op)
{
    shm_impl *s = c->impl;
    const size_t es = fs_dtype_size(t);
    const int w = c->world_size, me = c->rank;
    /* Each chunk stages, for every other rank r, the piece of r's segment. */
    const int64_t chunk = (int64_t)chunk_units(s, (size_t)recv_count, (size_t)w * es);
    const int stream = (size_t)recv_count * es > s->stream_above;
    const double scale = op == FS_RED_AVG ? 1.0 / w : 1.0;
    fs_status st = FS_OK;
    enter(c, OP_REDUCE_SCATTER, (size_t)recv_count * es * (size_t)w);
    for (int64_t off = 0; off < recv_count && st == FS_OK; off += chunk) {
        int64_t n = recv_count - off < chunk ? recv_count - off : chunk;
        if ((st = chunk_begin(c)) != FS_OK)
            break;
        char *mine = section(s, me);
        for (int r = 0; r < w; r++)
            if (r != me)
                stage(s, mine + (size_t)r * chunk * es,
                       (const char *)send + ((size_t)r * recv_count + off) * es, (size_t)n * es);
        if ((st = chunk_staged(c, -1)) != FS_OK)
            break;
        for (int r = 0; r < w; r++)
            s->srcs[r] = r == me ? (const char *)send + ((size_t)me * recv_count + off) * es
                                 : section(s, r) + (size_t)me * chunk * es;
        st = fs_reduce_sum((char *)recv + off * es, s->srcs, w, n, t, scale, s->simd, stream);
        chunk_end(c);
    }
    return leave(c, st);
}

static fs_status s_all_reduce(fs_comm *c, void *buf, int64_t count, fs_dtype t, fs_redop op)
{
    shm_impl *s = c->impl;
    const size_t es = fs_dtype_size(t);
    const int64_t chunk = (int64_t)chunk_units(s, (size_t)count, es);
    const int stream = (size_t)count * es > s->stream_above;
    const double scale = op == FS_RED_AVG ? 1.0 / c->world_size : 1.0;
    fs_status st = FS_OK;
    enter(c, OP_ALL_REDUCE, (size_t)count * es);
    for (int64_t off = 0; off < count && st == FS_OK; off += chunk) {
        int64_t n = count - off < chunk ? count - off : chunk;
        if ((st = chunk_begin(c)) != FS_OK)
            break;
        stage(s, section(s, c->rank), (char *)buf + off * es, (size_t)n * es);
        if ((st = chunk_staged(c, -1)) != FS_OK)
            break;
        /* Every rank sums the same slots in rank order: identical bits. */
        for (int r = 0; r < c->world_size; r++)
            s->srcs[r] = section(s, r);
        st = fs_reduce_sum((char *)buf + off * es, s->srcs, c->world_size, n, t, scale, s->simd,
                           stream);
        chunk_end(c);
    }
    return leave(c, st);
}

static fs_status s_broadcast(fs_comm *c, void *buf, int64_t count, fs_dtype t, int root)
{
    shm_impl *s = c->impl;
    const size_t bytes = (size_t)count * fs_dtype_size(t);
    const int stream = bytes > s->stream_above;
    const size_t step = chunk_units(s, bytes, 1);
    fs_status st = FS_OK;
    enter(c, OP_BROADCAST, bytes);
    for (size_t off = 0; off < bytes && st == FS_OK; off += step) {
        size_t n = bytes - off < step ? bytes - off : step;
        if ((st = chunk_begin(c)) != FS_OK)
            break;
        if (c->rank == root)
            stage(s, section(s, root), (char *)buf + off, n);
        if ((st = chunk_staged(c, root)) != FS_OK)
            break;
        if (c->rank != root)
            put(s, (char *)buf + off, section(s, root), n, stream);
        chunk_end(c);
    }
    return leave(c, st);
}

static fs_status s_barrier(fs_comm *c)
{
    enter(c, OP_BARRIER, 0);
    return leave(c, barrier(c));
}

/* Each chunk stages, for every other rank r, the next piece of the block
 * for r (as a reduce-scatter stages, without the sum). */
static fs_status s_all_to_all(fs_comm *c, const void *send, void *recv, int64_t count,
                              fs_dtype t)
{
    shm_impl *s = c->impl;
    const size_t bytes = (size_t)count * fs_dtype_size(t);
    const int w = c->world_size, me = c->rank;
    const size_t chunk = s->sect_bytes / (size_t)w;
    fs_status st = FS_OK;
    enter(c, OP_ALL_TO_ALL, bytes * (size_t)w);
    memcpy((char *)recv + me * bytes, (const char *)send + me * bytes, bytes);
    for (size_t off = 0; off < bytes && st == FS_OK; off += chunk) {
        size_t n = bytes - off < chunk ? bytes - off : chunk;
        if ((st = chunk_begin(c)) != FS_OK)
            break;
        char *mine = section(s, me);
        for (int r = 0; r < w; r++)
            if (r != me)
                stage(s, mine + r * chunk, (const char *)send + r * bytes + off, n);
        if ((st = chunk_staged(c, -1)) != FS_OK)
            break;
        for (int r = 0; r < w; r++)
            if (r != me)
                memcpy((char *)recv + r * bytes + off, section(s, r) + me * chunk, n);
        chunk_end(c);
    }
    return leave(c, st);
}

static void s_destroy(fs_comm *c)
{
    shm_impl *s = c->impl;
    if (s) {
        if (s->hdr)
            munmap(s->hdr, s->map_bytes);
        free(s->srcs);
        free(s);
    }
    free(c);
}

static void s_abort(fs_comm *c, const char *why) { shm_abort(c, FS_FAIL_OTHER, why); }

static const fs_comm_ops shm_ops = {
    "shm",     0,         s_all_gather, s_reduce_scatter, s_all_reduce,
    s_broadcast, s_barrier, s_destroy,  s_abort, s_all_to_all,
};

/* ---------------------------------------------------------------------------
 * create / attach */

static fs_status fail_errno(char *err, size_t cap, const char *what, const char *name)
{
    snprintf(err, cap, "%s %s: %s", what, name, strerror(errno));
    return FS_ERR_BACKEND;
}

/* [Note: chunk size] A chunk is copied into the slot, then read by the
 * peers (and by its own rank, for its place in recv) right after the
 * chunk is staged. Every rank's NSECT sections together take a quarter of
 * the last-level cache when a chunk is LLC / (4 * NSECT * world): the
 * slots' traffic then stays in the cache and never reaches memory, even
 * while the collective's inputs and outputs stream through the same cache
 * (on AMD's the L3 takes every line the L2 evicts, the inputs' included).
 * Sized to fill the whole cache (LLC / (NSECT * world)) they were measured
 * 10-30% slower at 64 MiB on a 32 MiB L3 (2 and 4 ranks), and so were
 * chunks sized for L2 back when every chunk was a barrier (a sleep and a
 * wake-up whenever a peer was not running; benchmarks/results/comm.md, "The
 * shm backend at the memory's speed" and "The shm backend's chunk pipeline").
 * Now only a collective's
 * first chunk is a barrier, so the cache decides. FLATSHARD_SHM_SLOT_BYTES
 * caps them (a slot's section, slot / NSECT).
 *
 * [Note: streaming stores] A collective's output larger than this rank's
 * share of the last-level cache would not stay cached for its reader
 * anyway: it is written with non-temporal stores (stream_copy.h), which
 * skip the read for ownership of every destination line. Smaller outputs
 * use plain stores and stay cached for the caller. */
static void tune(shm_impl *s, int world, int cpus)
{
    const size_t l2 = cache_bytes(2), l3 = cache_bytes(3);
    const size_t llc = l3 ? l3 : l2 ? l2 : (size_t)8 << 20;
    size_t cap = llc / (4 * NSECT * (size_t)world);
    cap = (cap < 64 << 10 ? 64 << 10 : cap) / 64 * 64;
    s->chunk_cap = cap < s->sect_bytes ? cap : s->sect_bytes;
    const int sharers = world < cpus ? world : cpus;
    s->stream_above = llc / (size_t)(sharers > 0 ? sharers : 1);
}

fs_status fs_comm_shm_create(const char *name, int rank, int world_size, size_t slot_bytes,
                             double timeout_s, int staging, int create,
                             const fs_ledger *ledger, fs_comm **out, char *err, size_t err_cap)
{
    /* A reduce-scatter chunk holds at least one element (8 bytes at most) per
     * rank in one section. */
    if (world_size < 1 || rank < 0 || rank >= world_size || slot_bytes < 4096 || timeout_s <= 0 ||
        slot_bytes / NSECT < (size_t)world_size * 8 || staging < FS_STAGE_AUTO ||
        staging > FS_STAGE_STREAMED) {
        snprintf(err, err_cap, "invalid shm arguments");
        return FS_ERR_INVALID_ARG;
    }
    slot_bytes = align_up(slot_bytes, 64 * NSECT); /* NSECT 64-byte aligned sections */
    const size_t hdr = header_bytes(world_size);
    const size_t total = hdr + (size_t)world_size * slot_bytes;
    fs_comm *c = calloc(1, sizeof *c);
    shm_impl *s = calloc(1, sizeof *s);
    const void **srcs = calloc((size_t)world_size, sizeof *srcs);
    fs_status st = FS_OK;
    int fd = -1;
    if (!c || !s || !srcs) {
        snprintf(err, err_cap, "out of memory");
        st = FS_ERR_NO_MEMORY;
        goto fail;
    }
    fd = create ? shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600) : shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        st = fail_errno(err, err_cap, create ? "shm_open (create)" : "shm_open", name);
        goto fail;
    }
    if (create && ftruncate(fd, (off_t)total) != 0) {
        st = fail_errno(err, err_cap, "ftruncate", name);
        shm_unlink(name);
        goto fail;
    }
    /* A segment still being created (opened, not yet sized) or of another
     * size must not be mapped: touching a mapping past the file's end is
     * SIGBUS, not an error. The attaching side may retry. */
    struct stat sb;
    if (!create && (fstat(fd, &sb) != 0 || (size_t)sb.st_size < total)) {
        snprintf(err, err_cap, "shm segment %s is not ready: %lld of %zu bytes", name,
                 (long long)sb.st_size, total);
        st = FS_ERR_BACKEND;
        goto fail;
    }
    void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        st = fail_errno(err, err_cap, "mmap", name);
        if (create)
            shm_unlink(name);
        goto fail;
    }
    s->hdr = base;
    s->map_bytes = total;
    s->ranks = (shm_rank *)((char *)base + align_up(sizeof(shm_header), 64));
    s->slots = (char *)base + hdr;
    s->sect_bytes = slot_bytes / NSECT;
    s->timeout_s = timeout_s;
    const int cpus = cpus_allowed();
    s->spin_ns = SPIN_NS;
    s->spin_iters = world_size <= cpus ? SPIN_ITERS : SPIN_ITERS_SHARED;
    tune(s, world_size, cpus);
    s->simd = fs_simd_best();
    s->staging = (fs_stage_policy)staging;
    s->stage_class = -1;
    s->ledger = ledger;
    s->srcs = srcs;
    srcs = NULL;
    if (create) {
        s->hdr->world_size = (uint32_t)world_size;
        s->hdr->slot_bytes = slot_bytes;
        atomic_store(&s->hdr->magic, SHM_MAGIC);
    } else if (atomic_load(&s->hdr->magic) != SHM_MAGIC || s->hdr->world_size != (uint32_t)world_size ||
               s->hdr->slot_bytes != slot_bytes) {
        snprintf(err, err_cap, "shm segment %s does not match this group (world %d)", name,
                 world_size);
        st = FS_ERR_BACKEND;
        goto fail;
    }
    atomic_store(&s->ranks[rank].pid, (int32_t)getpid());
    /* The last rank to map the segment removes its name: nothing can leak. */
    if (atomic_fetch_add(&s->hdr->attached, 1) == (uint32_t)world_size - 1)
        shm_unlink(name);
    close(fd);
    c->ops = &shm_ops;
    c->rank = rank;
    c->world_size = world_size;
    c->impl = s;
    *out = c;
    return FS_OK;
fail:
    if (fd >= 0)
        close(fd);
    free(srcs);
    if (c) {
        c->impl = s;
        s_destroy(c);
    } else {
        free(s);
    }
    return st;
}

int fs_comm_shm_stores_used(const fs_comm *c, uint64_t out[2])
{
    if (!c || c->ops != &shm_ops)
        return -1;
    const shm_impl *s = c->impl;
    out[0] = s->stores_used[FS_STORE_CACHED];
    out[1] = s->stores_used[FS_STORE_STREAMED];
    return 0;
}

fs_status fs_shm_unlink(const char *name)
{
    return shm_unlink(name) == 0 || errno == ENOENT ? FS_OK : FS_ERR_BACKEND;
}
