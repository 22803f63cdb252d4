"""Token counting for the client side of `bench serve`: a local tokenizer.json (--tokenizer), or the
server's own /tokenize and /detokenize (vLLM's and l3worker's), so no checkpoint is needed."""
from __future__ import annotations

from pathlib import Path

import httpx


class LocalTokenizer:
    """A `tokenizers.Tokenizer`: a worker's, or one from a file (`from_path`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str) -> "LocalTokenizer":
        """A tokenizer.json file, or a checkpoint directory holding one."""
        from tokenizers import Tokenizer

        file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise ValueError(f"--tokenizer: no tokenizer.json at {path}")
        return cls(Tokenizer.from_file(str(file)))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def close(self) -> None:
        pass


class ServerTokenizer:
    """The served model's tokenizer over HTTP (one request per call: datasets are sampled once)."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str]):
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=60)
        self.model = model

    def _post(self, path: str, body: dict) -> dict:
        r = self.client.post(path, json={"model": self.model, **body})
        if r.status_code != 200:
            raise ValueError(f"the server's {path} answered {r.status_code}: {r.text[:200]} "
                             "(give --tokenizer PATH to count tokens locally)")
        return r.json()

    def encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["prompt"]

    def close(self) -> None:
        self.client.close()
