"""Chat and ChatStream, conversion side: a conversation → one rendered prompt and one
GenerateParameters per choice (which the Generate path then turns into engine requests).

Checks what is chat-specific (model name, roles, refused flags, ``n``, ``logprobs``,
``response_format``) and renders the template.  Output assembly (choices, deltas, usage)
is server/chat_render.py's; request-side chat features (tools offered to the model,
``tool_choice`` as a grammar) belong here, the parsing of the model's reply there."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from genserve.chat_template import ROLES, ChatRenderer, ChatTemplateError, NoChatTemplateError
from genserve.server.chat_reply import ChatFeatures
from genserve.server.chat_tools import ChatToolsError, ChatToolsPlan, plan_chat_tools
from genserve.server.conversion.errors import ModelNotFoundError, NoTemplateError, ValidationError
from genserve.server.conversion.limits import Limits
from genserve.v1 import generate_pb2 as pb

# Decoding options of Generate that make no sense for a chat reply (see the proto).
_REFUSED_FLAGS = ("details", "return_full_text", "decoder_input_details")

ChatRequestPb = pb.ChatRequest | pb.ChatStreamRequest


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A checked chat call: the rendered prompt and one parameter set per choice."""

    prompt_text: str
    prompt_ids: tuple[int, ...]
    choice_params: tuple[pb.GenerateParameters, ...]
    logprobs: bool
    num_top_logprobs: int  # alternatives per token in the reply (0 without logprobs)
    model: str
    # Issue #27: tools, reasoning and fingerprint (server/chat_tools.py).
    extras: ChatToolsPlan
    created: int = field(default_factory=lambda: int(time.time()))


def plan_chat(
    request: ChatRequestPb,
    chat: ChatRenderer | None,
    limits: Limits,
    served_model_name: str,
    model_id: str,
    features: ChatFeatures | None = None,
) -> ChatPlan:
    """Check and render; raises ValidationError, ModelNotFoundError or NoTemplateError."""
    if request.model and request.model not in (served_model_name, model_id):
        raise ModelNotFoundError(
            f"The model `{request.model}` does not exist: this server serves "
            f"`{served_model_name}` (or leave `model` empty)"
        )
    if not request.messages:
        raise ValidationError("`messages` is empty: send at least one message")
    for i, m in enumerate(request.messages):
        if m.role not in ROLES:
            raise ValidationError(
                f"messages[{i}].role is {m.role!r}; expected one of {', '.join(sorted(ROLES))}"
            )
    params = request.parameters
    for name in _REFUSED_FLAGS:
        if getattr(params, name):
            raise ValidationError(
                f"`parameters.{name}` is not available in Chat: a chat reply always carries "
                "its finish reason and usage (use `logprobs` for per-token logprobs)"
            )
    if params.HasField("truncate"):
        raise ValidationError(
            "`parameters.truncate` is not available in Chat: cutting a rendered conversation "
            "would drop its system prompt; drop old turns instead"
        )
    fmt = request.response_format.type
    if fmt in ("json_object", "json_schema") and params.HasField("grammar"):
        raise ValidationError("give either `response_format` or `parameters.grammar`, not both")
    if fmt == "json_schema" and not request.response_format.json_schema:
        raise ValidationError("response_format 'json_schema' needs `json_schema` (JSON text)")
    if fmt not in ("", "text", "json_object", "json_schema"):
        raise ValidationError(
            f"response_format.type is {fmt!r}; expected 'text', 'json_object' or 'json_schema'"
        )
    n = request.n if request.HasField("n") else 1
    if not 1 <= n <= limits.max_client_batch_size:
        # Each choice is one engine sequence, like one input of a Generate call, so the same
        # per-call sequence limit applies.
        raise ValidationError(
            f"`n` is {n}; it must be between 1 and {limits.max_client_batch_size} "
            "(--max-client-batch-size)"
        )
    top_n = params.top_n_tokens if params.HasField("top_n_tokens") else 0
    if request.HasField("top_logprobs"):
        if not request.logprobs:
            raise ValidationError("`top_logprobs` needs `logprobs` set to true")
        if request.top_logprobs > limits.max_top_n_tokens:
            raise ValidationError(
                f"`top_logprobs` is {request.top_logprobs}; at most {limits.max_top_n_tokens} "
                "are allowed (--max-top-n-tokens)"
            )
        top_n = max(top_n, request.top_logprobs)
    if chat is None or not chat.has_template:
        raise NoTemplateError(str(NoChatTemplateError(model_id)))
    try:
        extras = plan_chat_tools(
            request,
            features,
            chat.template,
            constrained_elsewhere=fmt in ("json_object", "json_schema")
            or params.HasField("grammar"),
        )
    except ChatToolsError as exc:
        raise ValidationError(str(exc)) from None
    add_prompt = (
        request.add_generation_prompt
        if request.HasField("add_generation_prompt")
        else (not request.continue_final_message)
    )
    try:
        rendered = chat.render(
            extras.messages(request.messages),
            add_generation_prompt=add_prompt,
            continue_final_message=request.continue_final_message,
            tools=extras.template_tools,
        )
    except ChatTemplateError as exc:
        raise ValidationError(str(exc)) from None
    choices = []
    for i in range(n):
        choice = pb.GenerateParameters()
        choice.CopyFrom(params)
        if top_n:
            choice.top_n_tokens = top_n
        if params.HasField("seed"):
            # Choice i samples with seed + i: the choices differ, and each is reproducible.
            choice.seed = (params.seed + i) % (1 << 64)
        # OpenAI's response_format is a grammar on every choice.
        if fmt == "json_object":
            choice.grammar.json_object = True
        elif fmt == "json_schema":
            choice.grammar.json_schema = request.response_format.json_schema
        if extras.tools.grammar_schema is not None:  # tool_choice required / named
            choice.grammar.json_schema = extras.tools.grammar_schema
        if extras.tools.mode == "auto" and extras.tools.parser.needs_special_tokens:
            choice.skip_special_tokens = False  # the call marker is a special token
        choices.append(choice)
    return ChatPlan(
        prompt_text=rendered.text,
        prompt_ids=rendered.token_ids,
        choice_params=tuple(choices),
        logprobs=request.logprobs,
        num_top_logprobs=top_n if request.logprobs else 0,
        model=served_model_name,
        extras=extras,
    )
