"""``python -m relay_core`` is the ``relay`` command."""

from .cli import main

main()
