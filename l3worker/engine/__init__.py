"""The engine: the one step loop, its scheduler, KV page pool, requests, outputs and metrics.
May import params, errors, structured/, the child handles it drives (worker's child_process, doorbell,
shared_buffers) and the child's config, protocol and loader; never serving/ or the DistributedWorker."""
