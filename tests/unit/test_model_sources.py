"""Where a model comes from: hub ids resolved from the local Hugging Face cache (offline), and our GGUF
header reader against the gguf package's.

The cache is a fake one built in the test's temp dir with huggingface_hub's layout
(models--org--name/{refs/main, snapshots/<commit>/...}), named by $HF_HUB_CACHE; it holds the tiny
safetensors model (tests/support/tiny_model.py) and GGUF-only repositories.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from common.model.loader import load_model
from common.text.model_info import ModelNotFoundError, load_model_info, read_gguf_header, resolve_model
from tests.support.tiny_model import tiny_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _snapshot(cache: Path, repo: str) -> Path:
    """An empty snapshot of `repo` (its main ref) in a huggingface_hub cache at `cache`."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    return snap


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
    return cache


def test_hub_id_of_a_safetensors_model(hub_cache: Path) -> None:
    snap = _snapshot(hub_cache, "tiny-org/tiny-llama")
    for f in Path(tiny_model_path()).iterdir():
        shutil.copy(f, snap / f.name)
    source = resolve_model("tiny-org/tiny-llama")
    assert (Path(source.path), source.hub_id) == (snap, "tiny-org/tiny-llama")
    info = load_model_info("tiny-org/tiny-llama")
    assert info.model_id == "tiny-org/tiny-llama"  # the name clients use, not the commit folder's
    model, tokenizer = load_model("tiny-org/tiny-llama")
    assert model.config.model_id == "tiny-org/tiny-llama"
    assert tokenizer.encode("hello") == info.tokenizer.encode("hello")


def test_hub_id_of_gguf_repositories(hub_cache: Path) -> None:
    one = _snapshot(hub_cache, "org/one-gguf")
    (one / "model-q8_0.gguf").write_bytes(b"GGUF")
    (one / "README.md").write_text("hi")
    assert resolve_model("org/one-gguf").path == str(one / "model-q8_0.gguf")
    two = _snapshot(hub_cache, "org/two-gguf")
    for name in ("a-q4_k_m.gguf", "b-q8_0.gguf"):
        (two / name).write_bytes(b"GGUF")
    with pytest.raises(
        ModelNotFoundError, match=r"2 GGUF files \(a-q4_k_m.gguf, b-q8_0.gguf\).*org/two-gguf/<file>"
    ):
        resolve_model("org/two-gguf")
    source = resolve_model("org/two-gguf/b-q8_0.gguf")
    assert (source.path, source.hub_id) == (str(two / "b-q8_0.gguf"), "org/two-gguf/b-q8_0.gguf")


def test_missing_models_are_one_line(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as e:
        load_model_info("some-org/not-downloaded")
    msg = str(e.value)
    assert "'some-org/not-downloaded'" in msg and "hf download some-org/not-downloaded" in msg
    assert "\n" not in msg
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)
    with pytest.raises(ModelNotFoundError, match="not found: expected a .gguf file"):
        resolve_model("./no/such/model.gguf")
    with pytest.raises(ModelNotFoundError, match="hf download"):
        load_model("some-org/not-downloaded")


def _write_everything(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**60))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ 日本 🙂")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ß", "\n\n"])
    w.add_array("t.bools", [True, False])
    w.add_tensor("a", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b", np.ones((3, 64), dtype=np.float16))
    q = gguf.quants.quantize(
        np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64), gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("c", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_header_matches_the_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    _write_everything(path)
    ours = read_gguf_header(str(path))
    reader = gguf.GGUFReader(str(path))
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.meta == theirs
    assert ours.meta["t.f32"] == np.float32(1e-5) and ours.meta["t.str"] == "héllo ▁ 日本 🙂"
    assert [(t.name, t.shape, t.ggml_type, t.offset) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset) for t in reader.tensors
    ]
    data = path.read_bytes()
    a = ours.tensors[0]
    assert np.array_equal(np.frombuffer(data, np.float32, 64, a.offset), np.arange(64, dtype=np.float32))


def test_gguf_header_refuses_other_files(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_header(str(tmp_path / "x.gguf"))
    _write_everything(tmp_path / "ok.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "ok.gguf").read_bytes()[:200])
    with pytest.raises(ValueError, match="corrupt GGUF header"):
        read_gguf_header(str(tmp_path / "cut.gguf"))
