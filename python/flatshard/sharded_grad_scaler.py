"""torch.distributed.fsdp.sharded_grad_scaler's ShardedGradScaler at
`flatshard.sharded_grad_scaler`: torch's own class, which works unchanged
on flatshard's shards (it reads the gradients each rank holds and agrees on
inf/NaN with one all-reduce). Names only."""
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = ["ShardedGradScaler"]
