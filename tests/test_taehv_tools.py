"""The TAEHV tools on the CPU at a tiny size, so they cannot rot between GPU sessions: the per-layer profile
(tools/profile_taehv.py) covers every conv of the decoder in its groups, and the upstream peer
(tools/bench_upstream_taehv.py) refuses a wrong path in one line and, where a copy of upstream's taehv.py is at hand
(TAEHV_UPSTREAM, or .upstream/taehv.py, which git ignores), runs against it. Upstream's file is never part of the
repository, so that test exists only where the copy does (it is not collected otherwise)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from test_tools_cpu import TOOLS, load_tool

from taesd_fast.apps.bench.taehv import random_decoder

UPSTREAM = Path(os.environ.get("TAEHV_UPSTREAM", Path(__file__).resolve().parents[1] / ".upstream" / "taehv.py"))


def _table(text: str) -> dict[str, list[str]]:
    """Markdown table rows of a report: first cell -> the other cells."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set(line) <= set("|-") and cells[0] != "group":
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("variant", ["taew2_2", "taehv1_5_super"])
def test_profile_runs_on_cpu_and_counts_every_conv(variant, tmp_path, monkeypatch, capsys):
    profile = load_tool(TOOLS / "profile_taehv.py")
    monkeypatch.setenv("OUT", str(tmp_path))
    profile.main(["--device", "cpu", "--small", "--runs", "2", "--variant", variant])
    printed = capsys.readouterr().out
    report = (tmp_path / f"profile_taehv_{variant}.md").read_text()
    assert report.strip() in printed
    rows = _table(report)
    groups = {k: v for k, v in rows.items() if not k.startswith(("**", "other"))}
    assert len(groups) == 3 * 3 + 2 and "**total**" in rows  # 3 stages x (blocks, TGrow, conv) + first + last
    assert all(int(v[1]) >= 1 and float(v[6]) > 0 for v in groups.values()), groups  # calls, GFLOP
    # The groups' FLOPs add up to PyTorch's count of the whole decode: no conv is left out or counted twice.
    from torch.utils.flop_counter import FlopCounterMode

    model = random_decoder(variant)
    side = model.space_upscale
    z = torch.randn(1, profile.SMALL["latents"], model.latent_channels, *(s * model.patch_size // side
                                                                           for s in profile.SMALL["size"]))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.decode_video(z)
    assert float(rows["**total**"][6]) == pytest.approx(counter.get_total_flops() / 1e9, rel=1e-3)


def test_profile_lists_the_kernels_of_one_call(tmp_path, monkeypatch):
    """--kernels N: a second table of the N costliest kernels (on the CPU: operators) of one call, then the rest."""
    profile = load_tool(TOOLS / "profile_taehv.py")
    monkeypatch.setenv("OUT", str(tmp_path))
    profile.main(["--device", "cpu", "--small", "--runs", "1", "--variant", "taew2_1", "--kernels", "3"])
    report = (tmp_path / "profile_taehv_taew2_1.md").read_text()
    table = report.split("| kernel | calls | ms | share |", 1)[1].splitlines()[2:]
    assert len(table) == 4 and table[-1].startswith("| `(") and "others)`" in table[-1], table
    assert "aten::" in table[0] and all(float(row.split("|")[3]) >= 0 for row in table), table
    shares = [float(row.split("|")[4].strip().rstrip("%")) for row in table]
    assert shares[0] >= shares[1] >= shares[2] and abs(sum(shares) - 100) < 0.5, shares


def test_profile_times_the_tgrow_fold_in_the_conv_group(monkeypatch):
    """Where grow_conv folds TGrow into the conv after it (with kernels on CUDA; forced here), neither module's
    forward runs: the recorder times each such call whole, in the conv's group, and no TGrow mark is left; once
    removed, it puts grow_conv back."""
    from taesd_fast.models.taehv import layers, sequence

    profile = load_tool(TOOLS / "profile_taehv.py")
    model = random_decoder("taew2_1")
    units = profile.group_units(model.decoder)
    real = sequence.grow_conv
    monkeypatch.setattr(sequence, "grow_conv", real)  # put back at teardown even if an assertion fails first
    rec = profile.Recorder(units, cuda=False)
    monkeypatch.setattr(layers, "_foldable", lambda *a: True)
    with torch.no_grad():
        model.decode_video(torch.randn(1, 2, model.latent_channels, 4, 6))
    labels = [label for label, _, _ in rec.marks]
    convs = [label for label in units.values() if profile.FOLDED in label]
    assert len(convs) == 3 and all(labels.count(label) == 1 for label in convs), labels
    assert not any("TGrow" in label and profile.FOLDED not in label for label in labels), labels
    assert all(end >= start for _, start, end in rec.marks)
    rec.remove()
    assert sequence.grow_conv is real


def test_profile_ncu_window_needs_cuda(capsys):
    """--ncu-window brackets one call for Nsight Compute; without a CUDA device it stops with a one-line error."""
    profile = load_tool(TOOLS / "profile_taehv.py")
    with pytest.raises(SystemExit) as stop:
        profile.main(["--device", "cpu", "--small", "--step", "--ncu-window"])
    assert stop.value.code == 2
    assert "--ncu-window needs a CUDA device (Nsight Compute profiles GPU kernels), got --device cpu" in \
        capsys.readouterr().err


def test_profile_of_the_streaming_step_counts_one_step(tmp_path, monkeypatch):
    """--step: the groups cover one decode_step of one latent frame (its FLOPs are PyTorch's count of that step)."""
    profile = load_tool(TOOLS / "profile_taehv.py")
    monkeypatch.setenv("OUT", str(tmp_path))
    profile.main(["--device", "cpu", "--small", "--runs", "1", "--variant", "taew2_1", "--step", "--uint8"])
    report = (tmp_path / "profile_taehv_taew2_1_step.md").read_text()
    assert "decode_step (uint8): 1 latent frame -> (4, 3, 32, 48)" in report, report.splitlines()[0]
    from torch.utils.flop_counter import FlopCounterMode

    model = random_decoder("taew2_1")
    z = torch.randn(1, model.latent_channels, 4, 6)
    with torch.no_grad():
        _, state = model.decode_step(z)
        with FlopCounterMode(display=False) as counter:
            model.decode_step(z, state)
    assert float(_table(report)["**total**"][6]) == pytest.approx(counter.get_total_flops() / 1e9, rel=1e-3)
    with pytest.raises(SystemExit):
        profile.main(["--device", "cpu", "--small", "--uint8"])  # --uint8 without --step


def test_upstream_tool_refuses_a_wrong_path(tmp_path):
    tool = load_tool(TOOLS / "bench_upstream_taehv.py")
    with pytest.raises(SystemExit, match=r"^error: .* is not a file; pass the path of upstream's taehv.py"):
        tool.main([str(tmp_path / "nope.py"), "--device", "cpu"])
    (tmp_path / "other.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match=r"^error: .* has no TAEHV class"):
        tool.main([str(tmp_path / "other.py"), "--device", "cpu"])
    with pytest.raises(SystemExit, match="unknown \\['nonesuch'\\]"):
        tool.main([str(tmp_path / "other.py"), "--workloads", "nonesuch"])


if UPSTREAM.is_file():

    def test_upstream_tool_against_upstream_on_cpu(tmp_path, monkeypatch, capsys):
        """Upstream and taesd_fast with the same weights agree (fp32: to rounding), and the table is written."""
        tool = load_tool(TOOLS / "bench_upstream_taehv.py")
        monkeypatch.setenv("OUT", str(tmp_path))
        tool.main([str(UPSTREAM), "--device", "cpu", "--small", "--no-compile", "--workloads", "taew2_2-13"])
        rows = [line for line in (tmp_path / "upstream_taehv.md").read_text().splitlines() if "| taew2_2-13" in line]
        methods = {re.split(r"\s*\|\s*", r.strip("| "))[1]: re.split(r"\s*\|\s*", r.strip("| ")) for r in rows}
        ours = [f"taesd_fast {call}{kind}" for call in ("decode_video", "encode_video")
                for kind in ("", ", no graphs", ", PyTorch rows")]
        assert set(methods) == {"upstream eager", "upstream channels_last", "upstream eager encode_video", *ours}
        for method in ours:
            ms, _host, _peak, max_abs, rel = methods[method][2:7]
            assert float(ms) > 0 and float(max_abs) < 1e-5 and float(rel) < 1e-5, methods[method]
        assert "taesd_fast encode_video" in capsys.readouterr().out
