"""The endpoints an RL trainer drives its rollout engine with: vLLM's sleep-mode endpoints (POST
/sleep, POST /wake_up, GET /is_sleeping) with --enable-sleep-mode, and SGLang's weight update,
pause and resume, and vLLM's prefix-cache reset with --enable-weight-updates. Without its flag an
endpoint is not mounted, so it answers 404, as vLLM's do when its dev endpoints are off. They are
behind the API key like every other path (middleware.APIKey).

Each is one control of the worker (l3worker/serving/controls.py), run between two steps of the
engine's loop by whichever driver serves (in-process, or every engine core); bad input is a 400
in the worker's words, naming the tensor or field that differs.
"""
from __future__ import annotations

from fastapi import FastAPI, Query

from l3worker.serving.openai.engine_client import EngineClient
from l3worker.serving.openai.protocol import _Body


class UpdateWeightsFromDiskRequest(_Body):
    """SGLang's body (its other fields are ignored)."""

    model_path: str  # a checkpoint directory or a Hub id of the running model's architecture
    weight_version: str | None = None  # None: the count of updates so far


class PauseGenerationRequest(_Body):
    mode: str = "abort"  # abort: unfinished requests end (finish_reason "abort"); keep: they wait


def add_rollout_routes(app: FastAPI, client: EngineClient, *, sleep: bool, weight_updates: bool) -> None:
    if sleep:
        _add_sleep_routes(app, client)
    if weight_updates:
        _add_weight_routes(app, client)


def _add_sleep_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post("/sleep")
    async def sleep(level: int = 1) -> dict:
        """Level 1 frees the KV cache (on an accelerator the weights go to host memory), level 2
        the weights too (update them after waking). No request may be unfinished: pause first."""
        out = await client.control("sleep", {"level": level})
        return {"level": out["level"], "freed_bytes": out["freed_bytes"]}

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> dict:
        """?tags=weights&tags=kv_cache: what to give back (both when none is given)."""
        out = await client.control("wake_up", {"tags": tags})
        return {key: out[key] for key in ("level", "weights_need_update", "restored_bytes")}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict:
        return {"is_sleeping": (await client.control("is_sleeping", {}))["is_sleeping"]}


def _add_weight_routes(app: FastAPI, client: EngineClient) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest) -> dict:
        """Loads a checkpoint of the same architecture in place; the prefix cache is flushed."""
        out = await client.control("update_weights_from_disk", {"model_path": req.model_path,
                                                                "weight_version": req.weight_version})
        return {"success": True, "message": f"weights loaded from {req.model_path}",
                "weight_version": out["weight_version"]}

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationRequest | None = None) -> dict:
        mode = (req or PauseGenerationRequest()).mode
        out = await client.control("pause_generation", {"mode": mode})
        return {"success": True, "mode": mode, "num_unfinished_requests": out["num_unfinished_requests"]}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        await client.control("continue_generation", {})
        return {"success": True}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        """Forgets every cached KV page no request uses."""
        return {"success": True, "freed_pages": (await client.control("reset_prefix_cache", {}))["freed_pages"]}
