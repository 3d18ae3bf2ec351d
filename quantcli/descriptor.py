"""``quantcli.descriptor``: the import path DESIGN.md's layout names for :mod:`quantcli.quant.descriptor`
(``QuantDescriptor``, ``ScaledQuantDescriptor``). This module *is* that one (the same module object, so every
name is the same); code in this repository imports :mod:`quantcli.quant.descriptor` directly
(tests/test_layering.py)."""

import sys

from quantcli.quant import descriptor

sys.modules[__name__] = descriptor
