"""Conversations in LLaVA's format (data/conversations.py): rendered with the chat template of a tokenizer_config.json
as transformers renders it, the loss on the assistant's tokens only; bad conversations skipped and counted."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from disttrain_core.config import compose
from disttrain_core.data.bad_sample import BadSample
from disttrain_core.data.conversations import TEMPLATES
from disttrain_core.data.samples import SampleEncoder
from disttrain_core.data.tokenizer import ByteTokenizer, build_tokenizer

from ..conftest import REPO

CHATML = TEMPLATES["chatml"]
LLAVA = {
    "image": "coco/000000033471.jpg",
    "conversations": [
        {"from": "human", "value": "<image>\nWhat colour is the bus?"},
        {"from": "gpt", "value": "The bus is red and white."},
        {"from": "human", "value": "Where is it going?"},
        {"from": "gpt", "value": "To the city centre, by its sign."},
    ],
}


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """A small byte-level BPE with ChatML's special tokens, and a tokenizer_config.json holding the template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("chatml")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = (REPO / "tests" / "data" / "scripts_corpus.txt").read_text().splitlines()
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _jpg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 20, 20)).save(buffer, format="JPEG")
    return buffer.getvalue()


def _encoder(tokenizer, *overrides, template="auto"):
    model = compose(["model=mllm_tiny", "model.seq_len=512", *overrides]).model
    return SampleEncoder(model, tokenizer, seed=0, max_image_pixels=10**7, chat_template=template)


def _members(record) -> dict[str, bytes]:
    return {"json": json.dumps(record).encode(), "jpg": _jpg()}


def test_labels_are_the_assistants_tokens_only_with_the_template_of_tokenizer_config(chatml_tokenizer):
    tok = build_tokenizer(str(chatml_tokenizer / "tokenizer.json"))
    encoder = _encoder(tok)
    row = encoder.plan("k", _members(LLAVA))
    trained = row.labels[row.labels != -100].tolist()
    end = tok.encode_template("<|im_end|>\n")
    assistant = [m["value"] for m in LLAVA["conversations"] if m["from"] == "gpt"]
    assert trained == [i for text in assistant for i in tok.encode(text) + end]
    assert end[0] == tok.token_to_id("<|im_end|>")  # the template's mark is the special token, not its characters
    # each kept label is the next token
    where = np.flatnonzero(row.labels != -100)
    assert (row.tokens[where + 1] == row.labels[where]).all()
    # the image sits where <image> was, its patches untrained
    assert (row.tokens == tok.image_id).sum() == encoder.image_tokens and len(row.images) == 1
    assert not np.isin(row.labels, [tok.image_id]).any()


def test_the_rendered_ids_equal_transformers_apply_chat_template(chatml_tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(chatml_tokenizer / "tokenizer.json"))
    hf.chat_template = CHATML
    text_only = [{"from": m["from"], "value": m["value"].replace("<image>\n", "")} for m in LLAVA["conversations"]]
    messages = [{"role": "user" if m["from"] == "human" else "assistant", "content": m["value"]} for m in text_only]
    want = hf.apply_chat_template(messages, tokenize=True)
    want = list(want if isinstance(want, list) else want["input_ids"])
    tok = build_tokenizer(str(chatml_tokenizer / "tokenizer.json"))
    row = _encoder(tok, "model=llama_tiny", "model.seq_len=512", "model.llm.vocab_size=700").plan(
        "k", {"json": json.dumps({"conversations": text_only}).encode()}
    )
    got = row.tokens.tolist()[1 : 1 + len(want)]  # after <bos>
    assert got == want, tok.decode(got)


def test_a_named_template_with_the_byte_tokenizer_trains_the_eos_it_spells():
    tok = ByteTokenizer()
    row = _encoder(tok, template="vicuna").plan("k", _members(LLAVA))
    trained = row.labels[row.labels != -100].tolist()
    assert trained == list(b"The bus is red and white.") + [tok.eos_id] + list(b"To the city centre, by its sign.") + [
        tok.eos_id
    ]
    assert row.tokens.tolist().count(tok.eos_id) == 3  # the two turns' </s> and the row's end (not trained)


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"conversations": [{"from": "human", "value": "hello?"}]}, "no_assistant_turn"),
        ({"conversations": [{"from": "robot", "value": "beep"}]}, "bad_conversation"),
        ({"conversations": []}, "bad_conversation"),
        (
            {"conversations": [{"from": "human", "value": "<image> <image>"}, {"from": "gpt", "value": "two"}]},
            "missing_image",
        ),
    ],
)
def test_a_bad_conversation_is_a_bad_sample_with_its_reason(record, reason):
    with pytest.raises(BadSample) as error:
        _encoder(ByteTokenizer()).plan("k", _members(record))
    assert error.value.reason == reason


def test_a_chat_template_that_cannot_be_used_is_refused_before_launch(compose_cfg, tmp_path):
    from disttrain_core.validation import ConfigError, validate_config

    with pytest.raises(ConfigError, match="data.chat_template=nope: use auto .* vicuna, chatml, llama3"):
        validate_config(compose_cfg("data.chat_template=nope"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="its Jinja does not compile"):
        validate_config(compose_cfg(f"data.chat_template={broken}"))


def test_packed_conversations_each_have_the_loss_they_have_alone(tmp_path):
    """A corpus of conversations (and one plain text) packed into one row: each document's loss sum there equals
    its loss alone within 1e-5 (document attention), and only assistant tokens are labels."""
    import torch
    import torch.nn.functional as F

    from disttrain_core.config import LlamaConfig
    from disttrain_core.data.corpus import CorpusDocuments
    from disttrain_core.data.packing import pack_rows
    from disttrain_core.models.llama import Documents, Llama

    records = [
        LLAVA,
        {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello there."}]},
        {"text": "a plain document: every next token is a label"},
        {"conversations": [{"from": "system", "value": "Be brief."}, *LLAVA["conversations"][2:]]},
    ]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    corpus = CorpusDocuments(str(path), ByteTokenizer(), max_len=1024, template=TEMPLATES["vicuna"])
    docs = corpus.documents(0, len(records))
    masks = corpus.masks
    assert [m is None for m in masks] == [False, False, True, False]
    capacity = sum(d.numel() for d in docs)
    packed = pack_rows(docs, [list(range(len(docs)))], capacity, masks=masks)
    for i, (doc, mask) in enumerate(zip(docs, masks, strict=True)):
        labels = packed.labels[packed.doc_ids == i]
        want = doc[1:] if mask is None else doc[1:][mask[1:]]
        assert labels[labels != -100].tolist() == want.tolist()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=263, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128), capacity)

    def losses(rows) -> torch.Tensor:
        logits = model(rows.tokens, Documents(rows.doc_ids, rows.positions))
        return F.cross_entropy(logits.flatten(0, 1), rows.labels.flatten(), reduction="none").view_as(rows.labels)

    with torch.no_grad():
        together = losses(packed)
        for i, (doc, mask) in enumerate(zip(docs, masks, strict=True)):
            alone = losses(pack_rows([doc], [[0]], doc.numel(), masks=[mask])).sum()
            assert torch.allclose(together[packed.doc_ids == i].sum(), alone, atol=1e-5, rtol=0), i
