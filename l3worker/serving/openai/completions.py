"""POST /v1/completions: prompts (text or ids, one or several) to choices, whole or streamed."""
from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from l3worker.params import CompletionOutput, RequestOutput, TokenLogprob
from l3worker.serving.openai.endpoint import Generation, nothing_new, respond
from l3worker.serving.openai.engine_client import EngineClient
from l3worker.serving.openai.protocol import CompletionRequest
from l3worker.serving.openai.responses import TokenFormatter
from l3worker.serving.openai.translate import ServedModel


@dataclass
class _Choice:
    offset: int = 0  # text_offset of the next token
    started: bool = False


class Completion(Generation):
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"
    req: CompletionRequest

    def __init__(self, req: CompletionRequest, model_name: str, prompts: list[list[int]], fmt: TokenFormatter):
        super().__init__(req, model_name, prompts, fmt)
        self.choices: dict[int, _Choice] = {}  # streamed choices' progress

    def echo_text(self, i: int) -> str:
        if isinstance(self.req.prompt, str):
            return self.req.prompt
        if isinstance(self.req.prompt, list) and self.req.prompt and isinstance(self.req.prompt[i], str):
            return self.req.prompt[i]
        return self.fmt.decode(self.prompts[i])

    def piece(self, i: int, out: RequestOutput, text: str, token_ids: list[int],
              token_logprobs: list[TokenLogprob] | None, st: _Choice) -> tuple[str, dict | None]:
        """text and logprobs of what is new for one choice; the prompt first when echoing."""
        lp = None
        if not st.started and self.req.echo:
            text = self.echo_text(i) + text
            if self.req.logprobs is not None:
                plp = out.prompt_logprobs or [None] * len(self.prompts[i])
                entries = list(zip(self.prompts[i], plp))
                entries += list(zip(token_ids, token_logprobs or []))
                lp, st.offset = self.fmt.completion_logprobs(entries, st.offset)
        elif self.req.logprobs is not None:
            lp, st.offset = self.fmt.completion_logprobs(zip(token_ids, token_logprobs or []), st.offset)
        st.started = True
        return text, lp

    def _choice(self, i: int, s: CompletionOutput, text: str, lp: dict | None) -> dict:
        return {"index": self.index(i, s), "text": text, "logprobs": lp, "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason}

    def choice(self, i: int, out: RequestOutput, s: CompletionOutput) -> dict:
        text, lp = self.piece(i, out, s.text or "", s.token_ids, s.logprobs, _Choice())
        return self._choice(i, s, text, lp)

    def delta_choice(self, i: int, out: RequestOutput, s: CompletionOutput) -> dict | None:
        st = self.choices.setdefault(self.index(i, s), _Choice())
        text, lp = self.piece(i, out, s.delta_text, s.delta_token_ids, s.delta_logprobs, st)
        if not text and nothing_new(s):  # an echoed prompt is news
            return None
        return self._choice(i, s, text, lp)

    def log_fields(self) -> str:
        return f"prompts={len(self.prompts)} {super().log_fields()}"


async def create_completion(request: Request, req: CompletionRequest, model: ServedModel,
                            client: EngineClient) -> Response:
    model_name = model.resolve(req.model)
    prompts = model.completion_prompts(req)
    params = [model.completion_params(req, len(p), p) for p in prompts]
    gen = Completion(req, model_name, prompts, TokenFormatter(model.tokens, model.token_ids_as_text(req)))
    model.log_request(gen.request_id, prompts, params)
    gen.lora = model.lora_of(req.model)
    return await respond(request, gen, client, params)
