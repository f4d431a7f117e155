"""The custom kernels, one module per dispatch row, named after the row (rows.py declares every row): Triton
(`triton_conv`, `triton_conv_tma`, `triton_mem_conv`, `triton_fused`, `triton_norm_split`), Gluon
(`gluon_conv_rows`, `gluon_conv_tile`, `gluon_conv_up`, `gluon_conv_narrow`, `gluon_fused`), CUDA C++ from csrc/
built with NVRTC (`cuda_conv_rows`, `cuda_conv_tiles`, `cuda_mem_conv`, `cuda_fused`, `simt_conv`) and the split
head (`split_bf16`: cuBLAS/cuDNN, then our NVRTC stencil). What rows share lives in modules named for what they
hold: the conv rows' `conv_*` (the contract, weight packing, epilogue, launch), the head rows' `head_*`
(`head_full_common`: the fused heads' checks, twin, driver and op; `head_stencil`; `head_g_layout`; `head_math`). A long device kernel sits beside its row as
`<row>_kernel`. One kernel is no row: `triton_frames`, TAEHV's output frames (clamp, unpatchify, uint8) in one
pass. Nothing here is imported until a GPU call needs it."""
