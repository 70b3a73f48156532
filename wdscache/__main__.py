"""``python -m wdscache`` is the ``wdscache`` command."""

from .cli import main

main()
