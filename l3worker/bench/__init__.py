"""`l3worker bench serve | throughput | latency`, with vLLM's `vllm bench` flag names and result fields.

- `cli.py`: the argument parsers and their checks; `commands.py`: what each command runs, prints and saves
- `datasets.py`: random, sharegpt and prefix_repetition requests; `tokenizer.py`: token counting for them
- `serve.py`: the HTTP load client; `metrics.py`: per-request timings and vLLM's summary fields
- `offline.py`: throughput and latency on a DistributedWorker in this process
- `plot.py`: a request-rate sweep as a PNG (matplotlib, the `plot` extra)
"""
