"""``python -m trainforge.cli``: the same as the ``trainforge`` command."""

from trainforge.cli.main import app

app()
