#!/usr/bin/env python3
"""Reads a run's TensorBoard event files with TensorBoard's own reader (an external reference:
the tensorboard package, never a dependency of moetrain) and checks them against the run's
metrics.jsonl: every step's train/loss, val/loss where validated, and a tokens-per-expert
histogram per MoE layer whose counts add up to the experts.

    python3 tools/check_tensorboard.py RUN_DIR     # prints PASS or FAIL
"""
import json
import math
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main():
    run = sys.argv[1]
    lines = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
    ea = EventAccumulator(f"{run}/tb", size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    tags = ea.Tags()
    loss = {s.step: s.value for s in ea.Scalars("train/loss")}
    val = {s.step: s.value for s in ea.Scalars("val/loss")} if "val/loss" in tags["scalars"] else {}
    bad = []
    for m in lines:
        step = m["step"]
        if step not in loss or not math.isclose(loss[step], m["loss"], rel_tol=1e-6):
            bad.append(f"step {step}: train/loss {loss.get(step)} against {m['loss']}")
        if m.get("val_loss") is not None and not math.isclose(val.get(step, math.nan), m["val_loss"], rel_tol=1e-6):
            bad.append(f"step {step}: val/loss {val.get(step)} against {m['val_loss']}")
        for layer in m.get("moe", []):
            tag = f"moe/layer{layer['moe_layer']}/tokens_per_expert"
            hs = [h for h in ea.Histograms(tag) if h.step == step] if tag in tags["histograms"] else []
            if not hs:
                bad.append(f"step {step}: no histogram {tag}")
            elif hs[-1].histogram_value.num != len(layer["tokens_per_expert"]):
                bad.append(f"step {step}: {tag} holds {hs[-1].histogram_value.num} experts")
    print(f"{len(lines)} steps, {len(tags['scalars'])} scalar tags, {len(tags['histograms'])} histogram tags")
    for b in bad[:20]:
        print("  " + b)
    print("PASS" if not bad else "FAIL")
    sys.exit(0 if not bad else 1)


if __name__ == "__main__":
    main()
