"""What the benchmarks share (imported by the scripts next to this file): random prompts and token
digests, the machine and its load, and the runners: the chip runtime's floor, a DistributedWorker,
transformers' generate, and any of them in a process of its own.

torch, transformers and the project are imported where they are used, not here: a runner in a
process of its own sets its environment (OMP_* and the like) before torch is first imported."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import platform
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from chip_child.protocol import Admit, Command
    from chip_child.step.runtime import ChipRuntime


# -- kernels -------------------------------------------------------------------------------------------
def past_cpu_kernel(kernel, rev: str, out_dir: str):
    """`kernel`'s source (a chip_child.cpu_kernels.build.CheckedKernel) as it was at git revision
    `rev`, built with that kernel's compile flags and that revision's headers (into the kernel
    cache) and bound as the kernel binds its own, for an A/B against the current one."""
    from chip_child.cpu_kernels.build import load

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout

    kernels = "chip_child/cpu_kernels"
    listed = git("ls-tree", "--name-only", f"{rev}:{kernels}").split()
    headers = {name: git("show", f"{rev}:{kernels}/{name}") for name in listed if name.endswith(".h")}
    for name, text in headers.items():  # quoted includes find these first, beside the source
        (Path(out_dir) / name).write_text(text)
    past = Path(out_dir) / f"{Path(kernel.source).stem}_past.cpp"
    # The cache key hashes the source and the working tree's headers: the past headers' hash goes in
    # the source, so that two revisions differing only in their headers do not share a build.
    tag = hashlib.sha256("".join(headers[n] for n in sorted(headers)).encode()).hexdigest()[:16]
    past.write_text(git("show", f"{rev}:{kernels}/{kernel.source}") + f"\n// headers of {rev}: {tag}\n")
    return kernel.bind(load(str(past), kernel.compile_flags))


# -- workloads -------------------------------------------------------------------------------------------
def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).astype(np.int32) for _ in range(count)]


def digest(tokens: np.ndarray, length: int = 16) -> str:
    """A short hash of token ids, to compare runs at a glance."""
    return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()[:length]


# -- the machine -----------------------------------------------------------------------------------------
def machine_info(**extra: Any) -> dict:
    """The cpu, core count and versions, then `extra`, then the load average at the start."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "transformers": hf_version, **extra,
            "loadavg_at_start": list(os.getloadavg())}


def busy_cores() -> tuple[float, float] | None:
    """(busy core-seconds of the whole machine, wall clock) from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), time.perf_counter()
    except (OSError, ValueError):
        return None


def cpu_seconds(pids: list[int]) -> float:
    """User + system time of these processes (all their threads) so far."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return total


class CpuMeter:
    """How busy the machine was while a workload ran, split into this benchmark (this process and
    its chip-children) and everything else: timings on a shared box mean little without it."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.start = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = busy_cores()
        if busy is None:
            return None
        return busy[0], sum(os.times()[:2]) + cpu_seconds(self.pids), busy[1]

    def cores(self) -> dict | None:
        end = self._sample()
        if end is None or self.start is None:
            return None
        wall = end[2] - self.start[2]
        busy, own = end[0] - self.start[0], end[1] - self.start[1]
        return {"this_benchmark_cores": own / wall, "other_processes_cores": max(busy - own, 0.0) / wall,
                "wall_s": wall}


def compute_cores(threads: int) -> list[int] | None:
    """The cores a worker's cpu child computes on; the floor and transformers are timed there
    too, so every variant's arithmetic runs on the same pinned cores."""
    from chip_child.device import plan_cores

    plan = plan_cores(1, threads)
    return plan.children[0] if plan else None


@contextmanager
def pinned(cores: list[int] | None):
    """This thread on `cores` for the block (a floor's loop runs in the benchmark's main thread)."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# -- runners ---------------------------------------------------------------------------------------------
class Floor:
    """The chip runtime's step in a loop in this process: no parent, no IPC. Each batch's commands
    are built before the clock starts, with page ids handed out from a free list in the order the
    scheduler takes them (prompt pages at admission, one triple per row at each page boundary)."""

    def __init__(self, rt: ChipRuntime, max_batch: int, page_size: int):
        import torch

        self.rt = rt
        self.page_size = page_size
        self.out = torch.zeros(max_batch, dtype=torch.int32)
        self.free_pages = list(range(1, rt.cfg.total_pages))
        self.step = 0
        self.previous_rows: list[int] = []

    def _commands(self, prompts: list[np.ndarray], new_tokens: int, admits: list[Admit] | None = None
                  ) -> tuple[list[Command], np.ndarray]:
        """The scheduler's commands for one batch admitted at once (greedy unless `admits` say
        otherwise), and its staging ids. The pages go back at once: the next batch's prefill
        finishes these rows first."""
        from chip_child.local import batch_commands
        from chip_child.protocol import Admit

        if admits is None:
            admits = [Admit(row, len(p), 0.0, 1.0, 0, 0) for row, p in enumerate(prompts)]
        cmds, owned = batch_commands(self.step, admits, [len(p) for p in prompts], new_tokens, self.page_size,
                                     self.free_pages, self.previous_rows)
        self.step += len(cmds)
        for pages in owned:
            self.free_pages += pages
        self.previous_rows = list(range(len(prompts)))
        return cmds, np.concatenate(prompts).astype(np.int32)


class L3:
    """DistributedWorker's generate of exactly `new_tokens` per prompt (no eos)."""

    def __init__(self, model_dir: str, **options: Any):
        from l3worker import DistributedWorker

        self.w = DistributedWorker(model_dir, **options)

    def generate(self, prompts: Sequence, new_tokens: int, **sampling: Any) -> np.ndarray:
        from l3worker import SamplingParams

        sampling = {"temperature": 0.0, **sampling}  # greedy unless told otherwise, as hf_generate is
        outs = self.w.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **sampling),
                               use_tqdm=False)
        return np.array([o.token_ids for o in outs], np.int32)

    def decode_records(self) -> list[dict]:
        """The last generate's decode steps (the worker's step records less the prefills)."""
        return [r for r in self.w.step_records() if not r["prefill"]]

    def close(self) -> None:
        self.w.close()


def hf_generate(model, prompts: Sequence, new_tokens: int, cache: str = "dynamic", timed: bool = False,
                device: str = "cpu") -> tuple[list[float], np.ndarray]:
    """transformers' greedy generate of exactly `new_tokens` per prompt (no eos), prompts
    left-padded into one batch: (decode step seconds, tokens [batch, new_tokens]). With `timed`, a
    logits processor stamps every step; the differences between consecutive stamps are the
    decode steps (otherwise no steps are reported)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(np.asarray(p, np.int64))
        mask[i, width - len(p):] = 1
    kwargs: dict[str, Any] = {"cache_implementation": "static"} if cache == "static" else {}
    if timed:
        kwargs["logits_processor"] = LogitsProcessorList([Clock()])
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None, **kwargs)
    return list(np.diff(stamps)), out[:, width:].cpu().numpy().astype(np.int32)


def _serve(conn, factory: Callable, args: tuple, env: dict) -> None:
    os.environ.update(env)  # before torch is imported here, and inherited by a chip-child
    try:
        runner = factory(*args)
        conn.send(("ready", runner.info() if hasattr(runner, "info") else {}))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        while (request := conn.recv()) is not None:
            try:
                t0 = time.perf_counter()
                result = runner.run(*request)
                conn.send(("ok", (time.perf_counter() - t0, result)))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if hasattr(runner, "close"):
            runner.close()


class Isolated:
    """`factory(*args)` built and run in a spawned process of its own, so that one variant's
    state (thread pools, allocator, transformers' caches) cannot slow another timed after it.
    `run(...)` returns (seconds the runner's run took in its process, what it returned); the
    runner's `info()`, if it has one, is `self.info`, less its "pids" (processes the runner
    started), which `self.pids` lists after the runner's own."""

    def __init__(self, name: str, factory: Callable, *args: Any, env: dict | None = None):
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child_conn, factory, args, env or {}), daemon=True)
        self.proc.start()
        status, self.info = self.conn.recv()
        if status == "error":
            self.close()
            raise RuntimeError(f"{name}: {self.info}")
        self.pids = [self.proc.pid, *self.info.pop("pids", [])]

    def run(self, *args: Any) -> tuple[float, Any]:
        self.conn.send(args)
        status, payload = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.name}: {payload}")
        return payload

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
