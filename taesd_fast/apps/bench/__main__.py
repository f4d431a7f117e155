"""`python -m taesd_fast.apps.bench [--sections conv,taesd,head,taehv] [--out FILE]`: see cli.py."""

from .cli import main

main(prog="python -m taesd_fast.apps.bench")
