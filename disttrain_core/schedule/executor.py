"""Run a schedule for real: this rank's actions, in order, across processes.

* ``F`` runs a stage forward; unless the stage is last, its output goes to the
  next stage (same process: handed over; other process: sent).
* ``B`` runs the stage backward from the received output gradient (the last
  stage starts from its loss) and passes the input gradient to the previous stage.
* ``I`` / ``W`` split that backward: ``I`` computes only the input gradient (what
  the previous stage waits for), ``W`` later computes the weight gradients from
  the intermediate gradients ``I`` kept (torch.distributed.pipelining's
  ``stage_backward_input``/``stage_backward_weight`` do the graph surgery). That
  split is exact only when every weight influences the output through the stage
  input's path; a stage that also consumes data directly (the first stage, the
  generator's noisy latents and timesteps on the last) declares
  ``splittable_backward = False`` and its ``I`` runs the whole backward, its ``W``
  then having nothing left to do. Results are exact either way.

Communication. Every rank knows the whole schedule, so a receiver can list, for
each peer, the messages that peer will send it and in which order. Messages on a
(peer -> me) channel are received strictly in that order (early ones are kept
until used), which needs no tags and matches NCCL's in-order semantics too.
Before each compute action the sends produced so far and the receives it needs
are posted together with ``batch_isend_irecv``; only the receives are waited
for. Shapes are computed locally (every rank of a pipeline has the microbatch),
so no metadata travels. Sends are waited for at the end of the step.

Gradients accumulate in ``param.grad`` over the microbatches; the loss given to
backward is already normalized by the global batch, so no rescaling happens here.
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
    """What one step did on this rank: loss sums (last stage only) and the timed actions."""

    sums: dict[str, float] = field(default_factory=dict)
    timeline: list[TimedAction] = field(default_factory=list)


class PipelineExecutor:
    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, torch.nn.Module],
        pp_rank: int,
        pipeline_global_ranks: list[int],
        group,
        device: torch.device,
        boundary_dtype: torch.dtype = torch.float32,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
    ):
        self.schedule = schedule
        self.stages = stages
        self.pp_rank = pp_rank
        self.peers = pipeline_global_ranks
        self.group = group
        self.device = device
        self.dtype = boundary_dtype
        self.autocast = autocast
        self.last_stage = schedule.num_stages - 1
        self.my_actions = schedule.compute(pp_rank)
        self.channel_order = self._incoming_order()

    # ------------------------------------------------------------ message plan
    def _messages_from(self, action: Action) -> list[tuple[str, int, int]]:
        """Messages (kind, destination stage, microbatch) an action produces."""
        s, k = action.stage, action.microbatch
        if action.kind == Kind.F and s < self.last_stage:
            return [(ACT, s + 1, k)]
        if action.kind in (Kind.B, Kind.I) and s > 0:
            return [(GRAD, s - 1, k)]
        return []

    def _incoming_order(self) -> dict[int, list[tuple[str, int, int]]]:
        """For each other pipeline rank, the messages it sends to this rank, in its send order."""
        order: dict[int, list] = {}
        for peer in range(self.schedule.num_ranks):
            if peer == self.pp_rank:
                continue
            order[peer] = [
                message
                for action in self.schedule.compute(peer)
                for message in self._messages_from(action)
                if self.schedule.stage_to_rank[message[1]] == self.pp_rank
            ]
        return order

    # -------------------------------------------------------------------- step
    def run(
        self, microbatches: list[Batch], loss_fn: Callable[[dict], torch.Tensor], record: bool = False
    ) -> StepRecord:
        state = _StepState(self, microbatches)
        result = StepRecord()
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        origin = time.perf_counter()
        for action in self.my_actions:
            state.prepare(action)  # post pending sends and the receives this action needs, wait for the receives
            started = time.perf_counter()
            if action.kind == Kind.F:
                self._forward(state, action, loss_fn, sums)
            elif action.kind == Kind.B:
                self._backward(state, action, split=False)
            elif action.kind == Kind.I:
                self._backward(state, action, split=True)
            elif action.kind == Kind.W:
                self._weight(state, action)
            if record:
                result.timeline.append(
                    TimedAction(self.pp_rank, action, started - origin, time.perf_counter() - origin)
                )
        state.finish()
        result.sums = {name: float(value) for name, value in sums.items()}
        return result

    def _forward(self, state: _StepState, action: Action, loss_fn, sums) -> None:
        stage, k = action.stage, action.microbatch
        module = self.stages[stage]
        batch = state.batches[k]
        hidden = None
        if stage > 0:
            hidden = state.take(ACT, stage, k).requires_grad_(True)
        with self.autocast():
            out = module(hidden, batch)
        if stage == self.last_stage:
            loss = loss_fn(out)
            for name in ("lm_loss_sum", "gen_loss_sum"):
                if name in out:
                    sums[name] += out[name].detach().double().cpu()
            out = loss
        else:
            state.deliver(ACT, stage + 1, k, out.detach().to(self.dtype))
        state.saved[(stage, k)] = (hidden, out)

    def _backward(self, state: _StepState, action: Action, split: bool) -> None:
        stage, k = action.stage, action.microbatch
        hidden, out = state.saved.pop((stage, k))
        grad = None if stage == self.last_stage else state.take(GRAD, stage, k).to(out.dtype)
        if not split or stage == 0 or not getattr(self.stages[stage], "splittable_backward", False):
            torch.autograd.backward(out, grad_tensors=grad)
        else:
            params = [p for p in self.stages[stage].parameters() if p.requires_grad]
            _, groups = stage_backward_input([out], None if grad is None else [grad], [hidden], iter(params))
            state.weight_work[(stage, k)] = (params, groups)
        if stage > 0:
            state.deliver(GRAD, stage - 1, k, hidden.grad.to(self.dtype))

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
        self.received: dict[tuple[str, int, int], torch.Tensor] = {}
        self.pending_sends: list[tuple[torch.Tensor, int]] = []
        self.send_works: list = []
        self.next_in = {peer: deque(order) for peer, order in executor.channel_order.items()}

    def _rank_of_stage(self, stage: int) -> int:
        return self.x.schedule.stage_to_rank[stage]

    def _shape(self, kind: str, stage: int, k: int) -> tuple[int, ...]:
        # An activation into `stage` and the gradient of its output both have the boundary shape
        # of the stage that receives (activation) or the stage above (gradient).
        owner = stage if kind == ACT else stage + 1
        module = self.x.stages.get(owner) or self.x.stages[stage]
        return module.boundary_shape(self.batches[k])

    def deliver(self, kind: str, stage: int, k: int, tensor: torch.Tensor) -> None:
        rank = self._rank_of_stage(stage)
        if rank == self.x.pp_rank:
            self.local[(kind, stage, k)] = tensor
        else:
            self.pending_sends.append((tensor.contiguous(), self.x.peers[rank]))

    def _needs(self, action: Action) -> list[tuple[str, int, int]]:
        s, k = action.stage, action.microbatch
        if action.kind == Kind.F and s > 0:
            return [(ACT, s, k)]
        if action.kind in (Kind.B, Kind.I) and s < self.x.last_stage:
            return [(GRAD, s, k)]
        return []

    def prepare(self, action: Action) -> None:
        ops, recvs = [], []
        for tensor, peer in self.pending_sends:
            ops.append(dist.P2POp(dist.isend, tensor, peer, self.x.group))
        self.pending_sends = []
        for message in self._needs(action):
            sender = self._rank_of_stage(message[1] - 1 if message[0] == ACT else message[1] + 1)
            if sender == self.x.pp_rank or message in self.received:
                continue
            channel = self.next_in[sender]
            while True:  # receive everything the sender sends before the message we need
                incoming = channel.popleft()
                buffer = torch.empty(self._shape(*incoming), dtype=self.x.dtype, device=self.x.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self.x.peers[sender], self.x.group))
                recvs.append((incoming, buffer))
                if incoming == message:
                    break
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        n_sends = len(ops) - len(recvs)
        self.send_works += works[:n_sends]
        for work in works[n_sends:]:
            work.wait()
        for message, buffer in recvs:
            self.received[message] = buffer

    def take(self, kind: str, stage: int, k: int) -> torch.Tensor:
        key = (kind, stage, k)
        tensor = self.local.pop(key, None)
        if tensor is None:
            tensor = self.received.pop(key)
        return tensor

    def finish(self) -> None:
        if self.pending_sends:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, p, self.x.group) for t, p in self.pending_sends])
            self.send_works += works
            self.pending_sends = []
        for work in self.send_works:
            work.wait()
        leftovers = len(self.saved) + len(self.weight_work) + len(self.received) + len(self.local)
        if leftovers:
            raise RuntimeError(f"pipeline step ended with {leftovers} unconsumed buffers: the schedule is inconsistent")
