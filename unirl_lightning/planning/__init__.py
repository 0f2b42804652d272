"""``unirl-lightning plan``: reading a recipe without running it (:mod:`~unirl_lightning.planning.plan`)
and its memory model (:mod:`~unirl_lightning.planning.memory`), from the setup rules of
:mod:`unirl_lightning.core.preflight` and the engine and weight-sync configs."""
