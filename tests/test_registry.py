"""Model sources: embedded, local folder, hub (from a local fixture cache), and clear errors."""

import shutil

import pytest

from mixbit.models.registry import ModelSourceError, embedded_names, resolve

from .conftest import run_cli


def test_embedded_default_resolves(embedded_path):
    r = resolve("embedded:tiny-qwen3.5")
    assert r.path == embedded_path and r.kind == "embedded"
    assert r.model_type == "qwen3_5" and not r.quantized
    assert "tiny-qwen3.5" in embedded_names()


def test_unknown_embedded_name_lists_the_real_ones():
    with pytest.raises(ModelSourceError, match="embedded models: .*tiny-qwen3.5"):
        resolve("embedded:huge")


def test_local_folder(tmp_path, embedded_path):
    folder = tmp_path / "my-model"
    shutil.copytree(embedded_path, folder)
    r = resolve(str(folder))
    assert r.kind == "local" and r.path == folder and r.name == "my-model"


@pytest.mark.parametrize("source, needle", [
    ("/no/such/folder", "is not embedded:<name>, an existing folder, or a hub repo id"),
    ("./relative/missing", "is not embedded:<name>"),
    ("a/b/c", "is not embedded:<name>"),
])
def test_bad_sources(source, needle):
    with pytest.raises(ModelSourceError, match=needle):
        resolve(source)


def test_file_instead_of_folder(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ModelSourceError, match="is a file"):
        resolve(str(f))


def test_corrupt_config_json(tmp_path, embedded_path):
    folder = tmp_path / "broken"
    shutil.copytree(embedded_path, folder)
    (folder / "config.json").write_text('{"model_type": "qwen3_5", ')
    with pytest.raises(ModelSourceError, match="config.json is not valid JSON"):
        resolve(str(folder))
    (folder / "config.json").write_text('{"hidden_size": 4}')
    with pytest.raises(ModelSourceError, match='no "model_type"'):
        resolve(str(folder))
    (folder / "config.json").write_text('{"model_type": "no_such_arch"}')
    with pytest.raises(ModelSourceError, match="not supported by the installed mlx-lm"):
        resolve(str(folder))


def test_folder_without_weights(tmp_path, embedded_path):
    folder = tmp_path / "noweights"
    shutil.copytree(embedded_path, folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelSourceError, match="no \\*.safetensors"):
        resolve(str(folder))


def make_hub_cache(cache, repo_id, files_from, revision="main", commit="a" * 40):
    """A Hugging Face cache laid out exactly as huggingface_hub writes it (blobs, snapshots, refs)."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for f in files_from.iterdir():
        if f.is_file():
            blob = repo_dir / "blobs" / f"{f.name}.blob"
            shutil.copy2(f, blob)
            (snap / f.name).symlink_to(blob)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / revision).write_text(commit)
    return snap


def test_hub_id_from_local_cache(tmp_path, embedded_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = make_hub_cache(tmp_path / "hub", "acme/tiny-qwen", embedded_path)
    r = resolve("acme/tiny-qwen", hub_cache_dir=str(tmp_path / "hub"))
    assert r.kind == "hub" and r.path == snap and r.model_type == "qwen3_5"
    assert r.name == "acme/tiny-qwen"


def test_hub_id_not_cached_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError) as err:
        resolve("acme/not-here", hub_cache_dir=str(tmp_path / "hub"))
    msg = str(err.value)
    assert "not in the local cache" in msg and "--model DIR" in msg


def test_hub_id_without_network_is_a_clear_error(tmp_path):
    # No network here: point the hub client at a closed loopback port, so the failure is fast
    # and certain, as it is for a user behind a firewall.
    out = run_cli("chat", "hi", "--model", "acme/not-here",
                  env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
                       "HF_HOME": str(tmp_path / "hf")})
    assert out.returncode == 2, out.stderr
    assert "cannot reach the Hugging Face hub to fetch acme/not-here" in out.stderr
    assert "--model DIR" in out.stderr and "Traceback" not in out.stderr


def test_cli_reports_bad_model_without_traceback():
    out = run_cli("chat", "hi", "--model", "/nonexistent/model")
    assert out.returncode == 2
    assert out.stderr.startswith("mixbit: error:") and "Traceback" not in out.stderr
