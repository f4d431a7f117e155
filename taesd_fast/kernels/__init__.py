"""The custom kernels, one module per dispatch row, named after the row: Triton (`triton_conv`, `triton_conv_tma`,
`triton_norm_split`), Gluon (`gluon_conv_rows`, `gluon_conv_tile`, `gluon_conv_up`, `gluon_conv_narrow`, the head's
`head_wgmma`), and CUDA C++ from csrc/ built with NVRTC (`cuda_conv_rows`, `simt_conv`, the head's `head_cuda` and
stencil). `rows.py` declares every row; the `conv_*` modules hold what the conv rows share (the contract, weight
packing, epilogue, launch). Nothing here is imported until a GPU call needs it."""
