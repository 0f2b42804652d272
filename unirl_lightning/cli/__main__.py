"""``python -m unirl_lightning.cli``: the ``unirl-lightning`` command."""

from unirl_lightning.cli.verbs import main

main()
