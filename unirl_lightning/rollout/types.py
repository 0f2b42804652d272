"""Compatibility names: the rollout records (:mod:`unirl_lightning.rollout.records`, standard
library) and batches (:mod:`unirl_lightning.rollout.batches`, torch) under their former module."""

from unirl_lightning.rollout.batches import *  # noqa: F403
from unirl_lightning.rollout.records import *  # noqa: F403
from unirl_lightning.seeding import SEED_BITS, derive_seed, derive_seeds, global_seed  # noqa: F401
