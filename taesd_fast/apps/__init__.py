"""The applications built on the library: the `taesd-fast` command (cli, video_cli, tune_cli, cli_support), the
lip-sync demo (lipsync, facebox), image/video and latents files (media, latents_io, output_files) and the
benchmarks (bench). Importing taesd_fast imports none of them."""
