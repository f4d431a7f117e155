"""Lip-sync decoding with TAESD: paste decoded face crops into a talking-head video (same as `taesd-fast lipsync`).

Round trip on the bundled offline weights (the face crops are encoded, then decoded) of the 3 s demo clip
examples/assets/sun_3s.mp4, or of the whole sun.mp4 (run from the repository root, after `pip install -e .[media]`):
    python examples/lipsync.py -o sun_lipsync.mp4
    python examples/lipsync.py ../shared/data/video/sun.mp4 -o sun_lipsync.mp4 --max-frames 50

Decode a lip-sync generator's latents ([N, 32, 32, 32] for the 256² face crops, key "latents") on a GPU:
    python examples/lipsync.py talk.mp4 --box 300,120,556,376 --latents faces.safetensors -o out.mp4 \\
        --device cuda --dtype float16 --batch-size 32

The same from Python:
    from taesd_fast import TAESD
    from taesd_fast.apps.lipsync import Box, lipsync_video
    model = TAESD.from_pretrained(encoder=False, device="cuda", dtype=torch.float16)
    stats = lipsync_video("talk.mp4", "out.mp4", model, box=Box(300, 120, 556, 376), latents="faces.safetensors")
    print(stats.summary())
"""

from __future__ import annotations

import argparse
import sys

from taesd_fast.apps.cli import add_lipsync_arguments, cmd_lipsync, run_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_lipsync_arguments(parser)
    return run_command(cmd_lipsync, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
