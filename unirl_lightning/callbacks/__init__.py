"""Callbacks that decide *when* rollout-side things happen; the strategy does them.

They depend on the strategy (``RolloutCallback.setup`` checks it once), never the reverse: the
defaults an RL run needs come from ``RLModule.configure_callbacks``.
"""

from unirl_lightning.callbacks.base import RolloutCallback
from unirl_lightning.callbacks.completions import CompletionLogger
from unirl_lightning.callbacks.eval import RolloutEvalCallback
from unirl_lightning.callbacks.exit_checkpoint import CheckpointOnExit
from unirl_lightning.callbacks.export import ExportOnTrainEnd
from unirl_lightning.callbacks.progress import RLProgressBar, RLRichProgressBar
from unirl_lightning.callbacks.samples import SampleImageLogger
from unirl_lightning.callbacks.timeline import TimelineWriter
from unirl_lightning.callbacks.version_logger import WeightVersionLogger
from unirl_lightning.callbacks.weight_sync import WeightSyncCallback

__all__ = [
    "CheckpointOnExit",
    "CompletionLogger",
    "ExportOnTrainEnd",
    "RLProgressBar",
    "RLRichProgressBar",
    "RolloutCallback",
    "RolloutEvalCallback",
    "SampleImageLogger",
    "TimelineWriter",
    "WeightSyncCallback",
    "WeightVersionLogger",
]
