/* nccl_load.c - open libnccl.so.2 at run time and fill fs_nccl.
 *
 * dlopen'ed, not linked: the build needs no NCCL, importing flatshard needs
 * no GPU, and at run time flatshard shares the library torch already loaded
 * (same path, same handle). */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "fs_cuda.h"
#include "fs_nccl.h"

fs_nccl_lib fs_nccl;


fs_status fs_nccl_load(const char *path, int *version, char *err, size_t cap)
{
    if (fs_nccl.lib) {
        *version = fs_nccl.version;
        return FS_OK;
    }
    const char *name = path && *path ? path : "libnccl.so.2";
    void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(err, cap, "cannot open %s: %s", name, dlerror());
        return FS_ERR_BACKEND;
    }
#define SYM(field, sym, required)                                                   \
    do {                                                                            \
        *(void **)&fs_nccl.field = dlsym(lib, sym);                                 \
        if (!fs_nccl.field && required) {                                           \
            snprintf(err, cap, "%s has no symbol %s (NCCL 2.x needed)", name, sym); \
            dlclose(lib);                                                           \
            memset(&fs_nccl, 0, sizeof fs_nccl);                                    \
            return FS_ERR_BACKEND;                                                  \
        }                                                                           \
    } while (0)
    SYM(GetVersion, "ncclGetVersion", 1);
    SYM(GetUniqueId, "ncclGetUniqueId", 1);
    SYM(CommInitRank, "ncclCommInitRank", 1);
    SYM(CommDestroy, "ncclCommDestroy", 1);
    SYM(CommAbort, "ncclCommAbort", 1);
    SYM(CommGetAsyncError, "ncclCommGetAsyncError", 1);
    SYM(GetErrorString, "ncclGetErrorString", 1);
    SYM(GetLastError, "ncclGetLastError", 0);
    SYM(AllGather, "ncclAllGather", 1);
    SYM(ReduceScatter, "ncclReduceScatter", 1);
    SYM(AllReduce, "ncclAllReduce", 1);
    SYM(Broadcast, "ncclBroadcast", 1);
    SYM(GroupStart, "ncclGroupStart", 1);
    SYM(GroupEnd, "ncclGroupEnd", 1);
    SYM(Send, "ncclSend", 0);
    SYM(Recv, "ncclRecv", 0);
#undef SYM
    int v = 0;
    if (fs_nccl.GetVersion(&v) != ncclSuccess || v < 21000) { /* ncclBfloat16 needs 2.10 */
        snprintf(err, cap, "%s: NCCL version %d is older than 2.10", name, v);
        dlclose(lib);
        memset(&fs_nccl, 0, sizeof fs_nccl);
        return FS_ERR_BACKEND;
    }
    fs_nccl.version = v;
    fs_nccl.lib = lib;
    *version = v;
    return FS_OK;
}

int fs_nccl_version(void) { return fs_nccl.version; }

fs_status fs_nccl_unique_id(unsigned char out[128], char *err, size_t cap)
{
    if (!fs_nccl.lib) {
        snprintf(err, cap, "NCCL is not loaded");
        return FS_ERR_BACKEND;
    }
    ncclUniqueId id;
    ncclResult_t r = fs_nccl.GetUniqueId(&id);
    if (r != ncclSuccess) {
        snprintf(err, cap, "ncclGetUniqueId: %s", fs_nccl.GetErrorString(r));
        return FS_ERR_BACKEND;
    }
    memcpy(out, id.internal, sizeof id.internal);
    return FS_OK;
}

