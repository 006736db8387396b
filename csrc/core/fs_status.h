/* fs_status.h - the one result type of the flatshard C core.
 *
 * Every C function that can fail returns an fs_status. Foreign errors
 * (errno, a Python exception raised inside a backend, CUDA and NCCL) are
 * mapped at the edge; the CPython glue turns a status into an exception.
 * The core never prints, exits or aborts. */
#ifndef FS_STATUS_H
#define FS_STATUS_H

typedef enum {
    FS_OK = 0,
    FS_ERR_INVALID_ARG = 1,   /* a caller broke a documented precondition */
    FS_ERR_BAD_STATE = 2,     /* an event that the unit's state does not allow */
    FS_ERR_NO_MEMORY = 3,
    FS_ERR_BACKEND = 4,       /* a collective backend failed; see its last error */
    FS_ERR_PYTHON = 5,        /* a Python exception is set (torch backend) */
    FS_ERR_UNSUPPORTED = 6,   /* dtype/op combination not implemented */
} fs_status;

const char *fs_status_str(fs_status s);

/* Return from the enclosing function when a call fails. */
#define FS_CHECK(call)                         \
    do {                                       \
        fs_status fs_check_s_ = (call);        \
        if (fs_check_s_ != FS_OK)              \
            return fs_check_s_;                \
    } while (0)

#endif
