"""Driver-side rollout control: what is in flight, what is buffered, and at which weight version.

``controller`` (batch generation, launch-time version stamps) and ``agentic`` (multi-turn
coordinator facade, completion-time version stamps) are the two controllers; both are
standard-library only so the training driver can import them without torch or ray.

This package ``__init__`` deliberately imports nothing: importing
``unirl_lightning.rollout.controller`` must never drag in the engine or worker stacks.
"""
