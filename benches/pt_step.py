#!/usr/bin/env python3
"""The reference's optimiser step on a batch of chosen ASV counts.

shared/bench/pt_reference_bench.py times the reference's step on one fixed
batch (8 samples, 120-500 ASVs, 2,000 in all). Real oral2550 batches are about
five times lighter (median 45 ASVs a sample), so this reuses that script's
step with `STEP_ASVS` (comma-separated ASVs per sample) instead, for a
comparison with `aam-dev step --asvs-per-sample` on the same counts.

Env: AAM_SRC (folder holding the reference `aam` package), BENCH (path of
pt_reference_bench.py), STEP_ASVS, PT_VARIANTS ("attn:ckpt ..." with ckpt 1/0;
default: the reference's default flags and its fastest f32 setting).
Prints one JSON object per variant.
"""
import importlib.util
import json
import os

import torch

spec = importlib.util.spec_from_file_location(
    "pt_reference_bench", os.environ.get("BENCH", ".carry/pt_reference_bench.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

asvs = [int(n) for n in os.environ["STEP_ASVS"].split(",")]
if len(asvs) != bench.B:
    raise SystemExit(f"STEP_ASVS: {len(asvs)} samples given; the reference model's batch is {bench.B}")
bench.ASVS_PER_SAMPLE = asvs  # make_batch reads it when called
for variant in os.environ.get("PT_VARIANTS", "mem_efficient:1 mem_efficient:0 sdpa:0").split():
    attn, ckpt = variant.split(":")
    try:
        r = bench.train_step_bench(attn, ckpt == "1")
    except Exception as e:  # an SDPA backend the build lacks: say so, go on
        r = {"attn": attn, "ckpt": ckpt == "1", "error": str(e).splitlines()[0][:160]}
    r["asvs_per_sample"] = asvs
    print(json.dumps(r), flush=True)
    torch.cuda.empty_cache()
