"""PyTorch masked attention at AAM's two shapes, forward and forward+backward,
for every SDPA backend: the baseline `attention-bench` is compared with in the
same run on the same GPU (docs/performance.md). Inputs match `attention-bench`:
ASV level 2048x4x151x32 with 400 rows 100 long, sample level 8x4x1024x32 with
valid slots 120/250/80/400/300/150/500/200. Forward+backward differentiates
`out * w` seeded with ones (dO = w), as `attention-bench` does with Burn's
`backward()`: no scalar loss, whose reduction is not attention (Burn's sum of
the sample level's 1M bf16 elements alone took ~47 us under Nsight Compute).
"""
import json
import statistics

import torch
import torch.nn.functional as F

DEV = "cuda"
WARMUP, ITERS = 5, 30
BACKENDS = {
    "math": torch.nn.attention.SDPBackend.MATH,
    "mem_efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
    "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
    "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
}


def shapes():
    asv = torch.tensor([100 if (i * 7919) % 2048 < 400 else 151 for i in range(2048)], device=DEV)
    samp = torch.tensor([120, 250, 80, 400, 300, 150, 500, 200], device=DEV)
    return [("asv[2048x4x151x32]", 2048, 4, 151, 32, asv), ("sample[8x4x1024x32]", 8, 4, 1024, 32, samp)]


def timed(fn):
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(ITERS):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        fn()
        en.record()
        torch.cuda.synchronize()
        ts.append(st.elapsed_time(en))
    return statistics.median(ts)


def main():
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__}), flush=True)
    for name, n, h, t, d, lengths in shapes():
        mask = (torch.arange(t, device=DEV)[None, :] < lengths[:, None])[:, None, None, :]
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator(device=DEV).manual_seed(1)
            q, k, v, w = (torch.randn(n, h, t, d, device=DEV, dtype=dtype, generator=g) for _ in range(4))
            ones = torch.ones_like(w)
            for bname, be in BACKENDS.items():
                row = {"shape": name, "dtype": str(dtype).split(".")[-1], "backend": bname}
                try:
                    with torch.nn.attention.sdpa_kernel([be]):
                        row["forward_ms"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
                        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

                        def step():
                            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)
                            torch.autograd.grad(out * w, (qg, kg, vg), grad_outputs=ones)

                        row["forward_backward_ms"] = timed(step)
                except Exception as e:  # a backend that refuses the mask or dtype
                    row["error"] = str(e).splitlines()[0][:120]
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
