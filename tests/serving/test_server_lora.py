"""LoRA adapters over HTTP, as vLLM serves them, in both layouts (`l3worker serve` with its
engine-core process, and the in-process AsyncEngine): a request picks an adapter by "model" and
gets offline generate()'s tokens with that adapter; /v1/models lists each adapter with its parent;
an unknown adapter is vLLM's 404; with runtime updating allowed an adapter is loaded and unloaded
while serving (a rank over --max-lora-rank is a 400 naming it, an unknown one to unload a 404);
without it the endpoints are 404; and the flags vLLM would refuse are refused at start.

Checkpoints are random tiny Qwen3s without a tokenizer: prompts and answers are token ids
(logprobs tokens as "token_id:N")."""
from __future__ import annotations

import httpx
import pytest

from l3worker import DistributedWorker, SamplingParams
from l3worker.lora import LoRARequest
from lora_adapters import write_adapter
from server_helpers import Served

SERVE = ("--device", "cpu", "--max-model-len", "256", "--block-size", "16", "--max-num-seqs", "4")
PROMPT = [5, 80, 17, 200, 3, 9, 44, 2]


@pytest.fixture(scope="module")
def setup(make_checkpoint, tmp_path_factory):
    base = make_checkpoint()
    root = tmp_path_factory.mktemp("served-adapters")
    paths = {"a0": write_adapter(base, root / "a0", seed=21, r=4), "a1": write_adapter(base, root / "a1", seed=22, r=2),
             "wide": write_adapter(base, root / "wide", seed=23, r=16)}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with DistributedWorker(str(base), device="cpu", max_seq_len=256, page_size=16, enable_lora=True) as w:
        want = {name: w.generate([PROMPT], params, lora_request=LoRARequest(name, i + 1, str(paths[name])))[0]
                .outputs[0].token_ids for i, name in enumerate(("a0", "a1"))}
        want["base"] = w.generate([PROMPT], params)[0].outputs[0].token_ids
    return str(base), {k: str(v) for k, v in paths.items()}, want


def greedy(http: httpx.Client, model: str | None) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    return http.post("/v1/completions", json=body if model is None else {**body, "model": model})


def token_ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


@pytest.fixture(scope="module", params=["engine-core", "in-process"])
def url(request, setup):
    base, paths, _ = setup
    if request.param == "engine-core":
        s = Served(base, *SERVE, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                   "--max-lora-rank", "8", "--lora-modules", f"a0={paths['a0']}", "--allow-runtime-lora-updating")
        try:
            yield s.ready()[1]
        finally:
            s.stop()
        return
    from l3worker.serving.runner import ServeOptions, ServerThread

    worker = DistributedWorker(base, device="cpu", max_batch_size=4, max_seq_len=256, page_size=16, enable_lora=True,
                               max_loras=2, max_lora_rank=8)
    options = ServeOptions(port=0, served_model_names=("base",), lora_modules=(("a0", paths["a0"], None),),
                           allow_runtime_lora_updating=True)
    with ServerThread(worker, options=options) as srv:
        yield srv.url


def test_a_request_picks_its_adapter_by_model_and_gets_offline_tokens(url, setup) -> None:
    _, paths, want = setup
    with httpx.Client(base_url=url, timeout=120) as http:
        assert token_ids(greedy(http, "a0")) == want["a0"]
        assert token_ids(greedy(http, "base")) == token_ids(greedy(http, None)) == want["base"]
        r = greedy(http, "a0")
        assert r.json()["model"] == "a0"
        models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert models["a0"]["parent"] == "base" and models["a0"]["root"] == paths["a0"]
        assert models["base"]["parent"] is None
        missing = greedy(http, "nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "The model `nope` does not exist."


def test_adapters_load_and_unload_while_serving(url, setup) -> None:
    _, paths, want = setup
    with httpx.Client(base_url=url, timeout=120) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": paths["a1"]})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' added successfully."
        assert token_ids(greedy(http, "a1")) == want["a1"]
        assert "a1" in {m["id"] for m in http.get("/v1/models").json()["data"]}
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": paths["a1"]})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        wide = http.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": paths["wide"]})
        assert wide.status_code == 400
        assert "rank r=16 exceeds max_lora_rank=8" in wide.json()["error"]["message"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' removed successfully."
        assert greedy(http, "a1").status_code == 404
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
        assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'a1' cannot be found."
        assert token_ids(greedy(http, "a0")) == want["a0"]  # the others serve on


def test_without_runtime_updating_the_endpoints_are_404_and_bad_flags_are_refused(setup, capsys) -> None:
    base, paths, _ = setup
    s = Served(base, *SERVE, "--enable-lora", "--lora-modules", f'{{"name": "a0", "path": "{paths["a0"]}"}}')
    try:
        url = s.ready()[1]
        with httpx.Client(base_url=url, timeout=120) as http:
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": paths["a1"]})
            assert r.status_code == 404
            assert greedy(http, "a0").status_code == 200
    finally:
        s.stop()
    from l3worker.serving.cli import main  # in this process: each refusal comes before anything starts

    for flags, message in [(("--lora-modules", f"a0={paths['a0']}"), "need --enable-lora"),
                           (("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"w={paths['wide']}"),
                            "--lora-modules w: lora_path: the adapter's rank r=16 exceeds max_lora_rank=8"),
                           (("--enable-lora", "--allow-runtime-lora-updating", "--api-server-count", "2"),
                            "runtime LoRA updating needs --api-server-count 1"),
                           (("--enable-lora", "--lora-modules", "justaname"), "expected name=path")]:
        try:
            code = main(["serve", base, *SERVE, "--port", "0", *flags])
        except SystemExit as e:  # argparse's refusal
            code = e.code
        assert code == 2 and message in capsys.readouterr().err, flags
