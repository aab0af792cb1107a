"""The reference's `aam pretrain --distributed` step: torch DistributedDataParallel over NCCL, one
process per GPU, B=8 on every GPU, UniFrac pairs within each GPU's batch (the reference's DDP loss).
The DDP baseline for aam-rs data parallel (benches/multi_gpu_device.sh); its DataParallel
counterpart is ../shared/bench/pt_data_parallel_bench.py, whose model and batch this script uses.

Run on a machine with N GPUs, the reference's package under $AAM_SRC (default .ref):
    python3 -m torch.distributed.run --standalone --nproc_per_node N benches/pt_ddp_bench.py
Rank 0 prints one JSON line per mode: world size, batch per GPU, median step (ms), samples/s of
the whole world, and each GPU's peak allocated memory (MiB)."""
import json, os, statistics, sys, time

import torch
import torch.distributed as dist

sys.path.insert(0, os.environ.get("AAM_SRC", ".ref"))
from aam.models.sequence_encoder import SequenceEncoder  # noqa: E402
from aam.training.losses import MultiTaskLoss  # noqa: E402

L, S, B = 151, 1024, 8
ASVS = [120, 250, 80, 400, 300, 150, 500, 200]


def batch(rank):
    """The DataParallel script's batch of 8 samples, a different draw on every rank."""
    gen = torch.Generator().manual_seed(rank)
    t = torch.zeros(B, S, L, dtype=torch.long)
    c = torch.zeros(B, S, 1)
    for b in range(B):
        n = ASVS[b % 8]
        t[b, :n, 0] = 5
        t[b, :n, 1:] = torch.randint(1, 5, (n, L - 1), generator=gen)
        c[b, :n, 0] = torch.randint(1, 200, (n,), generator=gen).float()
    d = torch.rand(B, B, generator=gen)
    u = ((d + d.T) / 2).fill_diagonal_(0.0)
    return t.cuda(), c.cuda(), u.cuda()


def run(rank, local, world, ckpt, amp, steps=10, warm=3):
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = SequenceEncoder(
        encoder_type="unifrac", vocab_size=7, embedding_dim=128, max_bp=150, token_limit=S,
        asv_num_layers=4, asv_num_heads=4, sample_num_layers=4, sample_num_heads=4,
        encoder_num_layers=4, encoder_num_heads=4, predict_nucleotides=True, asv_chunk_size=256,
        gradient_checkpointing=ckpt, mask_ratio=0.15, mask_strategy="random",
        attn_implementation="mem_efficient",
    ).cuda()
    model.train()
    # The reference's wrap_model_ddp defaults (find_unused_parameters off, bucket views on).
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[local], find_unused_parameters=False, gradient_as_bucket_view=True
    )
    loss_fn = MultiTaskLoss(penalty=1.0, nuc_penalty=1.0, count_penalty=1.0, class_weights=None,
                            target_loss_type="huber")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    t, c, u = batch(rank)
    times = []
    for i in range(warm + steps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
            out = ddp(t, counts=c, return_nucleotides=True)
            loss = loss_fn(out, {"base_target": u, "tokens": t, "nucleotides": t,
                                 "mask": (t > 0).long(), "counts": c}, encoder_type="unifrac")
        opt.zero_grad(set_to_none=True)
        loss["total_loss"].backward()
        opt.step()
        torch.cuda.synchronize()
        dist.barrier()
        if i >= warm:
            times.append((time.perf_counter() - t0) * 1e3)
    peaks = [None] * world
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated() / 2**20)
    med = statistics.median(times)
    result = {"mode": "ddp", "world": world, "batch_per_gpu": B, "ckpt": ckpt, "amp": str(amp),
              "step_ms": med, "samples_per_s": world * B / med * 1e3, "peak_mib_per_gpu": peaks}
    if rank == 0:
        print(json.dumps(result), flush=True)
    del ddp, model, opt
    torch.cuda.empty_cache()


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print("ddp world", world, torch.cuda.get_device_name(0), flush=True)
    # The reference's default (fp32, gradient checkpointing) and its fastest single-GPU mode
    # (bf16 autocast, no checkpointing).
    for ckpt, amp in [(True, None), (False, torch.bfloat16)]:
        run(rank, local, world, ckpt, amp)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
