"""`l3worker serve`: an OpenAI-compatible HTTP API over the engine loop.

app.py (routes), protocol.py (request bodies), translate.py (requests to engine inputs), endpoint.py (what the
generation endpoints share: envelope, usage, log line, SSE, disconnects), completions.py and chat_completions.py
(what each of them adds: prompts, choice and delta shapes), chat_reply.py (reasoning and tool calls read from
chat replies), tokenizer_info.py (GET /tokenizer_info), responses.py (OpenAI's output shapes), chat.py (chat
templates), tokens.py (token text and bytes), engine_client.py (engine calls), middleware.py (log, API key, body
limit), runner.py (engine and uvicorn lifetimes), cli.py (the command line), launcher.py (the engine-core
and extra API server processes `serve` starts), core_client.py (an API server's engine: the engine-core
process(es) over ZeroMQ), router.py (which data-parallel engine core a request goes to), api_server.py (API servers 1..N-1 of --api-server-count),
dp_link.py (data-parallel engines on other nodes: the layout, registration and heartbeats of their tcp link),
dp_remote.py (the head's relay for them), dp_headless.py (a headless node's engine cores)."""
