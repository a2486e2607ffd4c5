"""`kvdepot.demo.model._load_gguf`: a GGUF file is converted once per file and dtype and then
read from the per-user cache; a cache that cannot be written or read never fails the load.
Stand-in tokenizer and model classes: no transformers, no GGUF parsing."""

from __future__ import annotations

import json
import pathlib

import torch

from kvdepot.demo.model import _load_gguf


class _Saved:
    """A tokenizer or model class: ``from_pretrained`` of a GGUF file "converts" it, of a
    directory reads what ``save_pretrained`` wrote there."""

    converted: list[str] = []

    def __init__(self, value: str) -> None:
        self.value = value
        self.config = type("Config", (), {})()
        self.config.quantization_config = {"quant_method": "gguf"}

    @classmethod
    def from_pretrained(cls, where: str, gguf_file: str | None = None, **kw):
        if gguf_file is not None:
            cls.converted.append(gguf_file)
            return cls(f"{cls.__name__} of {gguf_file}")
        return cls(json.loads((pathlib.Path(where) / f"{cls.__name__}.json").read_text()))

    def save_pretrained(self, where: str) -> None:
        (pathlib.Path(where) / f"{type(self).__name__}.json").write_text(json.dumps(self.value))


class Tok(_Saved):
    pass


class Model(_Saved):
    pass


def test_converted_once_then_read_from_the_cache_a_damaged_copy_replaced_an_unwritable_cache_passed_over(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _Saved.converted = []

    tok, model = _load_gguf(gguf, torch.bfloat16, Tok, Model)
    assert (tok.value, model.value) == ("Tok of m.gguf", "Model of m.gguf")
    assert _Saved.converted == ["m.gguf", "m.gguf"]
    cached = list((tmp_path / "cache" / "kvdepot" / "demo").iterdir())
    assert [p.name for p in cached] == [f"m-4-{gguf.stat().st_mtime_ns}-bfloat16"]  # no temporary left
    assert "quantization_config" not in vars(model.config)  # saved as the plain dtype it was loaded in

    tok, model = _load_gguf(gguf, torch.bfloat16, Tok, Model)  # read back, not converted
    assert (tok.value, model.value) == ("Tok of m.gguf", "Model of m.gguf") and len(_Saved.converted) == 2

    _load_gguf(gguf, torch.float32, Tok, Model)  # another dtype: converted and kept apart
    assert len(_Saved.converted) == 4 and len(list(cached[0].parent.iterdir())) == 2

    (cached[0] / "Model.json").write_text("{damaged")  # a damaged copy: converted again, and replaced
    tok, model = _load_gguf(gguf, torch.bfloat16, Tok, Model)
    assert model.value == "Model of m.gguf" and len(_Saved.converted) == 6
    _load_gguf(gguf, torch.bfloat16, Tok, Model)
    assert len(_Saved.converted) == 6

    blocked = tmp_path / "ro"
    blocked.write_text("not a directory")  # the cache cannot be created: loads still work
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    tok, model = _load_gguf(gguf, torch.bfloat16, Tok, Model)
    assert model.value == "Model of m.gguf" and len(_Saved.converted) == 8
