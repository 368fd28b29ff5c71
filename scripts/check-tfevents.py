#!/usr/bin/env python3
"""Reads a run's TensorBoard events with TensorBoard's own reader and checks them against its
metrics.jsonl: every numeric field of every iteration is one tag's float32 scalar at step =
iteration, and every tag is one field's (which field gets which tag, the Rust tests check).
A resumed run's iterations that ran twice must show once, as the last run wrote them.
Needs `pip install tensorboard`.

    scripts/check-tfevents.py rollplex-out
"""
import json
import math
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main(out):
    acc = event_accumulator.EventAccumulator(out, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    seen = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    want = {}
    with open(f"{out}/metrics.jsonl") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                it = rec.pop("iteration")
                for k, v in rec.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                        want.setdefault(k, {})[it] = f32(v)

    def series(d):
        return sorted(sorted(s.items()) for s in d.values())

    twice = [t for t in seen if len(acc.Scalars(t)) != len(seen[t])]
    for t in twice:
        print(f"{t}: a step shows twice", file=sys.stderr)
    bad = series(want) != series(seen) or any("/" not in t for t in seen) or twice
    if bad:
        for k, s in sorted(want.items()):
            if s not in seen.values():
                print(f"{k}: no tag holds {sorted(s.items())[:5]}...", file=sys.stderr)
        for t, s in sorted(seen.items()):
            if s not in want.values() or "/" not in t:
                print(f"{t}: no field holds {sorted(s.items())[:5]}...", file=sys.stderr)
    n = sum(len(v) for v in want.values())
    print(f"{out}: {len(want)} fields, {n} values; TensorBoard reads "
          + (f"{len(seen)} tags differently" if bad else f"the same under {len(seen)} tags"))
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
