"""``python -m axonmpi.checkpoint``: the checkpoint CLI, with the model export formats of :mod:`axonmpi.interop`
(an entry point: nothing imports it, so the checkpoint package itself still knows no model)."""
import sys

from ..interop import EXPORT_FORMATS
from .cli import main

sys.exit(main(formats=EXPORT_FORMATS))
