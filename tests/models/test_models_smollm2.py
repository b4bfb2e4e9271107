"""SmolLM2-135M-Instruct (the embedded GGUF, Q4_1) against transformers + torch on the same weights.

The reference is transformers' own GGUF reader (its dequantisation and its
reversal of llama.cpp's Q/K permutation) loaded into LlamaForCausalLM, so our
un-permutation is checked independently. (`from_pretrained(gguf_file=...)`
needs `accelerate`, which is not a dependency; `load_gguf_checkpoint` does not.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models.loading import Tokenizer, default_gguf_path, load_pretrained
from rljax.models.transformer import init_cache

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write one sentence about the moon and one about the sea."}]
TEXTS = ["Hello world!", "The year 2024 had 366 days.", "  spaces\n\nnewlines\ttabs",
         "héllo wörld 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def ours():
    return load_pretrained("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def reference():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_gguf_path()
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    assert result.missing_keys in ([], ["lm_head.weight"]) and not result.unexpected_keys
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


@pytest.fixture(scope="module")
def greedy(ours):
    """Prompt ids, prompt logits and 20 greedy tokens from our model through the KV cache."""
    model, tokenizer = ours
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, positions, cache):
        out = nnx.merge(graphdef, state)(tokens, positions, cache=cache)
        return out.logits, out.cache

    P = len(prompt)
    cache = init_cache(model.config, 1, P + NEW_TOKENS, jnp.float32)
    logits, cache = step(state, jnp.asarray([prompt]), jnp.arange(P)[None], cache)
    prompt_logits = np.asarray(logits[0])
    generated = [int(jnp.argmax(logits[0, -1]))]
    for i in range(NEW_TOKENS - 1):
        logits, cache = step(state, jnp.asarray([[generated[-1]]]), jnp.asarray([[P + i]]), cache)
        generated.append(int(jnp.argmax(logits[0, -1])))
    return prompt, prompt_logits, generated


def test_config_is_smollm2(ours):
    model, tokenizer = ours
    c = model.config
    assert (c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.mlp_dim) == (49152, 576, 30, 9, 3, 1536)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 49152)


def test_chat_template_and_token_ids_match_transformers(ours, reference):
    _, tokenizer = ours
    _, ref_tokenizer = reference
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text == ref_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    for t in TEXTS + [text]:
        ids = tokenizer.encode(t)
        assert ids == ref_tokenizer(t, add_special_tokens=False).input_ids, t
        assert tokenizer.decode(ids) == t
    # Digits are split one by one (SmolLM2's pre-tokenizer): " 2024" -> " ", "2", "0", "2", "4".
    assert len(tokenizer.encode(" 2024")) == 5
    # Special tokens stay whole and can be skipped on decode.
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.decode([2, 19556], skip_special_tokens=True) == "Hello"


def test_tokenizer_saved_as_hf_directory_round_trips(ours, tmp_path):
    _, tokenizer = ours
    tokenizer.save(tmp_path)
    again = Tokenizer.from_directory(tmp_path)
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == (1, 2, 2)
    assert again.apply_chat_template(MESSAGES) == tokenizer.apply_chat_template(MESSAGES)
    for t in TEXTS:
        assert again.encode(t) == tokenizer.encode(t)


def test_prompt_logits_match_transformers(greedy, reference):
    import torch

    prompt, logits, _ = greedy
    model, _ = reference
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(logits - ref).max() < 1e-3


def _past(model, output):
    """Keyword passing the output's KV cache back (`past_key_values` became `cache` in transformers 5)."""
    import inspect

    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": output.cache}
    return {"past_key_values": output.past_key_values}


def test_greedy_continuation_matches_transformers(greedy, reference, ours):
    import torch

    prompt, _, generated = greedy
    model, _ = reference
    ref_generated = []
    with torch.no_grad():  # greedy without a stop token, so both run the full 20 tokens
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(NEW_TOKENS):
            ref_generated.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([ref_generated[-1:]]), **_past(model, out), use_cache=True)
    assert generated == ref_generated
    text = ours[1].decode(generated)
    assert "moon" in text.lower(), text  # the weights make sense, not just agree
