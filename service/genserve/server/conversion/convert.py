"""The one conversion from the wire to the engine: a Generate, GenerateStream or Chat request
→ a :class:`Conversion` holding every engine request the call will run.

Contract: :class:`RequestConverter` is the only thing the servicer calls between reading a
request and admitting its sequences.  Each method checks the whole request in one pass, in a
fixed order (batch size, prompts, per input: stop sequences, sampling, best_of/n, issue-#15
fields, tokens and lengths; then grammars; then the best_of/n fan-out), so a request with
several faults always gets the same message, and raises a
:class:`~genserve.server.conversion.errors.RequestError` whose ``status`` is the gRPC code to
answer.  Nothing here touches the engine, admission or the call context.

Package map (each module imports only the ones above it in this list, never the servicer):
``errors`` and ``limits`` (what refusals and limits are); ``extras``, ``sampling``,
``fan_out``, ``grammar``, ``prompts`` (one group of fields each); ``generation`` (one prompt
→ one engine request); ``chat`` (a conversation → a rendered prompt and per-choice
parameters); ``convert`` (this module: whole calls).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from genserve.chat_template import ChatRenderer
from genserve.engine.outputs import GenerationRequest
from genserve.server.chat_reply import ChatFeatures
from genserve.server.conversion import fan_out
from genserve.server.conversion.chat import ChatPlan, ChatRequestPb, plan_chat
from genserve.server.conversion.errors import ValidationError
from genserve.server.conversion.fim import FimUnsupportedError, fim_prompts
from genserve.server.conversion.generation import validate
from genserve.server.conversion.grammar import attach_grammar
from genserve.server.conversion.limits import Limits
from genserve.server.conversion.prompts import Prompt, prompt_inputs, validate_batch_size
from genserve.tokenizer import Tokenizer
from genserve.v1 import generate_pb2 as pb

if TYPE_CHECKING:
    from genserve.engine.grammar import GrammarCompiler


class ValidationObserver(Protocol):
    """Watches each input's validation (metrics, a span, a log line); the servicer's
    :class:`~genserve.server.observe.RequestObserver` is one."""

    def validate(
        self, req_id: str, text: str, run: Callable[[], GenerationRequest]
    ) -> GenerationRequest: ...


@dataclass(frozen=True, slots=True)
class Conversion:
    """A call converted: what the engine runs, and what rendering the reply needs.

    ``sequences`` are grouped by prompt: ``num_per_prompt`` consecutive requests per entry of
    ``prompts`` (the first of each group is the leader, the rest share its prompt KV).  For
    Chat there is one prompt (the rendered conversation) and one sequence per choice."""

    prompts: tuple[Prompt, ...]
    sequences: tuple[GenerationRequest, ...]
    num_per_prompt: int
    params: pb.GenerateParameters
    chat: ChatPlan | None = None

    @property
    def leaders(self) -> tuple[GenerationRequest, ...]:
        """The first sequence of each prompt."""
        return self.sequences[:: self.num_per_prompt]


@dataclass(frozen=True, slots=True)
class RequestConverter:
    """Everything the conversion reads besides the request: set once the model is loaded."""

    tokenizer: Tokenizer
    limits: Limits
    observer: ValidationObserver
    grammars: GrammarCompiler | None = None  # None: --disable-grammar-support
    chat_renderer: ChatRenderer | None = None  # None: Chat answers FAILED_PRECONDITION
    served_model_name: str = ""
    model_id: str = ""
    chat_features: ChatFeatures | None = None  # tool-call / reasoning parsers (#27)

    async def generate(self, request: pb.GenerateRequest, base_id: str) -> Conversion:
        """One or more prompts, each fanned out to best_of / n sequences; sequence ids are
        ``base_id`` (one prompt) or ``base_id-i``, followers ``…/seqK``."""
        validate_batch_size(len(request.inputs) or len(request.input_ids), self.limits)
        prompts = self._prompts(
            request.inputs,
            [t.ids for t in request.input_ids],
            request.suffix if request.HasField("suffix") else None,
        )
        params = request.parameters
        num = len(prompts)
        reqs = [
            self._validate(base_id if num == 1 else f"{base_id}-{i}", prompt, params)
            for i, prompt in enumerate(prompts)
        ]
        reqs = [await attach_grammar(r, params, self.grammars) for r in reqs]
        count = fan_out.num_sequences(params, self.limits, not reqs[0].sampling.greedy)
        seqs = tuple(s for r in reqs for s in fan_out.fork(r, count))
        return Conversion(tuple(prompts), seqs, count, params)

    async def generate_stream(self, request: pb.GenerateStreamRequest, req_id: str) -> Conversion:
        """One prompt, one sequence (streams refuse best_of / n > 1)."""
        params = request.parameters
        fan_out.check_stream(params)
        (prompt,) = self._prompts(
            [request.inputs] if request.inputs or not request.input_ids else [],
            [request.input_ids] if request.input_ids else [],
            request.suffix if request.HasField("suffix") else None,
        )
        req = self._validate(req_id, prompt, params)
        req = await attach_grammar(req, params, self.grammars)
        return Conversion((prompt,), (req,), 1, params)

    async def chat(self, request: ChatRequestPb, base_id: str) -> Conversion:
        """Render the conversation once; one engine request per choice (``base_id-i``), the
        choices after the first sharing the first one's prompt KV (engine/prompt_fork.py)."""
        plan = plan_chat(
            request,
            self.chat_renderer,
            self.limits,
            self.served_model_name or self.model_id,
            self.model_id,
            self.chat_features,
        )
        prompt = Prompt(plan.prompt_text, plan.prompt_ids)
        num = len(plan.choice_params)
        reqs = [
            self._validate(base_id if num == 1 else f"{base_id}-{i}", prompt, params)
            for i, params in enumerate(plan.choice_params)
        ]
        reqs[1:] = [dataclasses.replace(r, fork_of=reqs[0].req_id) for r in reqs[1:]]
        reasoning = plan.extras.reasoning
        gate = reasoning.gate() if reasoning is not None else None
        reqs = [
            await attach_grammar(r, p, self.grammars, gate)
            for r, p in zip(reqs, plan.choice_params, strict=True)
        ]
        return Conversion((prompt,), tuple(reqs), num, request.parameters, chat=plan)

    # ------------------------------------------------------------------ helpers
    def _prompts(
        self, texts: Sequence[str], id_lists: Sequence[Sequence[int]], suffix: str | None = None
    ) -> list[Prompt]:
        """With a ``suffix``, text prompts become fill-in-the-middle prompts (fim.py)."""
        vocab = self.limits.vocab_size or self.tokenizer.vocab_size
        if suffix is not None:
            try:
                texts = fim_prompts(self.tokenizer, texts, bool(id_lists), suffix)
            except FimUnsupportedError as exc:
                raise ValidationError(str(exc)) from None
        return prompt_inputs(texts, id_lists, self.tokenizer, vocab)

    def _validate(
        self, req_id: str, prompt: Prompt, params: pb.GenerateParameters
    ) -> GenerationRequest:
        return self.observer.validate(
            req_id,
            prompt.text,
            lambda: validate(
                req_id,
                prompt.text,
                params,
                self.tokenizer,
                self.limits,
                prompt_ids=prompt.token_ids,
            ),
        )
