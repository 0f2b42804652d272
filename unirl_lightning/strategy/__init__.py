"""AsyncRolloutStrategy: Lightning's training strategy plus the rollout side of an RL loop.

The module says *what* is learned (its :class:`~unirl_lightning.modules.base.RolloutSpec`); the
strategy says *where and how* it runs (engine, Ray workers and their placement, weight transport). The
rollout side is the module family's :class:`~unirl_lightning.runtime.RolloutRuntime`, built once and
kept across ``fit``/``validate`` calls; the strategy holds Lightning's hooks and the sync verb, and
branches on no family nor placement: the placement's worker group class (Ray actors, or the hybrid
engine in this process) owns the connection its workers need (Ray's, for Ray workers). ``process_dataloader`` swaps in the runtime's loop.

Guarantees: ``max_staleness=0, max_inflight=1`` is synchronous on-policy training; no trained sample
is older than ``max_staleness`` versions; weights are pushed only while nothing is in flight; evaluation
never pushes nor changes the version. Every rank's rollout state goes into every checkpoint (atomic).
Workers are shut down on error, Ctrl-C, ``shutdown`` and exit. Callbacks depend on the strategy, never
the reverse. Only Lightning's public API is used.

Several ranks (DDP, FSDP): each drives its own runtime, workers and share of the prompts; rank 0 starts
(or joins) Ray, the others join it (``placement="hybrid"``: each rank has its engine in its own process). A sync is collective: every rank quiesces, pushes the full weights to
its workers, advances the same version at the same RL step, and a barrier ends it (a resume: same ranks).
"""

from unirl_lightning.strategy.mixin import CHECKPOINT_KEY, RolloutStrategyMixin
from unirl_lightning.strategy.strategies import (
    AsyncRolloutDDPStrategy,
    AsyncRolloutFSDPStrategy,
    AsyncRolloutStrategy,
)

__all__ = [
    "CHECKPOINT_KEY",
    "AsyncRolloutDDPStrategy",
    "AsyncRolloutFSDPStrategy",
    "AsyncRolloutStrategy",
    "RolloutStrategyMixin",
]
