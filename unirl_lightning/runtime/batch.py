"""The batch runtime: one request per training step of prompts (autoregressive LLMs and diffusion).

Composes a :class:`~unirl_lightning.rollout.controller.BatchRolloutController` (launch-time version
stamps) and a :class:`~unirl_lightning.rollout.loop.RolloutLoop` with the rollout workers. The
scheduling policy of each policy family is declared here (:data:`SCHEDULING`), not by the module:

* ``token`` (causal LMs): launch first, then poll; any ``max_inflight``.
* ``diffusion``: poll first, and one request in flight (:data:`DIFFUSION_MAX_INFLIGHT_REASON`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unirl_lightning.core.preflight import continue_engine_error
from unirl_lightning.core.seeding import derive_seed
from unirl_lightning.rollout.controller import BatchRolloutController
from unirl_lightning.rollout.interrupts import chunked_launch
from unirl_lightning.rollout.loop import RolloutLoop, RolloutOrder
from unirl_lightning.rollout.records import RolloutRequest
from unirl_lightning.runtime.base import RolloutRuntime

__all__ = ["DIFFUSION_MAX_INFLIGHT_REASON", "SCHEDULING", "BatchRuntime", "Scheduling"]

DIFFUSION_MAX_INFLIGHT_REASON = (
    "a diffusion rollout result is large (trajectory latents of every SDE step), and with a second request "
    "in flight a launch can block the transfer of the previous result (the reference implementation "
    "measured ~150 s instead of ~8 s per rollout); with one request in flight the poll-first loop reaps "
    "every ready result before the next launch. Async overlap comes from max_staleness >= 1: the next "
    "request generates while this step trains"
)


@dataclass(frozen=True)
class Scheduling:
    """How a policy family's requests are scheduled: the loop's ``order``, and the most requests in
    flight it allows (None = no limit) with the reason a larger ``max_inflight`` is refused."""

    order: RolloutOrder
    max_inflight: int | None = None
    reason: str = ""


SCHEDULING: dict[str, Scheduling] = {
    "token": Scheduling("launch_first"),
    "diffusion": Scheduling("poll_first", max_inflight=1, reason=DIFFUSION_MAX_INFLIGHT_REASON),
}


class BatchRuntime(RolloutRuntime):
    """Batch rollouts: a request carries one step of prompts, split across the workers (see the module
    docstring); evaluation generates on the workers with a request of its own (``gen_id=-1``)."""

    @property
    def scheduling(self) -> Scheduling:
        return SCHEDULING[self.spec.family]

    signal: Any = None  # sync_mode="interrupt": the InterruptSignal of the requests in flight

    @property
    def interrupts(self) -> bool:
        """``sync_mode="interrupt"``: requests run in chunks and a sync interrupts and resumes them."""
        return self.settings.sync_mode == "interrupt"

    def check(self) -> None:
        if self.settings.sync_mode == "continue":
            error = continue_engine_error("continue", self.engine_config())
            if error is not None:
                raise ValueError(error)
        if self.interrupts and self.spec.family != "token":
            raise ValueError(
                f"sync_mode='interrupt' continues token completions from their partial ids, and a "
                f"{self.spec.family} policy has none: use sync_mode='quiesce' (or an LLM module)"
            )
        cap, max_inflight = self.scheduling.max_inflight, self.settings.max_inflight
        if cap is not None and max_inflight > cap:
            raise ValueError(
                f"max_inflight must be <= {cap} for a {self.spec.family} policy, got {max_inflight}: "
                f"{self.scheduling.reason}"
            )

    def _make_controller(self, state: dict[str, Any]) -> BatchRolloutController:
        launch = self.workers.generate
        if self.interrupts:
            from unirl_lightning.workers.signal import InterruptSignal

            if self.signal is None:
                self.signal = InterruptSignal.create()
            launch = chunked_launch(launch, self.settings.interrupt_chunk_tokens, self.signal)
        return BatchRolloutController(  # the loop (make_loop) sets how a launch completes
            launch,
            start_gen_id=state.get("next_gen_id", 0),
            start_weight_version=state.get("weight_version", 0),
        )

    def _quiesce(self, controller: BatchRolloutController) -> None:
        controller.quiesce(interrupt=self.interrupts)

    def _after_push(self, controller: BatchRolloutController) -> None:
        if self.interrupts:  # interrupted requests go on with the new weights (or are dropped as stale)
            controller.resume(self.settings.max_staleness)

    def make_loop(self, dataloader: Any, sync_interval: int) -> RolloutLoop:
        spec, settings = self.spec, self.settings

        def build_request(records: list[dict[str, Any]], gen_id: int) -> RolloutRequest:
            return RolloutRequest(
                records=records,
                n=spec.num_generations,
                sampling=spec.sampling,
                seed=derive_seed(settings.seed, settings.rank, gen_id),  # never another request's
                gen_id=gen_id,
            )

        return self._restore(
            RolloutLoop(
                dataloader,
                self.controller,
                collate=spec.collate,
                build_request=build_request,
                max_staleness=settings.max_staleness,
                max_inflight=settings.max_inflight,
                sync_interval=sync_interval,
                order=self.scheduling.order,
                extra_stats=self.stats,
                filter_groups=spec.filter_groups,
                max_filter_launches_per_step=spec.max_filter_launches_per_step,
                launch_unit=settings.launch_unit,
            )
        )

    def evaluate(self, records: list[dict[str, Any]], sampling: Any, n: int, seed: int) -> list[list[Any]]:
        request = RolloutRequest(records=records, n=n, sampling=sampling, seed=seed, gen_id=-1)
        result = self.workers.generate(request).result()
        self.eval_reward_timeouts += result.reward_timeouts
        return result.groups

    def shutdown(self) -> None:
        super().shutdown()
        if self.signal is not None:
            self.signal.close()
            self.signal = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        ctl = self.controller
        if ctl is not None and ctl.inflight == 0 and ctl.buffered == 0:
            # a live, idle controller adopts the checkpoint's ledger so that stamps stay comparable
            self.controller = self._make_controller(state)
