"""TAEHV, the tiny video autoencoder: the model (model.TAEHV), its blocks (layers), its variants and weights (hub),
streamed decoding (stream) and the drop-in for diffusers' Wan pipelines (diffusers.AutoencoderTinyWan)."""
