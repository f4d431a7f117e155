"""TAESD: the model (model.TAESD), its variants' layer stacks (architecture), where their weights are (hub), exact
tiling (tiling, tile_memory), progress bars (progress) and the diffusers drop-in (diffusers.AutoencoderTinyFast)."""
