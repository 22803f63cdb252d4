"""What an RL trainer asks of its rollout engine, on DistributedWorker: sleep and wake, new
weights without a restart, pause and resume, and a prefix-cache reset (vLLM's sleep mode and
SGLang's update_weights_from_*, one engine loop under all of them).

Each runs between two steps of that loop (Engine.call_between_steps) with no step in flight, then
sends the children one control (chip_child.protocol.Control). Input is checked here, before a
child sees it: a checkpoint of another architecture is refused naming the tensor or the field
that differs. New weights flush the prefix cache, since cached K/V belongs to the old weights.
Tensors travel to the children through shared memory (a safetensors file in /dev/shm, one bucket
at a time), never pickled.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from chip_child.models.loader import ModelConfig, expected_tensor_shapes, load_config, unit_of
from chip_child.protocol import Control, encode
from l3worker.errors import WorkerError
from l3worker.hub import resolve_model
from l3worker.worker.shared_weights import (BUCKET_BYTES, check_tensors, header_entries, header_shapes, named_items,
                                             shared_buckets)

PAUSE_MODES = ("abort", "keep")
# Config fields a weight update must not change: the runtime's buffers and tables are built from them.
SAME_CONFIG = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "qkv_bias", "o_bias",
               "qk_norm", "rope_scaling", "quantization", "moe")


def check_checkpoint(path: str, current: ModelConfig, quantization: str | None) -> None:
    """ValueError naming the first tensor, then config field, of `path` that the running model
    cannot take in place."""
    new = load_config(path, quantization)
    expected = expected_tensor_shapes(current)
    found = {name: shape for name, (shape, _) in header_shapes(path).items()}
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(f"model_path: {path} has no tensor {name!r}, which the running model has")
        if found[name] != shape:
            raise ValueError(f"model_path: tensor {name!r} has shape {list(found[name])} in {path}, the running "
                             f"model's is {list(shape)}")
    for field in SAME_CONFIG:
        if getattr(new, field) != getattr(current, field):
            raise ValueError(f"model_path: {path} has {field}={getattr(new, field)!r}, the running model "
                             f"{getattr(current, field)!r}: another architecture cannot be loaded in place")


class RolloutControls:
    """DistributedWorker's rollout methods (a mixin: it reads the worker's engine, children and config)."""

    weight_version: str = "default"  # reported by the server in /v1/models and in each response
    _sleep_level: int = 0
    _weights_from_tensors: bool = False  # a restart could not load them again
    _weight_updates: int = 0

    # -- sleep ---------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        """Frees the KV cache (level 1; on an accelerator the weights go to host memory) or the KV
        cache and the weights (level 2, which needs a weight update after wake_up). No request may
        be unfinished. Returns {"level", "freed_bytes"} (the children's resident or device memory)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if not self.runtime_config.enable_sleep_mode:
            raise ValueError("sleep needs enable_sleep_mode=True (vLLM's --enable-sleep-mode)")

        def run() -> dict:
            unfinished = len(self.engine.requests)
            if unfinished:
                raise ValueError(f"sleep: {unfinished} requests are unfinished; pause_generation(mode='abort') "
                                 "or let them finish first")
            replies = self._control("sleep", {"level": level})
            self.engine.scheduler.forget_cache()  # the K/V is gone
            self._sleep_level = max(r["level"] for r in replies)
            self.engine.refusal = "the engine sleeps: wake_up() first"
            return {"level": self._sleep_level, "freed_bytes": sum(r["freed_bytes"] for r in replies)}

        return self._between_steps(run)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Gives back the memory of `tags` ("weights", "kv_cache"; both when None)."""
        if tags is not None and (not isinstance(tags, (list, tuple)) or
                                 any(t not in ("weights", "kv_cache") for t in tags)):
            raise ValueError(f"tags must be a list of 'weights' and 'kv_cache', got {tags!r}")

        def run() -> dict:
            replies = self._control("wake_up", {"tags": list(tags) if tags else None})
            self._sleep_level = max(r["level"] for r in replies)
            need_update = any(r["weights_need_update"] for r in replies)
            self.engine.refusal = ("the engine sleeps: wake_up() first" if self._sleep_level else
                                   "the weights were dropped by sleep(level=2): update them first" if need_update
                                   else None)
            self.engine.wake()
            return {"level": self._sleep_level, "weights_need_update": need_update,
                    "restored_bytes": sum(r["restored_bytes"] for r in replies)}

        return self._between_steps(run)

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    # -- new weights -----------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict:
        """Loads a checkpoint of the same architecture into the running model, layer by layer, in
        place; later restarts load it too. ValueError names what differs."""
        path = resolve_model(model_path, None, None, "model_path")
        check_checkpoint(path, self.model_config, self.runtime_config.quantization)

        def run() -> dict:
            self._control("update_weights", {"dir": path})
            self.runtime_config.model_dir = path
            self._weights_from_tensors = False
            return self._weights_changed(weight_version)

        return self._between_steps(run)

    def update_weights_from_tensor(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                                   weight_version: str | None = None, flush: bool = True,
                                   bucket_bytes: int = BUCKET_BYTES) -> dict:
        """Copies named tensors (HF names, any float dtype, any device) into the running model
        through shared memory, `bucket_bytes` at a time. A layer may be split over several calls
        with flush=False; the last call (flush=True) fails naming what no call gave."""
        items = named_items(named_tensors)
        check_tensors([(n, t.shape, t.is_floating_point()) for n, t in items], self.model_config)

        def run() -> dict:
            pending: list[str] = []
            for folder, names, _ in shared_buckets(items, bucket_bytes):
                pending = self._control("update_weights", {"dir": folder, "names": names})[0]["pending_tensors"]
            return self._after_tensors(pending, flush, weight_version)

        return self._between_steps(run)

    def update_weights_from_shared(self, folder: str, names: list[str], weight_version: str | None = None,
                                   flush: bool = True) -> dict:
        """One bucket another process wrote with shared_buckets (the engine core's side of
        CoreClient.update_weights_from_tensor): `names` from the safetensors file in `folder`."""
        check_tensors(header_entries(folder, names), self.model_config)

        def run() -> dict:
            pending = self._control("update_weights", {"dir": folder, "names": list(names)})[0]["pending_tensors"]
            return self._after_tensors(pending, flush, weight_version)

        return self._between_steps(run)

    def _after_tensors(self, pending: list[str], flush: bool, weight_version: str | None) -> dict:
        self._weights_from_tensors = True
        if pending and flush:
            self._control("drop_pending_weights", {})
            raise ValueError(f"named_tensors: incomplete layers, the rest of them never came: missing "
                             f"{_missing(self.model_config, pending)}")
        result = self._weights_changed(weight_version) if not pending else {"weight_version": self.weight_version}
        return {**result, "pending_tensors": pending}

    # -- pause and resume --------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> int:
        """Stops stepping: "abort" ends every unfinished request (finish_reason "abort"), "keep"
        holds them with their rows, pages and place until continue_generation(). New requests
        wait. Returns how many requests were unfinished."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")

        def run() -> int:
            self.engine.paused = True
            ids = list(self.engine.requests)
            if mode == "abort":
                for request_id in ids:
                    self.engine.abort(request_id)
            return len(ids)

        return self._between_steps(run)

    def continue_generation(self) -> None:
        self.engine.paused = False
        self.engine.wake()

    @property
    def is_paused(self) -> bool:
        return self.engine.paused

    def reset_prefix_cache(self) -> int:
        """Forgets every cached page no request uses; returns how many."""
        return self._between_steps(lambda: self.engine.scheduler.pages.reset_prefix_cache())

    # -- internals -------------------------------------------------------------------------------------
    def _between_steps(self, fn):
        self.prepare()
        return self.engine.call_between_steps(fn)

    def _control(self, name: str, args: dict) -> list[dict]:
        if self._nodes:
            raise ValueError(f"{name} is not supported across nodes yet (nnodes={self.layout.nnodes})")
        timeout = None if self.step_timeout_s is None else max(self.step_timeout_s, 600.0)
        payload = encode(Control(name, args))
        for child in self._children:
            child.send(payload, timeout, self.engine.stopping)
        return [child.control_reply(timeout, self.engine.stopping) for child in self._children]

    def _weights_changed(self, weight_version: str | None) -> dict:
        self.engine.scheduler.forget_cache()
        if self.engine.refusal is not None and not self._sleep_level:
            self.engine.refusal = None  # the weights level 2 dropped are back
            self.engine.wake()
        self._weight_updates += 1
        self.weight_version = weight_version if weight_version is not None else str(self._weight_updates)
        return {"weight_version": self.weight_version}

    def check_relaunch(self) -> None:
        """A restart loads the weights from disk: refused once they came from tensors."""
        if self._weights_from_tensors:
            raise WorkerError("a chip-child failed after update_weights_from_tensor, whose weights a restart "
                               "cannot load again: the engine stops (update from disk to keep restarts)")


def _missing(cfg: ModelConfig, pending: list[str]) -> list[str]:
    """The tensors that would complete the units `pending` tensors belong to."""
    units = {unit_of(n) for n in pending}
    return sorted(n for n in expected_tensor_shapes(cfg) if unit_of(n) in units and n not in pending)
