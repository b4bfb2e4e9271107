"""rljax tokenizers written as Hugging Face directories: `transformers.AutoTokenizer` reproduces their ids,
decodes and chat templates exactly (the character tokenizer, and SmolLM2's from its GGUF)."""

import pytest
import transformers

from rljax.models import Tokenizer, load_tokenizer
from rljax.models.tokenizer_export import save_hf_tokenizer, tokenizer_fingerprint, tokenizer_summary
from rljax.sampling.server import TINY_CHARS
from rljax.tasks.toy import CharTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and now?"}],
]


def _same(ours, hf, texts, conversations):
    for text in texts:
        ids = ours.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        for skip in (False, True):
            assert hf.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip), text
    for messages in conversations:
        for prompt in (True, False):
            assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                ours.apply_chat_template(messages, add_generation_prompt=prompt)


def test_char_tokenizer_round_trips_through_autotokenizer(tmp_path):
    ours = CharTokenizer(TINY_CHARS)
    hf = transformers.AutoTokenizer.from_pretrained(save_hf_tokenizer(ours, tmp_path))
    texts = ["abc=", "x = (3+4)*2, y?", "a<eos>b<pad><bos>", "  spaced  out  "]
    _same(ours, hf, texts, [[{"role": "user", "content": "abc="}, {"role": "assistant", "content": "cba"},
                             {"role": "user", "content": "xy="}]])
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, len(hf)) == (1, 2, 0, ours.vocab_size)
    with pytest.raises(Exception, match="Missing"):  # unknown characters fail, as CharTokenizer's do
        hf.encode("ABC")
    # Fingerprints tell vocabularies apart and nothing else.
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(CharTokenizer(TINY_CHARS))
    assert tokenizer_fingerprint(ours) != tokenizer_fingerprint(CharTokenizer(TINY_CHARS[::-1]))
    assert tokenizer_summary(ours)["vocab_size"] == len(TINY_CHARS) + 3


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.mark.slow
def test_smollm2_tokenizer_round_trips_through_autotokenizer(smollm2, tmp_path):
    hf = transformers.AutoTokenizer.from_pretrained(save_hf_tokenizer(smollm2, tmp_path))
    texts = ["Hello world! 12345 + 678 = 999", "héllo wörld, naïve café — 🙂 日本語", "def f(x):\n\treturn x**2\n\n",
             "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>trailing  ", "   \n \t "]
    _same(smollm2, hf, texts, CONVERSATIONS)
    assert (hf.bos_token_id, hf.eos_token_id) == (smollm2.bos_token_id, smollm2.eos_token_id)
    # A partial UTF-8 sequence decodes the same (replacement characters) on both sides.
    emoji = smollm2.encode("🙂")
    assert len(emoji) > 1 and hf.decode(emoji[:1]) == smollm2.decode(emoji[:1])


@pytest.mark.slow
def test_a_vocabulary_that_adds_bos_gets_a_post_processor(smollm2, tmp_path):
    ours = Tokenizer(smollm2.backend, bos_token_id=smollm2.bos_token_id, eos_token_id=smollm2.eos_token_id,
                     chat_template=smollm2.chat_template, add_bos_token=True)
    assert ours.add_bos_token != smollm2.add_bos_token
    hf = transformers.AutoTokenizer.from_pretrained(save_hf_tokenizer(ours, tmp_path))
    for text in ["Hello world", "x"]:
        assert hf.encode(text) == ours.encode(text, add_special_tokens=True) == [ours.bos_token_id] + ours.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    assert tokenizer_fingerprint(ours) != tokenizer_fingerprint(smollm2)
