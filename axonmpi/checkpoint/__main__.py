"""``python -m axonmpi.checkpoint``: the checkpoint CLI."""
import sys

from .cli import main

sys.exit(main())
