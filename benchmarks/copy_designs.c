/* copy_designs.c - ways two processes on one host can all-gather, timed call
 * by call in one pair of processes, so every design meets the same
 * placement of the pair's CPUs. Built and run by bench_copy_designs.py.
 *
 * Each call is one all-gather of 2 x `half` bytes between two forked
 * processes (each rank's piece lands in both ranks' output), between spin
 * barriers on a shared word, and every design is called once per round:
 *   slot-cached    the shm backend's path: piece -> own slot with plain
 *                  stores, own piece -> output, barrier, peer's slot ->
 *                  output (FLATSHARD_SHM_STAGING=cached); two sections per
 *                  slot, used in turn;
 *   slot-streamed  the same with streaming stores into the slot
 *                  (FLATSHARD_SHM_STAGING=streamed);
 *   single-fresh   a single copy: each rank's output lives in shared
 *                  memory, the rank writes its piece there (as a gather
 *                  writes a new shard each time), barrier, and the peer
 *                  copies it straight from there; a second barrier, so
 *                  that the piece is not rewritten while it is read;
 *   single-streamed the same, the piece written with streaming stores;
 *   single-static  the same, the piece written once before the run: what
 *                  a single copy costs when the peer's lines were never
 *                  modified since it last read them (no gather does this);
 *   vm-readv       a single copy through the kernel: the peer's piece read
 *                  from its private memory with process_vm_readv;
 *   memcpy         one rank alone copies 2 x half bytes (the ceiling).
 * Prints, per design, the median microseconds per call in each quarter of
 * the run. Linux, x86-64 with AVX2. Not part of flatshard: a measurement. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { SLOT_CACHED, SLOT_STREAMED, SINGLE_FRESH, SINGLE_STREAMED, SINGLE_STATIC, VM_READV,
       MEMCPY, DESIGNS };
static const char *names[DESIGNS] = {"slot-cached", "slot-streamed", "single-fresh",
                                     "single-streamed", "single-static", "vm-readv", "memcpy"};

typedef struct {
    _Atomic unsigned arrived[2];
    pid_t pid[2];
    char *piece[2]; /* each rank's private piece, for vm-readv */
} control;

static control *ctl;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void barrier(int me, unsigned *gen)
{
    atomic_store(&ctl->arrived[me], ++*gen);
    while ((int)(atomic_load(&ctl->arrived[1 - me]) - *gen) < 0)
        _mm_pause();
}

__attribute__((target("avx2"))) static void copy_streamed(char *d, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i += 32)
        _mm256_stream_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
    _mm_sfence();
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: copy_designs KIB_PER_RANK CALLS\n");
        return 2;
    }
    const size_t half = (size_t)atol(argv[1]) << 10;
    const int calls = atoi(argv[2]);
    if (half < 4096 || half % 64 || calls < 4)
        return 2;
    ctl = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    /* Two sections per rank's slot, used in turn, as the backend's are. */
    char *slots = mmap(NULL, 4 * half, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    /* single-fresh/-streamed's outputs, then single-static's */
    char *shared_out = mmap(NULL, 8 * half, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                            -1, 0);
    if (ctl == MAP_FAILED || slots == MAP_FAILED || shared_out == MAP_FAILED)
        return 1;
    memset(slots, 0, 4 * half);
    memset(shared_out, 0, 8 * half);
    const int me = fork() == 0 ? 1 : 0, peer = 1 - me;
    char *piece = aligned_alloc(4096, half), *out = aligned_alloc(4096, 2 * half);
    memset(piece, me + 1, half);
    memset(out, 0, 2 * half);
    /* single-*: rank r's output is shared_out[r]; its piece at r * half. */
    char *sh_mine = shared_out + (size_t)me * 2 * half, *sh_peer = shared_out + (size_t)peer * 2 * half;
    char *st_mine = sh_mine + 4 * half, *st_peer = sh_peer + 4 * half;
    ctl->pid[me] = getpid();
    ctl->piece[me] = piece;
    unsigned gen = 0;
    barrier(me, &gen);
    memcpy(st_mine + me * half, piece, half); /* single-static's one write */
    barrier(me, &gen);
    double *ts = malloc(sizeof(double) * DESIGNS * (size_t)calls);
    for (int it = 0; it < calls; it++) {
        for (int d = 0; d < DESIGNS; d++) {
            barrier(me, &gen);
            const double t0 = now();
            char *mine = slots + (size_t)(me * 2 + (it & 1)) * half;
            const char *theirs = slots + (size_t)(peer * 2 + (it & 1)) * half;
            switch (d) {
            case SLOT_CACHED:
            case SLOT_STREAMED:
                if (d == SLOT_CACHED)
                    memcpy(mine, piece, half);
                else
                    copy_streamed(mine, piece, half);
                memcpy(out + me * half, d == SLOT_CACHED ? mine : piece, half);
                barrier(me, &gen);
                memcpy(out + peer * half, theirs, half);
                break;
            case SINGLE_FRESH:
            case SINGLE_STREAMED:
            case SINGLE_STATIC:
                if (d == SINGLE_FRESH)
                    memcpy(sh_mine + me * half, piece, half);
                else if (d == SINGLE_STREAMED)
                    copy_streamed(sh_mine + me * half, piece, half);
                barrier(me, &gen);
                if (d == SINGLE_STATIC)
                    memcpy(st_mine + peer * half, st_peer + peer * half, half);
                else
                    memcpy(sh_mine + peer * half, sh_peer + peer * half, half);
                barrier(me, &gen);
                break;
            case VM_READV: {
                memcpy(out + me * half, piece, half);
                barrier(me, &gen);
                struct iovec local = {out + peer * half, half}, remote = {ctl->piece[peer], half};
                if (process_vm_readv(ctl->pid[peer], &local, 1, &remote, 1, 0) != (ssize_t)half) {
                    perror("process_vm_readv");
                    return 1;
                }
                barrier(me, &gen);
                break;
            }
            case MEMCPY:
                memcpy(out, piece, half);
                memcpy(out + half, piece, half);
                break;
            }
            ts[(size_t)d * calls + it] = now() - t0;
        }
    }
    if (me == 0) {
        const int q = calls / 4;
        for (int d = 0; d < DESIGNS; d++) {
            printf("%s", names[d]);
            for (int k = 0; k < 4; k++) {
                double *a = ts + (size_t)d * calls + (size_t)k * q;
                qsort(a, (size_t)q, sizeof *a, cmp);
                printf(" %.1f", a[q / 2] * 1e6);
            }
            printf("\n");
        }
        wait(NULL);
    }
    return 0;
}
