#!/usr/bin/env python3
"""Where the GPU sits idle: reads a kernel_timeline trace (tools/kernel_timeline) and prints
the busy and idle time of a window of it, the idle gaps grouped by the activities on either
side, and the busy time per kernel.

    python3 tools/timeline_gaps.py run.tsv [--skip-ms 2000] [--window-ms 1000] [--top 25] [--json out.json]

The window starts --skip-ms after the first activity (skip start-up and warm-up)."""
import argparse
import collections
import json
import re
import shutil
import subprocess


def demangled(names):
    """CUPTI records kernels' mangled names: binutils' c++filt turns them into C++ where it is
    installed (templates and anonymous namespaces kept apart), else they stay as they are."""
    names = sorted(set(names))
    if not shutil.which("c++filt"):
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return {n: (d if d else n) for n, d in zip(names, out)}


def short(name):
    name = name.replace("moetrain::", "").replace("<unnamed>::", "").replace("(anonymous namespace)::", "")
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"^void ", "", name)
    return name[:70]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--skip-ms", type=float, default=0.0)
    ap.add_argument("--window-ms", type=float, default=0.0, help="0: to the end")
    ap.add_argument("--last-ms", type=float, default=0.0, help="> 0: the window is the trace's last this many ms")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", help="also write the window's totals here (for scripts/profile-step)")
    args = ap.parse_args()
    rows = [line.rstrip("\n").split("\t") for line in open(args.trace)]
    rows = [p for p in rows if len(p) >= 5]
    names = demangled(p[4] for p in rows)
    acts = [(int(p[0]), int(p[1]), p[2], p[3], short(names[p[4]])) for p in rows]
    acts.sort()
    t0 = acts[0][0] + args.skip_ms * 1e6
    t1 = t0 + args.window_ms * 1e6 if args.window_ms > 0 else max(a[1] for a in acts)
    if args.last_ms > 0:
        t1 = max(a[1] for a in acts)
        t0 = t1 - args.last_ms * 1e6
    acts = [a for a in acts if a[0] >= t0 and a[1] <= t1]
    if not acts:
        raise SystemExit("no activity in the window")
    span = acts[-1][1] - acts[0][0]
    busy = 0
    gaps = collections.defaultdict(lambda: [0, 0])
    per_kernel = collections.defaultdict(lambda: [0, 0])
    cur_end, prev = acts[0][0], None
    for s, e, stream, kind, name in acts:
        per_kernel[name][0] += e - s
        per_kernel[name][1] += 1
        if s > cur_end and prev is not None:
            g = gaps[(prev, name)]
            g[0] += s - cur_end
            g[1] += 1
        if e > cur_end:
            busy += e - max(s, cur_end)
            cur_end = e
            prev = name
    idle = span - busy
    print(f"window {span / 1e6:.2f} ms: busy {busy / 1e6:.2f} ms, idle {idle / 1e6:.2f} ms "
          f"({100.0 * idle / span:.1f}%), {len(acts)} activities")
    print(f"\nidle gaps by the activities before and after (top {args.top}):")
    print(f"{'ms':>9} {'count':>6}  before -> after")
    for (a, b), (t, n) in sorted(gaps.items(), key=lambda x: -x[1][0])[: args.top]:
        print(f"{t / 1e6:9.3f} {n:6d}  {a} -> {b}")
    # Per stream, and the NCCL kernels' time against the union of everything else (the
    # exchange's time on the GPU, and how much of it ran under other work).
    per_stream = collections.defaultdict(int)
    for s, e, stream, kind, name in acts:
        per_stream[stream] += e - s
    print("\nbusy time per stream: " + ", ".join(f"{k}: {v / 1e6:.1f} ms" for k, v in sorted(per_stream.items())))
    def union(iv):
        out = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out
    nccl = union([(s, e) for s, e, _, _, n in acts if "nccl" in n.lower()])
    other = union([(s, e) for s, e, _, _, n in acts if "nccl" not in n.lower()])
    nccl_total = sum(e - s for s, e in nccl)
    hidden, j = 0, 0
    for s, e in nccl:
        while j < len(other) and other[j][1] <= s:
            j += 1
        k = j
        while k < len(other) and other[k][0] < e:
            hidden += max(0, min(e, other[k][1]) - max(s, other[k][0]))
            k += 1
    if nccl_total:
        print(f"NCCL kernels: {nccl_total / 1e6:.2f} ms in the window, {100.0 * hidden / nccl_total:.1f}% of it "
              f"under other kernels")
    print(f"\nbusy time per activity (top {args.top}; overlapping activities both count):")
    for name, (t, n) in sorted(per_kernel.items(), key=lambda x: -x[1][0])[: args.top]:
        print(f"{t / 1e6:9.3f} {n:6d}  {name}")
    if args.json:
        top_gap = max(gaps.items(), key=lambda x: x[1][0], default=(("", ""), [0, 0]))
        with open(args.json, "w") as f:
            json.dump({"window_ms": span / 1e6, "busy_ms": busy / 1e6, "idle_ms": idle / 1e6,
                       "idle_share": idle / span, "activities": len(acts),
                       "nccl_ms": nccl_total / 1e6, "nccl_hidden_share": hidden / nccl_total if nccl_total else 1.0,
                       "largest_gap": {"before": top_gap[0][0], "after": top_gap[0][1], "ms": top_gap[1][0] / 1e6,
                                       "count": top_gap[1][1]},
                       "top_kernels": [{"name": n, "ms": t / 1e6, "count": c}
                                       for n, (t, c) in sorted(per_kernel.items(), key=lambda x: -x[1][0])[:10]]},
                      f, indent=1)


if __name__ == "__main__":
    main()
