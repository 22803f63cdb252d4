"""LoRA adapters over HTTP, as vLLM serves them: a request picks one by `"model": "<name>"`,
/v1/models lists each with `parent` the base model, and with runtime updating allowed
(`--allow-runtime-lora-updating`, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) POST
/v1/load_lora_adapter and /v1/unload_lora_adapter take vLLM's bodies and answer its texts.

The API server keeps the names (ServedAdapters); the engine reads and checks each adapter when it
is registered (DistributedWorker.add_lora, run as a control), so a bad one is a 400 in its words.
"""
from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import PlainTextResponse

from l3worker.lora import LoRARequest
from l3worker.serving.openai.adapters import ServedAdapters
from l3worker.serving.openai.engine_client import EngineClient
from l3worker.serving.openai.errors import APIError, bad_request
from l3worker.serving.openai.protocol import _Body

class LoadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_int_id: int | None = None


def _not_found(name: str) -> APIError:
    return APIError(404, f"The lora adapter '{name}' cannot be found.", type_="NotFoundError", param="lora_name",
                    code=404)


def add_lora_routes(app: FastAPI, client: EngineClient, adapters: ServedAdapters, base_names: tuple[str, ...]) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if not req.lora_name or not req.lora_path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if req.lora_name in adapters.by_name or req.lora_name in base_names:
            raise bad_request(f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name")
        request = LoRARequest(req.lora_name, adapters.next_id(), req.lora_path)
        await client.control("add_lora", {"lora_name": request.lora_name, "lora_int_id": request.lora_int_id,
                                          "lora_path": request.lora_path})
        adapters.by_name[req.lora_name] = request
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        request = adapters.by_name.get(req.lora_name)
        if request is None or (req.lora_int_id is not None and req.lora_int_id != request.lora_int_id):
            raise _not_found(req.lora_name)
        await client.control("remove_lora", {"lora_int_id": request.lora_int_id})
        adapters.by_name.pop(req.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
