/* emu.cc - the fiber scheduler behind fs_emu.h: a launch runs its blocks in
 * order; a block's threads are ucontext fibers that run until they finish
 * or wait at a barrier, and a barrier opens when every live thread of its
 * scope (the block, or one warp) waits at it. A block whose threads all wait
 * at barriers that cannot open is a deadlock: reported, then abort(). */
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>

#include <vector>

#include "fs_emu.h"

dim3 fs_emu_threadIdx, fs_emu_blockIdx, fs_emu_blockDim, fs_emu_gridDim;

namespace {

enum { RUNNABLE, WAITING, DONE };

struct fiber {
    ucontext_t ctx;
    int state;
    int scope; /* what it waits for: -1 the block, w >= 0 warp w */
};

constexpr size_t kStack = 256 * 1024;
constexpr int kMaxThreads = 1024;

std::vector<fiber> threads;
std::vector<char> stacks;
uint64_t slots[kMaxThreads];
ucontext_t scheduler;
int current;
const std::function<void()> *running;

bool member(int i, int scope) { return scope < 0 || i / 32 == scope; }

/* Opens the barrier of `scope` when every live member waits at it. */
void try_open(int scope)
{
    int live = 0, waiting = 0;
    for (int i = 0; i < (int)threads.size(); i++) {
        if (!member(i, scope) || threads[i].state == DONE)
            continue;
        live++;
        waiting += threads[i].state == WAITING && threads[i].scope == scope;
    }
    if (waiting == 0 || waiting != live)
        return;
    for (int i = 0; i < (int)threads.size(); i++)
        if (member(i, scope) && threads[i].state == WAITING && threads[i].scope == scope)
            threads[i].state = RUNNABLE;
}

void fiber_main()
{
    (*running)();
    threads[current].state = DONE;
    try_open(-1);
    try_open(current / 32);
    /* returns to uc_link: the scheduler */
}

} // namespace

void *fs_emu_slot(unsigned t) { return &slots[t]; }

void fs_emu_unsupported(const char *what)
{
    fprintf(stderr, "fs_emu: not emulated: %s\n", what);
    abort();
}

void fs_emu_barrier(int warp_scope)
{
    const int me = current;
    fiber &f = threads[me];
    f.state = WAITING;
    f.scope = warp_scope < 0 ? -1 : me / 32;
    try_open(f.scope);
    if (threads[me].state == WAITING)
        swapcontext(&threads[me].ctx, &scheduler);
    fs_emu_threadIdx = dim3{(unsigned)me, 0, 0};
}

void fs_emu_run(int grid, int block, const std::function<void()> &body)
{
    if (grid < 1 || block < 1 || block > kMaxThreads) {
        fprintf(stderr, "fs_emu: bad launch: grid %d, block %d\n", grid, block);
        abort();
    }
    const std::function<void()> *outer = running;
    if (outer) {
        fprintf(stderr, "fs_emu: a launch from inside a kernel\n");
        abort();
    }
    running = &body;
    threads.assign(block, fiber{});
    if (stacks.size() < (size_t)block * kStack)
        stacks.resize((size_t)block * kStack);
    fs_emu_gridDim = dim3{(unsigned)grid, 1, 1};
    fs_emu_blockDim = dim3{(unsigned)block, 1, 1};
    for (int b = 0; b < grid; b++) {
        fs_emu_blockIdx = dim3{(unsigned)b, 0, 0};
        for (int i = 0; i < block; i++) {
            fiber &f = threads[i];
            f.state = RUNNABLE;
            f.scope = -1;
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = stacks.data() + (size_t)i * kStack;
            f.ctx.uc_stack.ss_size = kStack;
            f.ctx.uc_link = &scheduler;
            makecontext(&f.ctx, fiber_main, 0);
        }
        for (int done = 0; done < block;) {
            bool ran = false;
            done = 0;
            for (int i = 0; i < block; i++) {
                if (threads[i].state == RUNNABLE) {
                    current = i;
                    fs_emu_threadIdx = dim3{(unsigned)i, 0, 0};
                    swapcontext(&scheduler, &threads[i].ctx);
                    ran = true;
                }
                done += threads[i].state == DONE;
            }
            if (!ran && done < block) {
                fprintf(stderr, "fs_emu: deadlock in block %d: %d of %d threads wait at "
                        "barriers that cannot open\n", b, block - done, block);
                abort();
            }
        }
    }
    running = nullptr;
}
