"""Hub ids wherever a model directory is taken, resolved by huggingface_hub from a cache laid out
as huggingface_hub lays it out (no network here: HF_HUB_OFFLINE answers from the cache alone)."""
from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants

from chip_child.models.tiny_model import ensure_tiny_model
from l3worker import DistributedWorker, SamplingParams
from hub_cache import COMMIT, REPO, lay_out_hub_cache
from l3worker.hub import resolve_model

@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_directory_is_taken_as_is_and_refuses_a_revision(tmp_path) -> None:
    assert resolve_model(tmp_path) == str(tmp_path)
    with pytest.raises(ValueError, match="revision"):
        resolve_model(tmp_path, revision="main")


def test_a_hub_id_resolves_to_its_cached_snapshot_by_branch_or_commit(tmp_path, offline) -> None:
    snapshot = lay_out_hub_cache(tmp_path)
    assert Path(resolve_model(REPO, download_dir=str(tmp_path))) == snapshot
    assert Path(resolve_model(REPO, revision=COMMIT, download_dir=str(tmp_path))) == snapshot
    lay_out_hub_cache(tmp_path, commit="f" * 40, ref="v2")
    assert Path(resolve_model(REPO, revision="v2", download_dir=str(tmp_path))).name == "f" * 40


@pytest.mark.parametrize("name", ["l3test/absent", "a/b/c", "./nowhere"])
def test_an_unknown_model_is_a_value_error_naming_the_field(tmp_path, offline, name) -> None:
    with pytest.raises(ValueError, match="model_dir") as err:
        resolve_model(name, download_dir=str(tmp_path), what="model_dir")
    assert name in str(err.value)


def test_the_worker_takes_a_hub_id_and_generates_what_the_directory_gives(tmp_path, offline) -> None:
    lay_out_hub_cache(tmp_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    with DistributedWorker(REPO, download_dir=str(tmp_path), max_batch_size=2, max_seq_len=64, page_size=16) as w:
        assert w.model_name == REPO
        by_id = w.generate([[1, 2, 3]], params)[0].token_ids
    with DistributedWorker(ensure_tiny_model(), max_batch_size=2, max_seq_len=64, page_size=16) as w:
        assert w.model_name == str(ensure_tiny_model())  # as the caller named it
        assert w.generate([[1, 2, 3]], params)[0].token_ids == by_id
