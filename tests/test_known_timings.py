"""The shipped figures of known GPU models (dispatch/known.py): which rows tuning still compiles and times, the
shipped file's integrity, and the tuning process honouring them (through the real child, with the fake row set)."""

from __future__ import annotations

import json

import pytest
import torch

import tuning_fakes
from taesd_fast import dispatch
from taesd_fast.dispatch import decide, known, store, table
from taesd_fast.dispatch.spec import Spec
from test_tuning_cpu import _conv, _data, _torch_row

pytestmark = pytest.mark.usefixtures("isolated_dispatch")
GPU = "Test GPU"


def _spec(n=1, h=32, w=32):
    return Spec("conv2d", "cuda:0", (n, 64, h, w), (64, 64, 3, 3), torch.float16, 1, True, False, True,
                "channels_last")


def _rows(*names):
    return [table.Row(n, "conv2d", None, kernel=n != "torch") for n in names]


@pytest.fixture
def figures(tmp_path, monkeypatch):
    """Write {call key: {row: ms}} for GPU as the known file the loader reads."""
    def write(entries: dict, gpu: str = GPU):
        path = tmp_path / f"known{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"measured": ["a test"], "gpus": {gpu: entries}}))
        monkeypatch.setenv(known.ENV, str(path))
    return write


def _names(rows):
    return [r.name for r in rows]


def test_rows_close_to_the_fastest_kernel_are_timed_at_most_two(figures):
    figures({known.call_key(_spec(), False): {"torch": 1.0, "a": 0.5, "b": 0.55, "c": 0.6, "d": 0.9}})
    rows, left_out = known.shortlist(GPU, _spec(), False, _rows("torch", "a", "b", "c", "d", "new"))
    assert _names(rows) == ["torch", "a", "b", "new"]  # c: third within 1.25x; d: 1.8x; new: not in the figures
    assert set(left_out) == {"c", "d"} and "1.25x the fastest kernel" in left_out["d"]


def test_no_kernel_is_timed_where_pytorch_won_clearly(figures):
    figures({known.call_key(_spec(), True): {"torch": 1.0, "a": 1.3}})
    rows, left_out = known.shortlist(GPU, _spec(), True, _rows("torch", "a"))
    assert _names(rows) == ["torch"] and "PyTorch" in left_out["a"]
    # graph and eager figures are apart: the eager call has none, so everything is timed
    assert _names(known.shortlist(GPU, _spec(), False, _rows("torch", "a"))[0]) == ["torch", "a"]


def test_a_new_size_uses_the_same_layers_nearest_size_within_the_limit(figures):
    figures({known.call_key(_spec(1, 32, 32), False): {"torch": 1.0, "a": 0.5, "b": 2.0},
             known.call_key(_spec(16, 64, 64), False): {"torch": 1.0, "a": 2.0, "b": 0.5}})
    rows = _rows("torch", "a", "b")
    assert _names(known.shortlist(GPU, _spec(2, 32, 32), False, rows)[0]) == ["torch", "a"]  # 2x the first
    assert _names(known.shortlist(GPU, _spec(8, 64, 64), False, rows)[0]) == ["torch", "b"]  # half the second
    assert _names(known.shortlist(GPU, _spec(1, 1024, 1024), False, rows)[0]) == ["torch", "a", "b"]  # > 4x from both
    other_layer = Spec("conv2d", "cuda:0", (1, 64, 32, 32), (32, 64, 3, 3), torch.float16, 1, True, False, True,
                       "channels_last")
    assert _names(known.shortlist(GPU, other_layer, False, rows)[0]) == ["torch", "a", "b"]


def test_unknown_gpu_and_switched_off_time_every_row(figures, monkeypatch):
    figures({known.call_key(_spec(), False): {"torch": 1.0, "a": 0.5, "b": 2.0}})
    rows = _rows("torch", "a", "b")
    assert known.shortlist("Another GPU", _spec(), False, rows) == (rows, {})
    monkeypatch.setenv(known.ENV, "0")
    assert known.shortlist(GPU, _spec(), False, rows) == (rows, {})


def test_the_shipped_file_names_real_rows_and_parses():
    data = json.loads(known.SHIPPED.read_text())
    assert data["measured"] and data["gpus"]
    names = {(r.kind, r.name) for r in table.ROWS}
    for gpu, entries in data["gpus"].items():
        assert entries, gpu
        for key, ms in entries.items():
            kind = key.split("|")[0]
            assert {(kind, n) for n in ms} <= names, (gpu, key)  # a renamed row would silently time everything
            layer, size = known._layer(key)
            assert size > 0 and layer.split("|")[1].startswith("c")
    # and it is read from the installed package by default
    assert known._source() == str(known.SHIPPED)


def test_the_tuning_process_leaves_out_what_lost_clearly_and_the_decision_says_why(fake_kernel, figures):
    x, w, b = _data(11)
    spec = Spec("conv2d", "cpu", tuple(x.shape), tuple(w.shape), x.dtype, 1, True, False, True, "nchw")
    figures({known.call_key(spec, False): {"torch": 1.0, "fake": 3.0}}, gpu="cpu")
    with torch.no_grad():
        _conv(x, w, b)
        assert dispatch.wait_for_tuning(timeout=60)
        y = _conv(x, w, b)
    assert torch.equal(y, _torch_row(x, w, b)) and tuning_fakes.CALLS == []
    assert not fake_kernel.exists()  # the tuning process timed nothing
    (entry,) = store.read_json(store.timings_path()).values()
    assert entry["ms"] == {} and "PyTorch" in entry["failed"]["fake"]
    (rec,) = decide.state.decided.values()
    assert rec.choice == "torch" and "PyTorch" in rec.skipped["fake"]
