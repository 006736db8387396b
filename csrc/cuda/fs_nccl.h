/* fs_nccl.h - the subset of the NCCL API flatshard calls, declared here so
 * the build needs no NCCL headers. libnccl.so.2 is opened at run time
 * (comm_nccl.c): the one torch's CUDA wheels ship, so flatshard and torch use
 * the same library. Values and signatures are those of nccl.h (NCCL 2.x);
 * they are part of NCCL's stable ABI. */
#ifndef FS_NCCL_H
#define FS_NCCL_H

#include <stddef.h>
#include <cuda_runtime_api.h>

typedef struct ncclComm *ncclComm_t;

#define FS_NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[FS_NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

typedef ncclResult_t (*fs_ncclGetVersion_t)(int *version);
typedef ncclResult_t (*fs_ncclGetUniqueId_t)(ncclUniqueId *id);
typedef ncclResult_t (*fs_ncclCommInitRank_t)(ncclComm_t *comm, int nranks, ncclUniqueId id,
                                              int rank);
typedef ncclResult_t (*fs_ncclCommDestroy_t)(ncclComm_t comm);
typedef ncclResult_t (*fs_ncclCommAbort_t)(ncclComm_t comm);
typedef ncclResult_t (*fs_ncclCommGetAsyncError_t)(ncclComm_t comm, ncclResult_t *async_error);
typedef const char *(*fs_ncclGetErrorString_t)(ncclResult_t result);
typedef const char *(*fs_ncclGetLastError_t)(ncclComm_t comm);
typedef ncclResult_t (*fs_ncclAllGather_t)(const void *send, void *recv, size_t send_count,
                                           ncclDataType_t t, ncclComm_t comm, cudaStream_t s);
typedef ncclResult_t (*fs_ncclReduceScatter_t)(const void *send, void *recv, size_t recv_count,
                                               ncclDataType_t t, ncclRedOp_t op, ncclComm_t comm,
                                               cudaStream_t s);
typedef ncclResult_t (*fs_ncclAllReduce_t)(const void *send, void *recv, size_t count,
                                           ncclDataType_t t, ncclRedOp_t op, ncclComm_t comm,
                                           cudaStream_t s);
typedef ncclResult_t (*fs_ncclBroadcast_t)(const void *send, void *recv, size_t count,
                                           ncclDataType_t t, int root, ncclComm_t comm,
                                           cudaStream_t s);
typedef ncclResult_t (*fs_ncclSend_t)(const void *send, size_t count, ncclDataType_t t, int peer,
                                      ncclComm_t comm, cudaStream_t s);
typedef ncclResult_t (*fs_ncclRecv_t)(void *recv, size_t count, ncclDataType_t t, int peer,
                                      ncclComm_t comm, cudaStream_t s);
typedef ncclResult_t (*fs_ncclGroupStart_t)(void);
typedef ncclResult_t (*fs_ncclGroupEnd_t)(void);

/* The loaded library (nccl_load.c): every entry is set once lib != NULL,
 * except GetLastError (NCCL >= 2.13), which may stay NULL, and Send/Recv
 * (NCCL >= 2.7, and not in every stand-in library), NULL without them. */
typedef struct {
    void *lib;
    int version;
    fs_ncclGetVersion_t GetVersion;
    fs_ncclGetUniqueId_t GetUniqueId;
    fs_ncclCommInitRank_t CommInitRank;
    fs_ncclCommDestroy_t CommDestroy;
    fs_ncclCommAbort_t CommAbort;
    fs_ncclCommGetAsyncError_t CommGetAsyncError;
    fs_ncclGetErrorString_t GetErrorString;
    fs_ncclGetLastError_t GetLastError; /* NCCL >= 2.13; may be NULL */
    fs_ncclAllGather_t AllGather;
    fs_ncclReduceScatter_t ReduceScatter;
    fs_ncclAllReduce_t AllReduce;
    fs_ncclBroadcast_t Broadcast;
    fs_ncclGroupStart_t GroupStart;
    fs_ncclGroupEnd_t GroupEnd;
    fs_ncclSend_t Send; /* may be NULL */
    fs_ncclRecv_t Recv; /* may be NULL */
} fs_nccl_lib;
extern fs_nccl_lib fs_nccl;

#endif
