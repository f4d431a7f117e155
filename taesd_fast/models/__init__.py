"""The nn.Modules users call: TAESD (models.taesd), TAEHV (models.taehv) and the Wan 2.2 VAE output head
(models.head), with the pieces they share: the dispatched conv layers (models.layers), weight files
(models.weights_io) and Hub downloads (models.hub_files). Imports the runtime below it (graphs, dispatch,
validation), never the applications above it (taesd_fast.apps)."""
