"""vLLM's POST /tokenize and POST /detokenize: the server's tokenizer and chat template, as the
engine would apply them, so that clients (vLLM's benchmark among them) count and cut prompts the
way the server sees them."""
from __future__ import annotations

from l3worker.serving.openai.errors import bad_request
from l3worker.serving.openai.protocol import DetokenizeRequest, TokenizeRequest
from l3worker.serving.openai.translate import ServedModel


def tokenize(req: TokenizeRequest, model: ServedModel) -> dict:
    """{"count", "max_model_len", "tokens", "token_strs"}: token_strs only with return_token_strs."""
    model.resolve(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        # vLLM's TokenizeChatRequest: add_special_tokens defaults to false (the template has them)
        ids = model.chat_prompt(req, add_special_tokens=bool(req.add_special_tokens))
    else:
        if model.tokens is None:
            raise bad_request("this model has no tokenizer.json", "prompt")
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = model.tokens.encode(req.prompt, add_special_tokens=add)
    strs = [model.tokens.token_text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, model: ServedModel) -> dict:
    model.resolve(req.model)
    if model.tokens is None:
        raise bad_request("this model has no tokenizer.json", "tokens")
    for t in req.tokens:
        if not 0 <= t < model.vocab_size:
            raise bad_request(f"tokens: token id {t} outside [0, {model.vocab_size}) (vocab_size)", "tokens")
    return {"prompt": model.tokens.decode(req.tokens)}
