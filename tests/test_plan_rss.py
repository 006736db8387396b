"""The planner's peak resident memory on CPU ([Note: resident prediction] in
flatshard/plan/core.py) against the peak each rank really reaches, training a
GPT-2-shaped transformer under FULL_SHARD with the model built on the meta
device. Each case runs in fresh processes: a process's peak resident memory
(ru_maxrss) covers its whole life, so a shared worker would not do."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")

SEQ, BATCH, STEPS = 128, 2, 3


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank, world, port, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import flatshard
    import flatshard.plan
    runtime = flatshard.plan.measure_runtime()
    cfg = GPT2Config(vocab_size=16384, n_positions=SEQ, n_embd=512, n_layer=6, n_head=8)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)

    def init(m):  # FSDP hands it the root's modules breadth-first: lm_head before wte
        m.to_empty(device="cpu", recurse=False)
        if m is not model.lm_head:
            model._init_weights(m)
        model.lm_head.weight = model.transformer.wte.weight  # tied again, whichever came first
    fs = flatshard.FullyShardedDataParallel(
        model, auto_wrap_policy=flatshard.ModuleWrapPolicy({GPT2Block}),
        sharding_strategy=flatshard.ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"),
        param_init_fn=init)
    opt = torch.optim.AdamW(fs.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(rank)
    activations = None
    for _ in range(STEPS):
        idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        if activations is None:  # measured once, in the first forward
            with flatshard.plan.SavedActivations(fs) as act:
                loss = fs(input_ids=idx, labels=idx).loss
            activations = act.bytes
        else:
            loss = fs(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = flatshard.memory_stats(fs, opt)
    p = flatshard.plan.predict(fs, opt, batch_size=BATCH, seq_len=SEQ, hidden=cfg.n_embd,
                               layers=cfg.n_layer, heads=cfg.n_head, vocab=cfg.vocab_size,
                               runtime_bytes=runtime, activation_bytes=activations)
    queue.put((rank, p.peak_rss, stats["peak_resident"], stats["resident"],
               runtime + p.model_states, stats["pool_cached"]))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_planner_predicts_the_peak_resident_memory_on_cpu(world):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_train, args=(world, _port(), queue), nprocs=world, start_method="spawn",
                       join=True)
    rows = [queue.get() for _ in range(world)]
    for rank, predicted, peak, between, states, cached in rows:
        print(f"rank {rank}: predicted {predicted:,} measured {peak:,} "
              f"({predicted / peak - 1:+.1%})")
        # Within 10% on the GPT-2 124M benchmark (benchmarks/results/memory.md,
        # "Resident memory"); on this
        # smaller model the runtime (what the environment imported) is a larger
        # share and measured peaks moved from -10% to +13% of the prediction
        # between environments, so the test holds the planner to 20%.
        assert abs(predicted - peak) <= 0.20 * peak, (rank, predicted, peak)
        # between steps: the runtime and the model states, nothing cached
        assert cached == 0
        assert between <= 1.10 * states, (rank, between, states)
