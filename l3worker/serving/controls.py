"""The rollout controls the server offers (RolloutControls on DistributedWorker, l3worker/worker/rollout.py),
by name, as both serving drivers run them: AsyncEngine in-process, the engine core for its API
servers (core_wire.py's ["control", ...] message). Arguments and results are plain dicts, so that
they cross the wire as msgpack; every result carries the worker's weight_version after the call.
"""
from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Callable

from l3worker.lora import LoRARequest
from l3worker.worker.shared_weights import named_items, shared_buckets

CONTROLS: dict[str, Callable[..., dict]] = {
    "sleep": lambda w, a: w.sleep(a.get("level", 1)),
    "wake_up": lambda w, a: w.wake_up(a.get("tags")),
    "is_sleeping": lambda w, a: {"is_sleeping": w.is_sleeping},
    "update_weights_from_disk": lambda w, a: w.update_weights_from_disk(a["model_path"], a.get("weight_version")),
    "pause_generation": lambda w, a: {"num_unfinished_requests": w.pause_generation(a.get("mode", "abort"))},
    "continue_generation": lambda w, a: w.continue_generation() or {},
    "reset_prefix_cache": lambda w, a: {"freed_pages": w.reset_prefix_cache()},
    "update_weights_from_shared": lambda w, a: w.update_weights_from_shared(a["folder"], a["names"],
                                                                            a.get("weight_version"), a["flush"]),
    # LoRA adapters (l3worker/worker/lora_controls.py): read and checked when added
    "add_lora": lambda w, a: {"added": w.add_lora(LoRARequest(a["lora_name"], a["lora_int_id"], a["lora_path"]))},
    "remove_lora": lambda w, a: {"removed": w.remove_lora(a["lora_int_id"])},
}


async def push_tensors(control: Callable[[str, dict], Awaitable[dict]], named_tensors: Any,
                       weight_version: str | None, flush: bool, bucket_bytes: int) -> dict:
    """update_weights_from_tensor through a driver's `control` (CoreClient's: an engine core in
    another process): this process writes each bucket to shared memory and the engine core loads
    it; the last bucket flushes. Names and shapes are checked there, from each bucket's header."""
    result: dict = {}
    for folder, names, last in shared_buckets(named_items(named_tensors), bucket_bytes):
        result = await control("update_weights_from_shared", {"folder": folder, "names": names,
                                                              "weight_version": weight_version,
                                                              "flush": flush and last})
    return result


def run_control(worker, name: str, args: dict) -> dict:
    """Runs control `name` on `worker`, blocking until the engine's loop ran it between two steps
    (call it off the event loop). Raises the worker's ValueError for bad input."""
    if name not in CONTROLS:
        raise ValueError(f"unknown control {name!r}; known: {', '.join(CONTROLS)}")
    return {**CONTROLS[name](worker, args), "weight_version": worker.weight_version}


def combine(results: list[dict]) -> dict:
    """The replies of several data-parallel engines as one: counts and bytes add up, flags are true
    if any engine's is, a level is the deepest, texts (weight_version) are joined when they differ."""
    if len(results) == 1:
        return results[0]
    out: dict = {}
    for key in results[0]:
        values = [r[key] for r in results]
        if isinstance(values[0], bool):
            out[key] = any(values)
        elif key == "level":
            out[key] = max(values)
        elif isinstance(values[0], int):
            out[key] = sum(values)
        else:
            out[key] = "/".join(dict.fromkeys(str(v) for v in values))
    return out
