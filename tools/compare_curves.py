#!/usr/bin/env python3
"""Compare two training runs' loss curves (metrics.jsonl files that `moetrain train` writes).

    python3 tools/compare_curves.py runs/cpu/metrics.jsonl runs/gpu/metrics.jsonl [--every 100] [--window 50]

Prints a Markdown table: the training loss averaged over `--window` steps ending at every
`--every`-th step, and the validation loss where both runs evaluated, for run A, run B and
B - A; then the largest gaps. Exits non-zero when the runs differ by more than a BF16
training run is expected to (`--max-train-gap`, `--max-val-gap`: absolute nats on the
windowed training loss and on each validation loss; `--max-final-rel`: relative, on the last step's
windowed training and validation losses), or when they cover different steps.
Only the standard library: it runs wherever python3 does.
"""
import argparse
import json
import sys


def load(path):
    rows = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not a JSON line ({e})")
            if "step" not in r or "loss" not in r:
                sys.exit(f"{path}:{n}: expected the keys 'step' and 'loss'")
            rows[int(r["step"])] = r
    if not rows:
        sys.exit(f"{path}: no metrics lines")
    return rows


def windowed(rows, step, window):
    xs = [rows[s]["loss"] for s in range(step - window + 1, step + 1) if s in rows]
    return sum(xs) / len(xs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", help="metrics.jsonl of run A (the reference, e.g. the CPU run)")
    p.add_argument("b", help="metrics.jsonl of run B (e.g. the GPU run)")
    p.add_argument("--every", type=int, default=100, help="table row every N steps")
    p.add_argument("--window", type=int, default=50, help="steps averaged into each training-loss entry")
    p.add_argument("--max-train-gap", type=float, default=0.05, help="largest allowed |B - A| of the windowed loss")
    p.add_argument("--max-val-gap", type=float, default=0.05, help="largest allowed |B - A| of a validation loss")
    p.add_argument("--max-final-rel", type=float, default=None,
                   help="largest allowed |B - A| / A of the last step's windowed training and validation losses")
    args = p.parse_args()
    a, b = load(args.a), load(args.b)
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))
        sys.exit(f"the runs cover different steps ({len(a)} and {len(b)} lines; first unmatched step {only[0]})")
    last = max(a)
    print("| step | train A | train B | B - A | (B - A) / A | val A | val B | B - A | (B - A) / A |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst_train = worst_val = 0.0
    for step in sorted(a):
        va, vb = a[step].get("val_loss"), b[step].get("val_loss")
        if (va is None) != (vb is None):
            sys.exit(f"step {step}: only one run has a validation loss")
        if va is not None:
            worst_val = max(worst_val, abs(vb - va))
        if step >= args.window:
            worst_train = max(worst_train, abs(windowed(b, step, args.window) - windowed(a, step, args.window)))
        if step % args.every == 0 or step == 1 or step == last:
            ta, tb = windowed(a, step, min(args.window, step)), windowed(b, step, min(args.window, step))
            val = f"{va:.4f} | {vb:.4f} | {vb - va:+.4f} | {(vb - va) / va:+.3%}" if va is not None else "| | |"
            print(f"| {step} | {ta:.4f} | {tb:.4f} | {tb - ta:+.4f} | {(tb - ta) / ta:+.3%} | {val} |")
    print()
    if 1 in a:
        print(f"step 1 loss: A {a[1]['loss']:.6f}, B {b[1]['loss']:.6f} (|B - A| = {abs(b[1]['loss'] - a[1]['loss']):.2e})")
    print(f"largest |B - A| of the {args.window}-step training loss: {worst_train:.4f} (allowed {args.max_train_gap})")
    print(f"largest |B - A| of a validation loss: {worst_val:.4f} (allowed {args.max_val_gap})")
    ok = worst_train <= args.max_train_gap and worst_val <= args.max_val_gap
    if args.max_final_rel is not None:
        w = min(args.window, last)
        ta, tb = windowed(a, last, w), windowed(b, last, w)
        rels = [abs(tb - ta) / ta]
        if a[last].get("val_loss") is not None:
            rels.append(abs(b[last]["val_loss"] - a[last]["val_loss"]) / a[last]["val_loss"])
        print(f"step {last}: relative |B - A| of the training loss {rels[0]:.3%}"
              + (f", of the validation loss {rels[1]:.3%}" if len(rels) > 1 else "")
              + f" (allowed {args.max_final_rel:.3%})")
        ok = ok and max(rels) <= args.max_final_rel
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
