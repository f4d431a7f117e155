"""Face boxes for the lip-sync pipeline, and the demo clip (no media dependencies, so the CLI can build its --help
without PyAV)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The first 3 s of shared/data/video/sun.mp4, shipped with the repository (not the wheel) for `taesd-fast lipsync`;
# parents[2]: taesd_fast/apps/ -> the checkout root.
DEMO_CLIP = Path(__file__).resolve().parents[2] / "examples" / "assets" / "sun_3s.mp4"


@dataclass(frozen=True)
class Box:
    """A face box in pixels: columns x0..x1-1, rows y0..y1-1."""

    x0: int
    y0: int
    x1: int
    y1: int

    @classmethod
    def parse(cls, text: str) -> Box:
        parts = text.replace(" ", "").split(",")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 4:
            raise ValueError(f"face box {text!r} should be four integers x0,y0,x1,y1 (pixels), e.g. 192,152,368,328")
        return cls(*values)

    @property
    def width(self) -> int:
        return self.x1 - self.x0

    @property
    def height(self) -> int:
        return self.y1 - self.y0

    def check_inside(self, width: int, height: int) -> None:
        if self.x1 <= self.x0 or self.y1 <= self.y0:
            raise ValueError(f"face box {self} is empty: need x0 < x1 and y0 < y1")
        if self.x0 < 0 or self.y0 < 0 or self.x1 > width or self.y1 > height:
            raise ValueError(f"face box {self} lies outside the {width}x{height} frame: need 0 <= x0 < x1 <= {width} "
                             f"and 0 <= y0 < y1 <= {height}")

    def __str__(self) -> str:
        return f"{self.x0},{self.y0},{self.x1},{self.y1}"


# The face in sun.mp4 and DEMO_CLIP (576x768), hairline to chin; found by viewing frames 0, 150, 350 and 540.
SUN_FACE_BOX = Box(192, 152, 368, 328)
