"""Every message between the driver and its stages, one dataclass per kind, and their encoding
(cluster/codec.py: JSON of the fields with a type name, tensors raw; no pickle).

Ring (driver → stage 0 → … → last stage → driver): PlanMsg, PlanFailedMsg, ResultMsg, Heartbeat,
Shutdown. Control (each stage → driver): ReadyMsg once, then StageAlive every beat (liveness.py).
A message of another type, or one whose fields do not fit their types, is refused with WireError.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cluster.codec import Codec, JsonValue, OrNone, TensorSpec, WireError
from ..cluster.transport import Link, PendingSend
from ..graph.policy import GraphVerdict
from ..kernels.report import KernelInfo
from ..plan import CachedRequestData, KVPages, NewRequestData, ScheduledSeq, StepPlan, StepResult, TokenBitmask
from ..planning.memory import MemoryPlan
from ..request import SamplingParams, StructuredOutputs, TokenLogprob

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# NOTE: how long the driver waits for every ReadyMsg, and a stage for its first ring message: the
# slowest stage's weights load in between, however long --dist-timeout-s is
READY_WAIT_S = 600.0


@dataclass
class PlanMsg:
    """A step plan on its way down the ring, with the previous stage's proxy (none into stage 0)."""
    plan: StepPlan
    proxy: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class PlanFailedMsg:
    """A plan that failed on an earlier stage: later stages only apply its deltas."""
    plan: StepPlan
    why: str


@dataclass
class ResultMsg:
    """The last stage's answer to a plan."""
    result: StepResult


@dataclass
class ReadyMsg:
    """A stage loaded its weights (its memory plan and how long that took), or could not (`error`);
    `kernels`: which kernels it runs (kernels/report.py); `start_cpu_s`: CPU seconds its process
    used from its start until now (imports included unless it was forked from a warm process)."""
    memory_plan: MemoryPlan | None = None
    load_s: float = 0.0
    error: str | None = None
    kernels: list[KernelInfo] = field(default_factory=list)
    start_cpu_s: float = 0.0


@dataclass
class StageAlive:
    """A stage's heartbeat on its control link, every beat while the process runs (liveness.py)."""
    stage: int
    beat: int


@dataclass
class Heartbeat:
    """Sent around the ring by an idle driver, so an idle link never reaches its timeout."""


@dataclass
class Shutdown:
    """Stop in order: each stage passes it on and exits."""


RING = (PlanMsg, PlanFailedMsg, ResultMsg, Heartbeat, Shutdown)
CONTROL = (ReadyMsg, StageAlive)
CODEC = Codec(
    [*RING, *CONTROL, StepPlan, ScheduledSeq, NewRequestData, CachedRequestData, TokenBitmask, StepResult, KVPages,
     SamplingParams, StructuredOutputs, TokenLogprob, GraphVerdict, MemoryPlan, KernelInfo],
    # NOTE: plan.py and request.py import neither torch nor graph/: their fields of those types say Any
    overrides={(NewRequestData, "input_embeds"): OrNone(TensorSpec(FLOATS, ndim=2)),
               (TokenBitmask, "bits"): TensorSpec((torch.int32,), ndim=2),
               (StepPlan, "verdict"): GraphVerdict | None,
               (StructuredOutputs, "json"): JsonValue,
               (SamplingParams, "structured_outputs"): StructuredOutputs | None},   # __post_init__ made it so
    # the engine derives it from bad_words on the driver (engine/inputs.py); not a field
    extras={SamplingParams: {"bad_words_token_ids": list[list[int]] | None}})
Message = PlanMsg | PlanFailedMsg | ResultMsg | ReadyMsg | StageAlive | Heartbeat | Shutdown


def send_message(link: Link, msg: Message) -> PendingSend:
    header, tensors = CODEC.encode(msg)
    return link.send(header, tensors)


def recv_message(link: Link, timeout_s: float, allowed: tuple[type, ...] = RING) -> Message:
    """The next message on `link`; WireError if it is not one of `allowed` or does not fit its type."""
    header, tensors = link.recv(timeout_s)
    try:
        return CODEC.decode(header, tensors, allowed)
    except WireError as exc:
        raise WireError(f"{link.peer} sent a malformed message ({exc})") from None
