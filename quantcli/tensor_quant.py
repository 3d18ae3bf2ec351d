"""``quantcli.tensor_quant``: the import path DESIGN.md's public contract names (``from quantcli.tensor_quant
import ...``) for :mod:`quantcli.quant.tensor_quant`, where the quantize ops live. This module *is* that one
(the same module object, so every name, and ``tensor_quant``'s being callable, is the same); code in this
repository imports :mod:`quantcli.quant.tensor_quant` directly (tests/test_layering.py)."""

import sys

from quantcli.quant import tensor_quant

sys.modules[__name__] = tensor_quant
