"""A Hugging Face `transformers` model, built from a config (nothing is
downloaded), sharded with flatshard: each decoder layer is a unit.

    torchrun --nproc-per-node 2 examples/hf_llama.py [--steps 10]

Needs `pip install transformers`. tests/test_examples.py checks the losses
against the same model trained in one process on the same global batches.
"""
import argparse
import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from flatshard import FullyShardedDataParallel as FSDP, ShardingStrategy

VOCAB, SEQ, BATCH = 128, 16, 4


def build_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def batch(rank, step):
    """Rank `rank`'s batch at `step`: counting sequences (learnable)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    return (start + torch.arange(SEQ)) % VOCAB


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = FSDP(build_model(),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={LlamaDecoderLayer}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        ids = batch(rank, step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step} loss {avg.item() / dist.get_world_size():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
