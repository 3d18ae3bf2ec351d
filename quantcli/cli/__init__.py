"""The ``quantcli`` command line: parses, calls library functions, prints. Nothing else lives here.

One module per command (:mod:`~quantcli.cli.calibrate`, :mod:`~quantcli.cli.export`,
:mod:`~quantcli.cli.verify`, :mod:`~quantcli.cli.inspect`, :mod:`~quantcli.cli.analyze`), each reading parse
-> call the library -> render; :mod:`~quantcli.cli.options` declares the options several commands share
(single options and option groups), :mod:`~quantcli.cli.guard` turns errors into exit codes,
:mod:`~quantcli.cli.output` prints, :mod:`~quantcli.cli.entry` is the program (``main``). Heavy imports happen
inside the commands, so that ``quantcli --help`` starts fast.
"""

from quantcli.lazy import lazy_getattr

# loaded on first use, so that this package imports nothing when it loads (no import cycle through it)
_LAZY = {"app": "quantcli.cli.application", "main": "quantcli.cli.entry"}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr("quantcli.cli", _LAZY)
