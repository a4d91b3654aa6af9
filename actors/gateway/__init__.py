"""The OpenAI-compatible gateway: an unmodified agent harness as the RL environment.

``Gateway`` serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
OpenAI's Responses API (``/v1/responses``) and Anthropic's Messages API (``/v1/messages``)
(a Starlette app served by hypercorn's trio worker, in the environment actor's trio loop); each
episode gets a ``Session`` (its own base URL ``/s/<key>/v1``, or its key as the API
key) that records every token exactly as the sampler saw and generated it.
``HarnessConfig`` + ``play_harness_episode`` run a harness (a subprocess or an
async function) per episode and turn its session into a ``Trajectory``.
"""

from actors.gateway._gateway import Gateway
from actors.gateway._harness import HarnessConfig, play_harness_episode, resolve
from actors.gateway._schemas import ChatRequest, CompletionRequest, GatewayError
from actors.gateway._session import Session, SessionLimits

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "Gateway",
    "GatewayError",
    "HarnessConfig",
    "Session",
    "SessionLimits",
    "play_harness_episode",
    "resolve",
]
