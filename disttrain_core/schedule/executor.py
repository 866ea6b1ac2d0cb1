"""Run a schedule for real: this rank's actions, in order, across processes.

* ``F`` runs a stage forward; what it sends (hidden states, image embeddings,
  generation queries) goes to the next stage -- handed over in memory when that
  stage runs on this process, otherwise sent -- and the loss terms it computes
  (the LLM's, the generator's) join the backward.
* ``B`` runs the stage backward from its loss terms and the gradient received for
  what it sent, and passes the input gradient to the previous stage.
* ``I`` / ``W`` split that backward: ``I`` computes only the input gradient (what
  the previous stage waits for), ``W`` later computes the weight gradients from
  the intermediate gradients ``I`` kept (torch.distributed.pipelining's
  ``stage_backward_input``/``stage_backward_weight`` do the graph surgery). That
  split is exact only when every weight reaches the stage outputs through the stage
  input; a stage into which data enters directly (the first stage, the diffusion
  generator with its noisy latents and timesteps) declares
  ``splittable_backward = False`` and its ``I`` runs the whole backward, its ``W``
  then having nothing left to do. Results are exact either way.

Who talks to whom is the broker's business (parallel/broker.py): a tensor may go to
several ranks in row pieces (different data-parallel sizes on the two sides) and
arrive from several. Every rank knows the whole schedule and the routing, so it
plans its step's transfers before running it (transfers.py): before each action
it posts the receives the action needs (one call per source, on that source's
channel to this rank, preceded by whatever the source sends earlier) and waits
on every handle; right after an action it posts one send per target on its own
channel to that target. Sends are waited for at the end of the step. This is
the order ``validate_schedule`` replays under NCCL's rules before launch. Shapes
are computed locally (rows from the microbatch, row shapes from the stages), so
no metadata travels.

Gradients accumulate in ``param.grad`` over the microbatches; the loss terms are
already normalized by the global batch, so no rescaling happens here. With a
``grad_sync`` (comm/engine.py) the executor tells it, just before a stage's last
backward of the step, that the gradients about to be produced are final, so their
reduction can start while the rest of the backward runs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.clock import DeviceClock
from ..base.torch_compat import split_backward
from ..comm.p2p import Channels, wait_all
from .actions import Action, Kind, Schedule
from .simulator import TimedAction
from .transfers import ACT, GRAD, Routing, Step, plan_rank

stage_backward_input, stage_backward_weight = split_backward()

# A microbatch is opaque here: each stage module receives its own (data.batch.Batch in training).
Microbatch = Any


@dataclass
class StepRecord:
    """What one step did on this rank: loss sums (on the device) and, when recorded, timed actions."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    timeline: list[TimedAction] = field(default_factory=list)
    origin: float = 0.0  # host time.perf_counter() the timeline's times are relative to
    pending_sums: Callable[[], dict[str, torch.Tensor]] | None = None  # sums still being reduced across ranks

    def resolve(self) -> StepRecord:
        """The loss sums once reductions in flight are done (on a GPU: queued behind them, no host wait)."""
        if self.pending_sums is not None:
            self.sums, self.pending_sums = self.pending_sums(), None
        return self


class PipelineExecutor:
    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, torch.nn.Module],
        row: int,
        rank: int,
        routing: Routing,
        channels: Channels | None,
        device: torch.device,
        boundary_dtype: torch.dtype = torch.float32,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
    ):
        self.schedule = schedule
        self.stages = stages
        self.row = row
        self.rank = rank
        self.routing = routing
        self.channels = channels  # None only when no stage boundary leaves this process
        self.device = device
        self.dtype = boundary_dtype  # on the wire; a receiving stage computes in its parameters' dtype
        self.autocast = autocast
        self.clock = DeviceClock(device)
        self.grad_sync = None  # set by the engine: begin_step() / arm(stage) / grads_ready(params)
        # A schedule of another microbatch count, for a step of that many (set by an engine whose count varies:
        # a fault-tolerant job's replica group takes a share of the step that depends on its quorum)
        self.schedule_for: Callable[[int], Schedule] | None = None
        self._use(schedule)

    def _use(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.last_stage = schedule.num_stages - 1
        self.my_actions = schedule.compute(self.row)
        # Per stage, the position of the last action that accumulates weight gradients: after it they are final.
        self.final_backward: dict[int, int] = {}
        for index, action in enumerate(self.my_actions):
            if self._accumulates_weight_grads(action):
                self.final_backward[action.stage] = index

    def _fit(self, count: int) -> None:
        if count != self.schedule.num_microbatches and self.schedule_for is not None:
            self._use(self.schedule_for(count))

    def _accumulates_weight_grads(self, action: Action) -> bool:
        if action.kind == Kind.B:
            return True
        split = getattr(self.stages[action.stage], "splittable_backward", False)
        return (action.kind == Kind.I and not split) or (action.kind == Kind.W and split)

    # -------------------------------------------------------------------- step
    def run(
        self, microbatches: list[Microbatch], loss_fn: Callable[[dict], torch.Tensor], record: bool = False
    ) -> StepRecord:
        """One optimizer step's actions. Loss sums stay on the device (read them at logging steps only)."""
        self._fit(len(microbatches))
        plan = plan_rank(self.schedule, self.routing, self.row, self.rank)  # image counts change every step
        state = _StepState(self, microbatches)
        result = StepRecord()
        sums: dict[str, torch.Tensor] = {}
        origin = self.clock.anchor() if record else 0.0
        stamps = []
        if self.grad_sync is not None:
            self.grad_sync.begin_step()
        for index, step in enumerate(plan):
            state.receive(step)  # post this action's receives (and earlier pieces of the same channels), wait
            started = self.clock.stamp() if record else None
            action = step.action
            final = self.final_backward.get(action.stage) == index
            if final and self.grad_sync is not None:
                self.grad_sync.arm(action.stage)
            produced = None
            if action.kind == Kind.F:
                produced = self._forward(state, action, loss_fn, sums)
            elif action.kind in (Kind.B, Kind.I):
                produced = self._backward(state, action, split=action.kind == Kind.I)
            elif action.kind == Kind.W:
                self._weight(state, action)
                if final and self.grad_sync is not None:
                    self.grad_sync.grads_ready(p for p in self.stages[action.stage].parameters() if p.requires_grad)
            if produced is not None:
                state.send(step, produced)
            if record:
                stamps.append((action, started, self.clock.stamp()))
        state.finish()
        result.origin = origin
        result.sums = sums
        result.timeline = [
            TimedAction(self.row, action, self.clock.seconds(a) - origin, self.clock.seconds(b) - origin)
            for action, a, b in stamps
        ]
        return result

    def evaluate(self, microbatches: list[Microbatch]) -> dict[str, torch.Tensor]:
        """The loss sums of ``microbatches`` without a backward: the schedule's forwards in its order (no
        gradient actions, so no gradient transfers), under ``torch.no_grad``; nothing is kept for later."""
        self._fit(len(microbatches))
        forward_only = Schedule(
            f"{self.schedule.name} (forward only)",
            self.schedule.num_microbatches,
            self.schedule.stage_to_rank,
            [[a for a in row if a is not None and a.kind == Kind.F] for row in self.schedule.actions],
        )
        state = _StepState(self, microbatches)
        sums: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for step in plan_rank(forward_only, self.routing, self.row, self.rank):
                state.receive(step)
                produced = self._forward(state, step.action, lambda _: None, sums)
                state.saved.pop((step.action.stage, step.action.microbatch))
                if produced is not None:
                    state.send(step, produced)
            state.finish()
        return sums

    def _forward(self, state: _StepState, action: Action, loss_fn, sums) -> torch.Tensor | None:
        stage, k = action.stage, action.microbatch
        module = self.stages[stage]
        inbound = feed = None
        forward_only = self.schedule.forward_only  # a prefix of the stages (actions.py drop_backward)
        if module.inbound_row() is not None:
            # no gradient is computed for what a forward-only stage sent: it has no backward to take one
            inbound = state.take(ACT, stage, k).requires_grad_(stage - 1 not in forward_only)
            feed = inbound.to(self._compute_dtype(module))
            sections = getattr(module, "inbound_sections", None)
            if sections is not None:  # one part per unit of the sending branch group, in its order
                feed = feed.split(state.section_sizes(ACT, stage, k, sections))
        keep = stage not in forward_only  # a forward-only stage saves nothing for a backward
        with self.autocast(), nullcontext() if keep else torch.no_grad():
            out = module(feed, state.batches[k])
        loss = None
        if out.loss_sums:
            loss = loss_fn(out.loss_sums)
            for name, value in out.loss_sums.items():
                total = value.detach().double()
                sums[name] = sums[name] + total if name in sums else total
        if keep:  # the inbound tensor only where a gradient is taken for it (else nothing holds it)
            state.saved[(stage, k)] = (inbound if stage - 1 not in forward_only else None, out.send, loss)
        if out.send is not None and stage < self.last_stage:
            return out.send.detach().to(self.dtype)
        return None

    @staticmethod
    def _compute_dtype(module: torch.nn.Module) -> torch.dtype:
        param = next(module.parameters(), None)
        return param.dtype if param is not None else torch.float32

    def _backward(self, state: _StepState, action: Action, split: bool) -> torch.Tensor | None:
        stage, k = action.stage, action.microbatch
        inbound, sent, loss = state.saved.pop((stage, k))
        outputs, grads = [], []
        if loss is not None:
            outputs.append(loss)
            grads.append(torch.ones_like(loss))
        if sent is not None and stage < self.last_stage:
            outputs.append(sent)
            grads.append(state.take(GRAD, stage, k).to(sent.dtype))
        # A stage whose parameters are all frozen (and whose input needs none) has nothing to differentiate:
        # its gradient was received above, as the schedule pairs it, and is dropped.
        live = [(out, grad) for out, grad in zip(outputs, grads, strict=True) if out.requires_grad]
        outputs, grads = [out for out, _ in live], [grad for _, grad in live]
        splittable = split and getattr(self.stages[stage], "splittable_backward", False)
        if outputs and not splittable:
            torch.autograd.backward(outputs, grad_tensors=grads)
        elif outputs:
            params = [p for p in self.stages[stage].parameters() if p.requires_grad]
            _, groups = stage_backward_input(outputs, grads, [inbound], iter(params))
            state.weight_work[(stage, k)] = (params, groups)
        if stage > 0 and inbound is not None and stage - 1 not in self.schedule.forward_only:
            grad = inbound.grad if inbound.grad is not None else torch.zeros_like(inbound)
            return grad.to(self.dtype)
        return None

    def _weight(self, state: _StepState, action: Action) -> None:
        work = state.weight_work.pop((action.stage, action.microbatch), None)
        if work is not None:  # None where I already produced the weight gradients
            params, groups = work
            # retain_graph: parameter groups can share graph nodes (e.g. one hidden state feeding both heads);
            # the graph is released when these groups are dropped right after.
            stage_backward_weight(iter(params), groups, retain_graph=True)


class _StepState:
    """Buffers and pending communication of one step on one rank."""

    def __init__(self, executor: PipelineExecutor, batches: list[Microbatch]):
        self.x = executor
        self.batches = batches
        self.saved: dict[tuple[int, int], tuple] = {}
        self.weight_work: dict[tuple[int, int], tuple] = {}
        self.arrived: dict[tuple[str, int, int, int], torch.Tensor] = {}  # Transfer.key -> tensor
        self.send_works: list = []

    def _row_shape(self, kind: str, stage: int) -> tuple[int, ...]:
        module = self.x.stages[stage]
        return module.inbound_row() if kind == ACT else module.outbound_row()

    def receive(self, step: Step) -> None:
        """Post one call per source for the step's receives, then wait on every handle they return."""
        works = []
        for source, batch in step.receives.items():
            buffers = []
            for transfer in batch:
                shape = (len(transfer.rows), *self._row_shape(transfer.kind, transfer.stage))
                buffer = torch.empty(shape, dtype=self.x.dtype, device=self.x.device)
                self.arrived[transfer.key] = buffer
                buffers.append(buffer)
            works += self.x.channels.receive(buffers, source)
        wait_all(works)  # NCCL: one handle per call, and received data is valid only after it

    def send(self, step: Step, tensor: torch.Tensor) -> None:
        """Hand the action's output on: its own rows to this rank's next stage, the rest to their targets."""
        for transfer in step.local:
            self.arrived[transfer.key] = tensor[transfer.rows.start : transfer.rows.stop]
        for transfer in step.sends:
            part = tensor[transfer.rows.start : transfer.rows.stop].contiguous()
            self.send_works += self.x.channels.send(part, transfer.target)

    def take(self, kind: str, stage: int, k: int) -> torch.Tensor:
        parts = [
            self.arrived.pop((kind, stage, k, piece.rank))
            for piece in self.x.routing.incoming(kind, stage, k, self.x.rank)
        ]
        if not parts:
            return torch.zeros((0, *self._row_shape(kind, stage)), dtype=self.x.dtype, device=self.x.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def section_sizes(self, kind: str, stage: int, k: int, sections: int) -> list[int]:
        """Rows of each section of what ``take`` returns (the broker's pieces name their section)."""
        sizes = [0] * sections
        for piece in self.x.routing.incoming(kind, stage, k, self.x.rank):
            sizes[getattr(piece, "section", 0)] += len(piece.rows)
        return sizes

    def finish(self) -> None:
        wait_all(self.send_works)
        leftovers = len(self.saved) + len(self.weight_work) + len(self.arrived)
        if leftovers:
            raise RuntimeError(f"pipeline step ended with {leftovers} unconsumed buffers: the schedule is inconsistent")
