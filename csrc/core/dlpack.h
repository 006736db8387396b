/* dlpack.h - the few DLPack (v0.x ABI) definitions flatshard needs to hand
 * a raw buffer to torch.from_dlpack without torch's headers. The layout is
 * the stable, published DLPack ABI. */
#ifndef FS_DLPACK_H
#define FS_DLPACK_H

#include <stdint.h>

enum { FS_kDLCPU = 1, FS_kDLCUDA = 2 };
enum { FS_kDLInt = 0, FS_kDLUInt = 1, FS_kDLFloat = 2, FS_kDLBfloat = 4 };

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#endif
