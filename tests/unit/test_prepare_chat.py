"""``shardwise prepare --sft`` on chat records: rendered with the tokenizer's own chat template, loss on the
assistant turns only.

Small byte-level BPE tokenizers get the special tokens and the chat templates of three families (ChatML as Qwen2
writes it, Llama 3 instruct, Mistral instruct). The rendered text is compared with transformers'
``apply_chat_template`` on the same directory; the expected targets are built here from the messages alone (each
assistant content tokenised on its own, then the family's end-of-turn token), never read back from the code under
test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from shardwise.data.chat_template import ChatRenderer, find_chat_template  # noqa: E402
from shardwise.data.prepare import PrepareOptions, prepare  # noqa: E402
from shardwise.data.prepared import open_prepared  # noqa: E402
from shardwise.data.toy_tokenizer import train_bpe  # noqa: E402

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# family: (template, special tokens, tokenizer_config tokens, end-of-turn token)
FAMILIES = {
    "chatml": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
               {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "<|im_end|>"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, "<|eot_id|>"),
    "mistral": (MISTRAL, ["<unk>", "<s>", "</s>"], {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                "</s>"),
}
TALK = [{"role": "system", "content": "You answer in Greek letters."},
        {"role": "user", "content": "Name two letters."},
        {"role": "assistant", "content": "alpha and beta"},
        {"role": "user", "content": "And the last one?\n"},
        {"role": "assistant", "content": "  omega, of course  "}]  # edge spaces: Llama 3 trims them
PAIRS = TALK[1:]  # Mistral: user/assistant alternating, no system role


def _messages(family: str) -> list[list[dict[str, str]]]:
    if family == "mistral":
        return [PAIRS[:2], [{"role": "user", "content": "pi?"}, {"role": "assistant", "content": "rho sigma"}]]
    return [TALK, [{"role": "user", "content": "pi?"}, {"role": "assistant", "content": "rho sigma"}]]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bpe")
    (root / "train.txt").write_text("alpha beta gamma omega rho sigma pi letters Greek answer name of course\n" * 20)
    return train_bpe([root / "train.txt"], 300, root / "tokenizer.json")


def _tokenizer_dir(root: Path, bpe: Path, family: str, *, template: bool = True) -> Path:
    chat, specials, config, _ = FAMILIES[family]
    d = root / family
    d.mkdir()
    tok = tokenizers.Tokenizer.from_file(str(bpe))
    tok.add_special_tokens(specials)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({**config, **({"chat_template": chat} if template else {})}))
    return d


def _prepare(tmp: Path, tok_dir: Path, records: list[dict], **kw: object):
    jl = tmp / "chat.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in records))
    kw.setdefault("workers", 1)
    prepare(PrepareOptions(inputs=(str(jl),), tokenizer=str(tok_dir), out=str(tmp / "ds"), sft=True, **kw))
    ds = open_prepared(tmp / "ds", verify=True)
    n = len(ds.train.tokens)
    return ds, ds.train.tokens.read(0, n).tolist(), ds.train.mask.read(0, n).tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rendered_text_equals_transformers_apply_chat_template(tmp_path: Path, bpe: Path, family: str):
    d = _tokenizer_dir(tmp_path, bpe, family)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(d))
    renderer = ChatRenderer(*find_chat_template(d))
    for messages in _messages(family):
        for prompt in (False, True):
            ours = renderer.render(messages, add_generation_prompt=prompt)
            assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mask_covers_exactly_the_assistant_turns(tmp_path: Path, bpe: Path, family: str):
    d = _tokenizer_dir(tmp_path, bpe, family)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(d))
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    end = tok.token_to_id(FAMILIES[family][3])
    conversations = _messages(family)
    extra = {"eos_token": "<unk>"} if family == "mistral" else {}  # its </s> ends every turn: see the errors test
    ds, tokens, mask = _prepare(tmp_path, d, [{"messages": m} for m in conversations], **extra)
    want_tokens: list[int] = []
    want_targets: list[int] = []
    for messages in conversations:
        conv = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
        want_tokens += list(conv) + ([ds.eos_id] if conv[-1] != ds.eos_id else [])
        for m in messages:
            if m["role"] == "assistant":
                content = m["content"].strip() if family == "llama3" else m["content"]
                want_targets += tok.encode(content, add_special_tokens=False).ids + [end]
    assert tokens == want_tokens
    assert [t for t, m in zip(tokens, mask) if m] == want_targets
    runs = sum(1 for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1]))
    assert runs == sum(m["role"] == "assistant" for c in conversations for m in c)  # one run per turn


def test_llama3_separator_is_a_token_its_template_does_not_write(tmp_path: Path, bpe: Path):
    d = _tokenizer_dir(tmp_path, bpe, "llama3")
    ds, tokens, _ = _prepare(tmp_path, d, [{"messages": m} for m in _messages("llama3")])
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    # tokenizer_config's <|eot_id|> ends every turn: the first end-of-text name the template never writes instead
    # (docs/data.md; the toy BPE holds <|endoftext|> ahead of Llama 3's own <|end_of_text|>)
    assert ds.eos_id == tok.token_to_id("<|endoftext|>") != tok.token_to_id("<|eot_id|>")
    assert tokens.count(ds.eos_id) == 2 and tokens[-1] == ds.eos_id


def test_a_single_mistral_exchange_ends_with_its_own_eos(tmp_path: Path, bpe: Path):
    d = _tokenizer_dir(tmp_path, bpe, "mistral")  # Mistral's own vocabulary has no other end-of-text token
    ds, tokens, mask = _prepare(tmp_path, d, [{"messages": PAIRS[:2]}, {"messages": PAIRS[2:]}], eos_token="</s>")
    assert tokens.count(ds.eos_id) == 2 and tokens[-1] == ds.eos_id and mask[-1] == 1  # no second separator


def test_chat_and_prompt_response_records_mix(tmp_path: Path, bpe: Path):
    d = _tokenizer_dir(tmp_path, bpe, "chatml")
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    ds, tokens, mask = _prepare(tmp_path, d, [{"prompt": "pi", "response": "rho"},
                                              {"dialog": [{"role": "user", "content": "a"},
                                                          {"role": "assistant", "content": "b"}]}],
                                messages_field="dialog")
    p, r = tok.encode("pi", add_special_tokens=False).ids, tok.encode("rho", add_special_tokens=False).ids
    first = len(p) + len(r) + 1
    assert tokens[:first] == p + r + [ds.eos_id] and mask[:first] == [0] * len(p) + [1] * (len(r) + 1)
    targets = [t for t, m in zip(tokens[first:], mask[first:]) if m]
    assert targets == tok.encode("b", add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]
    assert tokens[-1] == ds.eos_id and mask[-1] == 0  # the separator after a chat is no target


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "a"}]}, r"chat.jsonl:1: the conversation has no assistant turn"),
    ({"messages": [{"role": "tool", "content": "a"}, {"role": "assistant", "content": "b"}]},
     r"chat.jsonl:1: message 0 has role 'tool'; roles are \['system', 'user', 'assistant'\]"),
    ({"messages": "hello"}, r"chat.jsonl:1: field 'messages' is a str, not a list of messages"),
    ({"messages": [{"role": "user"}]}, r"message 0 of 'messages' is not an object with \"role\" and \"content\""),
    ({"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}]},
     r"message 0's content is a list, not a string"),
])
def test_bad_records_are_one_line_errors(tmp_path: Path, bpe: Path, record: dict, message: str):
    d = _tokenizer_dir(tmp_path, bpe, "chatml")
    with pytest.raises(ValueError, match=message) as info:
        _prepare(tmp_path, d, [record])
    assert "\n" not in str(info.value)
    assert not (tmp_path / "ds").exists()


def test_tokenizer_setup_errors(tmp_path: Path, bpe: Path, monkeypatch: pytest.MonkeyPatch):
    talk = [{"messages": PAIRS}]
    bare = _tokenizer_dir(tmp_path, bpe, "chatml", template=False)
    with pytest.raises(ValueError, match=r"chat.jsonl:1: a chat record \(field 'messages'\), but the tokenizer has "
                                         r"no chat_template"):
        _prepare(tmp_path, bare, talk)
    mistral = _tokenizer_dir(tmp_path, bpe, "mistral")
    with pytest.raises(ValueError, match=r"writes the document separator '</s>' inside the conversation.*"
                                         r"--eos-token .*'<unk>'"):
        _prepare(tmp_path, mistral, talk, eos_token="</s>")
    with pytest.raises(ValueError, match=r"the chat template refused the conversation \(Conversation roles must "
                                         r"alternate"):
        _prepare(tmp_path, mistral, [{"messages": TALK}], eos_token="<unk>")
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ValueError, match=r'need the jinja2 package .* pip install "shardwise\[data\]"'):
        _prepare(tmp_path, mistral, talk[:1], eos_token="<unk>")


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path: Path, bpe: Path):
    d = _tokenizer_dir(tmp_path, bpe, "chatml")
    late = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% if loop.last %}{{ ' (last)' }}{% endif %}"
            "{{ '<|im_end|>' }}{% endfor %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": late}))
    with pytest.raises(ValueError, match=r"renders the conversation up to message 1 differently from the start"):
        _prepare(tmp_path, d, [{"messages": PAIRS}])


def test_workers_write_the_same_bytes(tmp_path: Path, bpe: Path):
    d = _tokenizer_dir(tmp_path, bpe, "chatml")
    records = [{"messages": TALK}, {"prompt": "x", "response": "y"}] * 3
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    _, one, mask_one = _prepare(tmp_path / "one", d, records, val_fraction=0.3)
    _, two, mask_two = _prepare(tmp_path / "two", d, records, val_fraction=0.3, workers=2)
    assert (one, mask_one) == (two, mask_two)


def test_the_command_line_reads_messages_field(tmp_path: Path, bpe: Path, capsys: pytest.CaptureFixture):
    from shardwise.cli.main import main

    d = _tokenizer_dir(tmp_path, bpe, "chatml")
    jl = tmp_path / "chat.jsonl"
    jl.write_text(json.dumps({"turns": PAIRS}) + "\n")
    argv = ["prepare", str(jl), "--sft", "--tokenizer", str(d), "--out", str(tmp_path / "ds"), "--workers", "1"]
    assert main([*argv, "--messages-field", "turns"]) == 0
    ds = open_prepared(tmp_path / "ds")
    assert ds.train.mask.read(0, len(ds.train.tokens)).sum() > 0
    assert main([*argv, "--force"]) == 2  # the default field 'messages' is not there: a prompt/response record
    assert "chat.jsonl:1: no field 'prompt'" in capsys.readouterr().err
