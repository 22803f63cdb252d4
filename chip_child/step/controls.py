"""The child's side of the between-steps controls (chip_child.protocol.Control): sleep, wake and
new weights. The parent sends one only when no step is in flight, and has checked its input
(names, shapes, architecture); what is left to refuse here is a state the child is not in."""
from __future__ import annotations

import torch

from chip_child.models.fp8_linear import keeps_fp8_on
from chip_child.models.loader import load_config
from chip_child.models.weight_update import WeightUpdater
from chip_child.step.runtime import ChipRuntime
from chip_child.step.sleep import Sleeper


class RuntimeControls:
    def __init__(self, rt: ChipRuntime):
        self.rt = rt
        self.sleeper = Sleeper(rt.state["kv_cache"], rt.weights, rt.device)
        self._updater: WeightUpdater | None = None

    def handle(self, name: str, args: dict) -> dict:
        """Runs one control; ValueError for what it cannot take (the child goes on serving)."""
        try:
            return self._handle(name, args)
        finally:  # one that failed half-way may have moved tensors too
            if self.rt.decode_layers is not None:
                self.rt.decode_layers.weights_moved()

    @torch.inference_mode()  # the pool's tensors are inference tensors
    def _handle(self, name: str, args: dict) -> dict:
        if name == "sleep":
            return self.sleeper.sleep(args.get("level", 1))
        if name == "wake_up":
            result = self.sleeper.wake_up(args.get("tags"))
            graphs = self.rt.graphs
            if result["moved"] and graphs is not None:  # they read the old addresses: captured again, rows idle
                self.rt.graphs = None
                self.rt.capture_graphs(graphs.fresh())
                result["graphs_recaptured"] = True
            return result
        if name == "update_weights":
            if self.sleeper.state.weights_asleep:
                raise ValueError("the weights sleep: wake_up(tags=['weights']) before updating them")
            result = self.updater.update_from(args["dir"], args.get("names"))
            if not result["pending_tensors"]:
                self.sleeper.weights_updated()
            return result
        if name == "drop_pending_weights":
            return {"dropped": self.updater.drop_pending()}
        raise ValueError(f"unknown control {name!r}")

    @property
    def updater(self) -> WeightUpdater:
        if self._updater is None:
            rt, cfg = self.rt, self.rt.cfg
            full = load_config(cfg.model_dir, cfg.quantization)
            self._updater = WeightUpdater(rt.weights, full, rt.dtype, rt.device, cfg.tp_rank, cfg.tp_size,
                                          cfg.enable_expert_parallel, rt.cpu_prepack,
                                          keeps_fp8_on(rt.device, full.quantization))
        return self._updater

