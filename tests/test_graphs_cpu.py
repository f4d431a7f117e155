import pytest
import torch

from taesd_fast import TAESD, CUDAGraphed


def test_cuda_graph_needs_a_cuda_example():
    model = TAESD("taesd")
    with pytest.raises(ValueError, match=r"needs an example CUDA tensor"):
        CUDAGraphed(model.decode, torch.randn(1, 4, 8, 8))

