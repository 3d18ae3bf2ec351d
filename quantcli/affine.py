"""``quantcli.affine``: the import path DESIGN.md's public contract names (``from quantcli.affine import
...``) for :mod:`quantcli.quant.affine`, where the quantize ops live. This module *is* that one (the same
module object, so every name, and ``tensor_quant``'s being callable, is the same); code in this repository
imports :mod:`quantcli.quant.affine` directly (tests/test_layering.py)."""

import sys

from quantcli.quant import affine

sys.modules[__name__] = affine
