/* status.c - names for status codes and dtypes (for error messages). */
#include "fs_dtype.h"
#include "fs_status.h"

const char *fs_dtype_name(fs_dtype t)
{
    static const char *names[FS_DTYPE_COUNT] = {"float32", "float16", "bfloat16", "float64",
                                                "uint8",   "int32",   "int64"};
    return (unsigned)t < FS_DTYPE_COUNT ? names[t] : "invalid";
}

const char *fs_status_str(fs_status s)
{
    switch (s) {
    case FS_OK: return "ok";
    case FS_ERR_INVALID_ARG: return "invalid argument";
    case FS_ERR_BAD_STATE: return "event not allowed in the current state";
    case FS_ERR_NO_MEMORY: return "out of host memory";
    case FS_ERR_BACKEND: return "collective backend error";
    case FS_ERR_PYTHON: return "Python error";
    case FS_ERR_UNSUPPORTED: return "unsupported dtype or operation";
    }
    return "unknown status";
}
