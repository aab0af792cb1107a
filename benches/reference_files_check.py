#!/usr/bin/env python3
"""Reads a run's reference-format files with the reference's own tools:
PyTorch loads checkpoints/best_model.pt (and pretrained_encoder.pt or
final_model.pt) with weights_only=True, every tensor equal to the run's
best.safetensors (last.safetensors for final_model.pt); TensorBoard's
EventAccumulator reads tensorboard/ and finds the reference's tags, with the
epoch values of metrics.csv.

Usage: python3 benches/reference_files_check.py <output-dir> [<output-dir> ...]
Needs: torch, safetensors, tensorboard. Exits 1 on any mismatch.
"""
import csv
import math
import os
import sys

import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def check_weights(pt_path, st_path, trainer):
    loaded = torch.load(pt_path, map_location="cpu", weights_only=True)
    state = loaded["model_state_dict"] if trainer else loaded
    reference = {k[len("model."):]: v for k, v in load_file(st_path).items()
                 if k.startswith("model.")}
    assert set(state) == set(reference), (pt_path, set(state) ^ set(reference))
    for k, v in state.items():
        assert v.dtype == torch.float32 and torch.equal(v, reference[k]), (pt_path, k)
    extra = f", epoch {loaded['epoch']}, aam_rs metadata {len(loaded['aam_rs'])} chars" if trainer else ""
    print(f"  {os.path.basename(pt_path)}: {len(state)} tensors equal to "
          f"{os.path.basename(st_path)}{extra}")


def check_tensorboard(run):
    acc = EventAccumulator(os.path.join(run, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    with open(os.path.join(run, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    for key in ("total_loss",):
        events = acc.Scalars(f"train/{key}")
        assert [e.step for e in events] == [int(r["epoch"]) + 1 for r in rows], key
        for e, r in zip(events, rows):
            assert math.isclose(e.value, float(r[f"train_{key}"]), rel_tol=1e-6), (key, e, r)
    steps = acc.Scalars("step/total_loss")
    print(f"  tensorboard: {len(tags)} scalar tags ({', '.join(sorted(tags)[:6])}, ...), "
          f"{len(rows)} epochs equal to metrics.csv, {len(steps)} step losses")


def main():
    for run in sys.argv[1:]:
        print(run)
        ck = os.path.join(run, "checkpoints")
        check_weights(os.path.join(ck, "best_model.pt"), os.path.join(ck, "best.safetensors"), True)
        if os.path.exists(os.path.join(run, "pretrained_encoder.pt")):
            check_weights(os.path.join(run, "pretrained_encoder.pt"),
                          os.path.join(ck, "best.safetensors"), False)
        if os.path.exists(os.path.join(run, "final_model.pt")):
            check_weights(os.path.join(run, "final_model.pt"),
                          os.path.join(ck, "last.safetensors"), True)
        check_tensorboard(run)
    print("ok")


if __name__ == "__main__":
    main()
