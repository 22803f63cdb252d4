"""DistributedWorker.stats(), built from the worker's state (kept here: the worker's module is long)."""
from __future__ import annotations


def worker_stats(worker) -> dict:
    """DistributedWorker.stats(): the state, the children's start-up report and the engine's counters."""
    info = worker._children[0].info if worker._children else {}
    return {
        "state": worker._state,
        "device": info.get("device"),
        "dtype": info.get("dtype"),
        "child_pids": worker.child_pids,
        "child_setup_s": info.get("setup_s"),
        "child_threads": info.get("threads"),
        "child_cores": info.get("cores"),
        "cpu_layout": worker.cpu_layout_in_use,  # what the cpu children run with; None off the cpu
        "cpu_layout_preferred": info.get("layout_preferred"),  # auto's timing-free rule; None: no trial
        "cpu_layout_step_s": info.get("layout_step_s"),  # the trial's prefill and decode steps under each
        "cpu_layout_other_cores": info.get("layout_other_cores"),  # cores other processes kept busy then
        "cpu_layout_trial_s": info.get("layout_trial_s"),  # how long that took
        "cpu_step_core": info.get("step_core"),  # the core the child's step thread has to itself
        "prepare_s": worker._prepare_s,
        "tensor_parallel_size": worker.layout.tensor_parallel_size,
        "nnodes": worker.layout.nnodes,
        "pipeline_depth": worker.pipeline_depth,
        "copy_policy": worker.runtime_config.copy_policy,
        "attention_backend": info.get("attention_backend"),
        "decode_graphs": info.get("decode_graphs"),  # the lane buckets captured; [] when off
        "fused_kernels": info.get("fused_kernels"),  # "triton" or "torch" (chip_child.models.fused)
        "cpu_prepack": info.get("cpu_prepack"),  # linear layers prepacked at load (chip_child.models.prepack)
        # what runs them: "amx_bf16", "avx512_bf16", "avx2_bf16" (ours), "onednn"; None: torch.mm
        "cpu_linear": info.get("cpu_linear"),
        # our kernel's packed weights on huge pages: chip_child.cpu_kernels.huge_pages.HugePageStats
        "cpu_huge_pages": info.get("cpu_huge_pages"),
        "moe_experts": info.get("moe_experts"),  # [first, count] held by rank 0; None: not a MoE model
        "kv_pages_total": worker.runtime_config.total_pages - 1,
        "kv_pages_free": worker.engine.scheduler.pages.num_free if worker.engine.scheduler else None,
        "generate_calls": worker._generate_calls,
        "requests_served": worker._requests_served,
        "last_generate": worker._last.summary(),
        "speculative": worker.engine.speculation.summary() if worker.speculative_config else None,
    }
