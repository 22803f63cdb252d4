"""The L3 parent's hold on its chip-children: DistributedWorker, child processes, shared buffers,
doorbell, CPU placement. May import engine/ and distributed/ (follower nodes); never serving/."""
