"""Custom ops (torch.library) over the NVRTC kernels in taesd_fast/csrc, each with a PyTorch twin."""
