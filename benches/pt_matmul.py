"""The training step's dense matmuls in PyTorch, beside `matmul-bench` (benches/src/matmul.rs)
in the same device call: same shapes, same ops, f32 with TF32 off (PyTorch's default, what the
reference's step runs) and on. One JSON object per measurement, like matmul-bench's.

Env: ROWS (default 62976), SPLITS (default 8,16,32,64).
"""
import json
import os

import torch

WARMUP, ITERS = 3, 20
LAYERS = [(128, 384), (128, 128), (128, 512), (512, 128)]


def time_ms(op):
    keep = [op() for _ in range(WARMUP)]
    torch.cuda.synchronize()
    keep.clear()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        keep.append(op())
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / ITERS


def main():
    m = int(os.environ.get("ROWS", 62976))
    splits = [int(s) for s in os.environ.get("SPLITS", "8,16,32,64").split(",")]
    dev = "cuda"
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        side = "torch_tf32" if tf32 else "torch_f32"
        for k, n in LAYERS:
            x = torch.randn(m, k, device=dev)
            w = torch.randn(k, n, device=dev) * 0.1
            b = torch.randn(n, device=dev) * 0.1
            dy = torch.randn(m, n, device=dev)
            flops = 2.0 * m * k * n
            shape = f"{m}x{k}x{n}"

            def report(op, ms, split=None, fl=flops):
                print(json.dumps({"side": side, "backend": "torch", "shape": shape, "op": op,
                                  "split": split, "pipelined_ms": ms,
                                  "tflops": fl / ms / 1e9 if fl else None}), flush=True)

            report("forward", time_ms(lambda: x @ w))
            report("forward+bias", time_ms(lambda: torch.addmm(b, x, w)))
            report("input_grad", time_ms(lambda: dy @ w.t()))
            report("weight_grad", time_ms(lambda: x.t() @ dy))
            for s in splits:
                report("weight_grad_split", time_ms(
                    lambda: (x.view(s, m // s, k).transpose(1, 2) @ dy.view(s, m // s, n)).sum(0)), s)
            report("bias_grad", time_ms(lambda: dy.sum(0)), fl=0)
            for s in splits:
                report("bias_grad_split_rows_first",
                       time_ms(lambda: dy.view(s, m // s, n).sum(1).sum(0)), s, fl=0)
                report("bias_grad_split_parts_first",
                       time_ms(lambda: dy.view(s, m // s, n).sum(0).sum(0)), s, fl=0)


if __name__ == "__main__":
    main()
