"""``python -m axonmpi``: the ``axonmpi`` command."""
import sys

from .cli import main

sys.exit(main())
