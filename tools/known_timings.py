#!/usr/bin/env python3
"""Build taesd_fast/dispatch/known_timings.json (the figures that shorten first-use tuning on known GPU models,
see taesd_fast/dispatch/known.py) from timings files that tuning wrote (<cache dir>/dispatch/timings.json).

    python3 tools/known_timings.py TIMINGS.json [TIMINGS.json ...] --measured "H200, torch 2.11, main abc1234"
        [--out taesd_fast/dispatch/known_timings.json]

Entries of the files are merged into the output (a later file wins on the same GPU and call); calls with no timed
row are left out, and times are rounded to 4 significant digits. Only the rows' relative times matter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "taesd_fast" / "dispatch" / "known_timings.json"


def merge(known: dict, timings: dict) -> int:
    added = 0
    for key, entry in timings.items():
        gpu, _torch, _src, _method, call = key.split("|", 4)
        ms = {row: float(f"{t:.4g}") for row, t in entry.get("ms", {}).items()}
        if gpu != "cpu" and len(ms) > 1:
            known.setdefault(gpu, {})[call] = dict(sorted(ms.items()))
            added += 1
    return added


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timings", nargs="+", type=Path)
    ap.add_argument("--measured", required=True, help="where and how the figures were measured (GPU, torch, commit)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    data = json.loads(args.out.read_text()) if args.out.exists() else {"measured": [], "gpus": {}}
    for path in args.timings:
        print(f"{path}: {merge(data['gpus'], json.loads(path.read_text()))} calls")
    if args.measured not in data["measured"]:
        data["measured"].append(args.measured)
    args.out.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"wrote {args.out}: " + ", ".join(f"{gpu} {len(v)} calls" for gpu, v in data["gpus"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
