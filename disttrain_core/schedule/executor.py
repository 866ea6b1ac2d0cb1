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
arrive from several. Every rank knows the whole schedule and the routing, so for
each peer it can list the pieces that peer will send it, in the peer's order.
Receives follow that order strictly (early pieces are kept until used): no tags,
and the in-order semantics NCCL has too. Before each compute action the pending
sends and the receives it needs are posted together with ``batch_isend_irecv``;
only receives are waited for; sends are waited for at the end of the step. Shapes
are computed locally (rows from the microbatch, row shapes from the stages), so no
metadata travels.

Gradients accumulate in ``param.grad`` over the microbatches; the loss terms are
already normalized by the global batch, so no rescaling happens here. With a
``grad_sync`` (comm/engine.py) the executor tells it, just before a stage's last
backward of the step, that the gradients about to be produced are final, so their
reduction can start while the rest of the backward runs.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from ..data.batch import Batch
from .actions import Action, Kind, Schedule
from .simulator import TimedAction

ACT, GRAD = "act", "grad"  # a forward activation travelling up, an input gradient travelling down


@dataclass
class StepRecord:
    """What one step did on this rank: loss sums (stages that compute losses) and timed actions."""

    sums: dict[str, float] = field(default_factory=dict)
    timeline: list[TimedAction] = field(default_factory=list)
    origin: float = 0.0  # time.perf_counter() the timeline's times are relative to
    pending_sums: Callable[[], dict[str, float]] | None = None  # sums still being reduced across ranks

    def resolve(self) -> StepRecord:
        """Wait for loss sums still in flight (engines reduce them in the background)."""
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
        broker,
        device: torch.device,
        boundary_dtype: torch.dtype = torch.float32,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
    ):
        self.schedule = schedule
        self.stages = stages
        self.row = row
        self.rank = rank
        self.broker = broker
        self.device = device
        self.dtype = boundary_dtype
        self.autocast = autocast
        self.last_stage = schedule.num_stages - 1
        self.my_actions = schedule.compute(row)
        self.grad_sync = None  # set by the engine: arm(stage) / grads_ready(params)
        # Per stage, the position of the last action that accumulates weight gradients: after it they are final.
        self.final_backward: dict[int, int] = {}
        for index, action in enumerate(self.my_actions):
            if self._accumulates_weight_grads(action):
                self.final_backward[action.stage] = index

    def _accumulates_weight_grads(self, action: Action) -> bool:
        if action.kind == Kind.B:
            return True
        split = getattr(self.stages[action.stage], "splittable_backward", False)
        return (action.kind == Kind.I and not split) or (action.kind == Kind.W and split)

    # ------------------------------------------------------------ message plan
    def _messages_of(self, action: Action) -> list[tuple[str, int]]:
        """(kind, destination stage) of what an action produces."""
        s = action.stage
        if action.kind == Kind.F and s < self.last_stage:
            return [(ACT, s + 1)]
        if action.kind in (Kind.B, Kind.I) and s > 0:
            return [(GRAD, s - 1)]
        return []

    def incoming_order(self) -> dict[int, deque]:
        """For each peer, the pieces it will send this rank this step, in its order."""
        mine = set(self.stages)
        rows = {self.schedule.stage_to_rank[s + d] for s in mine for d in (-1, 1) if 0 <= s + d <= self.last_stage}
        order: dict[int, deque] = defaultdict(deque)
        for row in sorted(rows):
            actions = self.schedule.compute(row)
            for peer in self.broker.ranks_of_row(row):
                if peer == self.rank:
                    continue
                for action in actions:
                    for kind, target in self._messages_of(action):
                        if target not in mine:
                            continue
                        for piece in self.broker.outgoing(kind, action.stage, action.microbatch, peer):
                            if piece.rank == self.rank:
                                order[peer].append((kind, target, action.microbatch, len(piece.rows)))
        return order

    # -------------------------------------------------------------------- step
    def run(
        self, microbatches: list[Batch], loss_fn: Callable[[dict], torch.Tensor], record: bool = False
    ) -> StepRecord:
        state = _StepState(self, microbatches)
        result = StepRecord()
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        origin = time.perf_counter()
        for index, action in enumerate(self.my_actions):
            state.prepare(action)  # post pending sends and the receives this action needs, wait for the receives
            started = time.perf_counter()
            final = self.final_backward.get(action.stage) == index
            if final and self.grad_sync is not None:
                self.grad_sync.arm(action.stage)
            if action.kind == Kind.F:
                self._forward(state, action, loss_fn, sums)
            elif action.kind in (Kind.B, Kind.I):
                self._backward(state, action, split=action.kind == Kind.I)
            elif action.kind == Kind.W:
                self._weight(state, action)
                if final and self.grad_sync is not None:
                    self.grad_sync.grads_ready(p for p in self.stages[action.stage].parameters() if p.requires_grad)
            if record:
                result.timeline.append(TimedAction(self.row, action, started - origin, time.perf_counter() - origin))
        state.finish()
        result.origin = origin
        result.sums = {name: float(value) for name, value in sums.items()}
        return result

    def _forward(self, state: _StepState, action: Action, loss_fn, sums) -> None:
        stage, k = action.stage, action.microbatch
        module = self.stages[stage]
        inbound = state.take(ACT, stage, k).requires_grad_(True) if module.inbound_row() is not None else None
        with self.autocast():
            out = module(inbound, state.batches[k])
        loss = None
        if out.loss_sums:
            loss = loss_fn(out.loss_sums)
            for name, value in out.loss_sums.items():
                sums[name] += value.detach().double().cpu()
        if out.send is not None and stage < self.last_stage:
            state.deliver(ACT, stage, k, out.send.detach().to(self.dtype))
        state.saved[(stage, k)] = (inbound, out.send, loss)

    def _backward(self, state: _StepState, action: Action, split: bool) -> None:
        stage, k = action.stage, action.microbatch
        inbound, sent, loss = state.saved.pop((stage, k))
        outputs, grads = [], []
        if loss is not None:
            outputs.append(loss)
            grads.append(torch.ones_like(loss))
        if sent is not None and stage < self.last_stage:
            outputs.append(sent)
            grads.append(state.take(GRAD, stage, k).to(sent.dtype))
        if not split or not getattr(self.stages[stage], "splittable_backward", False):
            torch.autograd.backward(outputs, grad_tensors=grads)
        else:
            params = [p for p in self.stages[stage].parameters() if p.requires_grad]
            _, groups = stage_backward_input(outputs, grads, [inbound], iter(params))
            state.weight_work[(stage, k)] = (params, groups)
        if stage > 0 and inbound is not None:
            grad = inbound.grad if inbound.grad is not None else torch.zeros_like(inbound)
            state.deliver(GRAD, stage, k, grad.to(self.dtype))

    def _weight(self, state: _StepState, action: Action) -> None:
        work = state.weight_work.pop((action.stage, action.microbatch), None)
        if work is not None:  # None where I already produced the weight gradients
            params, groups = work
            # retain_graph: parameter groups can share graph nodes (e.g. one hidden state feeding both heads);
            # the graph is released when these groups are dropped right after.
            stage_backward_weight(iter(params), groups, retain_graph=True)


class _StepState:
    """Buffers and pending communication of one step on one rank."""

    def __init__(self, executor: PipelineExecutor, batches: list[Batch]):
        self.x = executor
        self.batches = batches
        self.saved: dict[tuple[int, int], tuple] = {}
        self.weight_work: dict[tuple[int, int], tuple] = {}
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}
        self.received: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self.pending_sends: list[tuple[torch.Tensor, int]] = []
        self.send_works: list = []
        self.channels = executor.incoming_order()

    def _row_shape(self, kind: str, stage: int) -> tuple[int, ...]:
        module = self.x.stages[stage]
        return module.inbound_row() if kind == ACT else module.outbound_row()

    def deliver(self, kind: str, stage: int, k: int, tensor: torch.Tensor) -> None:
        target = stage + 1 if kind == ACT else stage - 1
        for piece in self.x.broker.outgoing(kind, stage, k, self.x.rank):
            part = tensor[piece.rows.start : piece.rows.stop]
            if piece.rank == self.x.rank:
                self.local[(kind, target, k)] = part
            else:
                self.pending_sends.append((part.contiguous(), piece.rank))

    def _needs(self, action: Action) -> list[tuple[str, int, int]]:
        s, k = action.stage, action.microbatch
        module = self.x.stages[s]
        if action.kind == Kind.F and module.inbound_row() is not None:
            return [(ACT, s, k)]
        if action.kind in (Kind.B, Kind.I) and s < self.x.last_stage and module.outbound_row() is not None:
            return [(GRAD, s, k)]
        return []

    def prepare(self, action: Action) -> None:
        ops = [dist.P2POp(dist.isend, tensor, peer) for tensor, peer in self.pending_sends]
        n_sends = len(ops)
        self.pending_sends = []
        recvs = []
        for kind, stage, k in self._needs(action):
            for piece in self.x.broker.incoming(kind, stage, k, self.x.rank):
                if piece.rank == self.x.rank or (kind, stage, k, piece.rank) in self.received:
                    continue
                channel = self.channels[piece.rank]
                while True:  # receive everything the peer sends before the piece we need
                    message = channel.popleft()
                    m_kind, m_stage, m_k, rows = message
                    shape = (rows, *self._row_shape(m_kind, m_stage))
                    buffer = torch.empty(shape, dtype=self.x.dtype, device=self.x.device)
                    ops.append(dist.P2POp(dist.irecv, buffer, piece.rank))
                    recvs.append(((m_kind, m_stage, m_k, piece.rank), buffer))
                    if (m_kind, m_stage, m_k) == (kind, stage, k):
                        break
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        self.send_works += works[:n_sends]
        for work in works[n_sends:]:
            work.wait()
        for key, buffer in recvs:
            self.received[key] = buffer

    def take(self, kind: str, stage: int, k: int) -> torch.Tensor:
        parts = []
        for piece in self.x.broker.incoming(kind, stage, k, self.x.rank):
            if piece.rank == self.x.rank:
                parts.append(self.local.pop((kind, stage, k)))
            else:
                parts.append(self.received.pop((kind, stage, k, piece.rank)))
        if not parts:
            return torch.zeros((0, *self._row_shape(kind, stage)), dtype=self.x.dtype, device=self.x.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def finish(self) -> None:
        if self.pending_sends:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, p) for t, p in self.pending_sends])
            self.send_works += works
            self.pending_sends = []
        for work in self.send_works:
            work.wait()
        leftovers = len(self.saved) + len(self.weight_work) + len(self.received) + len(self.local)
        if leftovers:
            raise RuntimeError(f"pipeline step ended with {leftovers} unconsumed buffers: the schedule is inconsistent")
