"""The Wan 2.2 VAE decoder's output head: the module (model.OutputHead) and its patch into diffusers'
AutoencoderKLWan (diffusers.patch_wan_vae, which needs diffusers)."""
