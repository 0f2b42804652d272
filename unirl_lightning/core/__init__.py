"""The floor every room stands on: the seed rule, import-by-path, range checks, the settings' restricted
types, the timeline recorder, prompt rendering, and the setup rules that ``fit``, ``plan`` and the
strategy share (:mod:`~unirl_lightning.core.preflight`: each setting's Literal, declared once). The
standard library, torch and Lightning only; nothing of the package above."""
