/* shard_group_internal.h - what shard_group.c and shard_group_reduce.c share inside the engine
 * (not for the glue). */
#ifndef FS_SHARD_GROUP_INTERNAL_H
#define FS_SHARD_GROUP_INTERNAL_H

#include "shard_group.h"

/* [Note: copy counts]: n elements of dt written from st by a copy of `kind`
 * (a cast when the dtypes differ). */
void fs_shard_count_copy(fs_shard_group *g, int kind, fs_dtype dt, fs_dtype st, int64_t n);
/* [Note: direct layout]: more than one rank, and the group one Shard(0)
 * parameter whose rows split evenly with no padding in a block: the
 * all-gather output is the unsharded parameter, the gradient the
 * reduce-scatter input. */
int fs_shard_direct_layout(const fs_shard_group *g);

static inline int64_t fs_shard_param_numel(const fs_shard_param *p)
{
    return p->outer * p->dim0 * p->row_numel;
}

#endif
