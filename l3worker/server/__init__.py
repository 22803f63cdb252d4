"""`l3worker serve`: an OpenAI-compatible HTTP API over the engine loop.

app.py (routes), protocol.py (request bodies), translate.py (requests to engine inputs), completions.py and
chat_completions.py (the two generation endpoints), responses.py (OpenAI's output shapes), chat.py (chat
templates), tokens.py (token text and bytes), engine_client.py (engine calls, aborts), middleware.py (log,
API key, body limit), runner.py (engine and uvicorn lifetimes), cli.py (the command line)."""
