"""The planner's price of packed documents that attend only within themselves (``ModelSpec.with_documents``,
``planner/documents.py``) and the runtime's wiring of ``data.document_mask`` into it.

Expected attention FLOPs are computed here from the shapes (a document of ``d`` tokens: ``s`` query rows against
``d`` keys, ``2·s·d·width·heads`` per core GEMM), never read back from the code under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardwise.planner import PRESETS, Hardware, Layout, ModelSpec, predict
from shardwise.planner.documents import row_document_length

S, D = 2048, 256


def _llama(seq_len: int = S, **kw: object) -> ModelSpec:
    return ModelSpec.llama(n_layer=2, hidden=512, heads=8, kv_heads=2, vocab_size=4096, seq_len=seq_len, **kw)


def _cores(spec: ModelSpec) -> list[list]:
    return [[g for g in layer.gemms if not g.weight] for layer in spec.layers if layer.kind == "block"]


def _hw() -> Hardware:
    return Hardware.resolve("h100-80g-sxm") if "h100-80g-sxm" in PRESETS else next(iter(PRESETS.values()))


def _time(spec: ModelSpec, **plan: object) -> tuple[float, float]:
    fields = dict(dp=1, micro_batch=1, precision="bf16", **plan)
    pred = predict(spec, Layout(**fields), _hw(), global_batch=int(fields.get("dp", 1)) * 4)
    return pred.step_time_s, pred.memory.activations


DEEPSEEK = dict(model_type="deepseek_v3", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=1024, intermediate_size=512, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=64, first_k_dense_replace=1)


@pytest.mark.parametrize("kind", ["gpt", "llama", "mla"])
def test_core_flops_are_queries_times_document_keys(kind):
    if kind == "gpt":
        spec, heads, widths = ModelSpec.gpt(n_layer=2, n_embd=384, n_head=6, vocab_size=1000, seq_len=S), 6, (64, 64)
    elif kind == "llama":
        spec, heads, widths = _llama(), 8, (64, 64)
    else:  # multi-head latent attention: query/key width nope + rope, value width v_dim
        spec, heads, widths = ModelSpec.from_hf(DEEPSEEK, seq_len=S), 4, (16 + 8, 16)
    docs = spec.with_documents(D)
    for plain, cores in zip(_cores(spec), _cores(docs)):
        assert [g.flops for g in cores] == [2.0 * S * D * w * heads for w in widths]
        assert [g.flops for g in plain] == [2.0 * S * S * w * heads for w in widths]
    weights = [[g for g in layer.gemms if g.weight] for layer in spec.layers]
    assert weights == [[g for g in layer.gemms if g.weight] for layer in docs.layers]
    assert docs.params == spec.params and docs.meta["documents"] == D


def test_sliding_window_cores():
    w = 512
    cfg = dict(model_type="mistral", hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1024, intermediate_size=512, sliding_window=w)
    spec = ModelSpec.from_hf(cfg, seq_len=S)
    # documents shorter than the window: causal over the document (a fused kernel halves it)
    short = _cores(spec.with_documents(D))[0]
    assert [(g.flops, g.causal) for g in short] == [(2.0 * S * D * 64 * 4, True)] * 2
    # longer: a query at position i of a document sees min(i + 1, w) keys, w - w²/(2d) on average
    d = 1024
    keys = w - w * w / (2 * d)
    long = _cores(spec.with_documents(d))[0]
    assert [g.causal for g in long] == [False, False]
    assert [g.flops for g in long] == [pytest.approx(2.0 * S * keys * 64 * 4, rel=2e-3)] * 2


def test_kept_scores_and_their_traffic_shrink_unfused_only():
    for dropout, traffic in ((False, 2.0), (True, 4.5)):  # elements per score: softmax r+w (+ dropout r, w, mask)
        spec = ModelSpec.gpt(n_layer=2, n_embd=256, n_head=4, vocab_size=512, seq_len=S, attention="unfused",
                             dropout=dropout)
        docs = spec.with_documents(D)
        for a, b in zip(spec.layers[1:-1], docs.layers[1:-1]):
            assert b.act_attn == pytest.approx(a.act_attn * D / S)
            assert a.ew_tp - b.ew_tp == pytest.approx(traffic * 4 * S * (S - D))
        assert _time(docs)[1] < _time(spec)[1]
    flash = _llama()
    # a fused kernel keeps one log-sum-exp per row and query head: O(s), not shrunk
    assert [x.act_attn for x in flash.with_documents(D).layers] == [x.act_attn for x in flash.layers]


@pytest.mark.parametrize("attention", ["flash", "unfused"])
def test_predictions_faster_with_documents_equal_at_sequence_length(attention):
    spec = _llama(attention=attention)
    t_plain, m_plain = _time(spec)
    assert _time(spec.with_documents(D))[0] < t_plain
    assert _time(spec.with_documents(S)) == (t_plain, m_plain)
    assert _time(spec.with_documents(10 * S)) == (t_plain, m_plain)
    assert _time(spec.with_documents(S).for_cp(2), cp=2) == _time(spec.for_cp(2), cp=2)


def test_kept_by_with_seq_len_and_composes_with_adapters_and_replicate():
    spec = _llama()
    docs = spec.with_documents(D)
    longer = docs.with_seq_len(2 * S)
    assert longer.layers == spec.with_seq_len(2 * S).with_documents(D).layers
    assert [g.flops for g in _cores(longer)[0]] == [2.0 * 2 * S * D * 64 * 8] * 2
    adapters = {"layers.0": 1000, "layers.1": 1000}
    both = spec.with_adapters(adapters).with_documents(D)
    assert both.layers == spec.with_documents(D).with_adapters(adapters).layers
    again = both.with_seq_len(S // 2)
    assert again.layers == _llama(S // 2).with_adapters(adapters).with_documents(D).layers
    pinned = docs.replicate(["layers.0"])
    assert pinned.layers[1].replicated and _cores(pinned) == _cores(docs)


def test_context_parallel_of_documents():
    spec, cp = _llama(), 2
    local = spec.with_documents(D).for_cp(cp)
    # one cp rank: its S/cp queries against their documents' D keys, per core GEMM
    for cores in _cores(local):
        assert sum(g.flops for g in cores) == pytest.approx(2 * 2.0 * (S / cp) * D * 64 * 8)
        assert all(g.causal for g in cores)
    plain_local = spec.for_cp(cp)
    # everything else is what cp does to the model without documents
    strip = [[g for g in layer.gemms if g.weight] for layer in local.layers]
    assert strip == [[g for g in layer.gemms if g.weight] for layer in plain_local.layers]
    assert [x.act_tp for x in local.layers] == [x.act_tp for x in plain_local.layers]
    assert _time(local, cp=cp)[0] < _time(plain_local, cp=cp)[0]
    assert local.with_seq_len(2 * S).layers == spec.with_seq_len(2 * S).with_documents(D).for_cp(cp).layers
    with pytest.raises(ValueError, match=r"view of one of cp = 2 ranks; take with_documents of the whole model"):
        plain_local.with_documents(D)


def test_bad_lengths_are_one_line_errors():
    spec = _llama()
    for bad in (0, 0.5, -3, float("nan"), True, "256"):
        with pytest.raises(ValueError, match=r"with_documents needs the documents' length in tokens, a number >= 1"):
            spec.with_documents(bad)  # type: ignore[arg-type]
    assert spec.with_documents(D).with_documents(D) is not None
    with pytest.raises(ValueError, match=r"already prices documents of 256 tokens"):
        spec.with_documents(D).with_documents(128)


def _row_pieces_sq(L: int, s: int) -> float:
    """Mean over every offset of a row of s tokens into a stream of documents of L tokens: Σ piece² / s."""
    total = 0.0
    for offset in range(L):
        cuts = sorted({0, s} | {b for b in range(L - offset, s, L)})
        total += sum((b - a) ** 2 for a, b in zip(cuts, cuts[1:])) / s
    return total / L


@pytest.mark.parametrize("L,s", [(100, 1000), (400, 1000), (1000, 1000), (3000, 1000)])
def test_row_document_length_is_the_rows_mean_square_piece(L, s):
    assert row_document_length(L, s) == pytest.approx(_row_pieces_sq(L, s), rel=5e-3)
    with pytest.raises(ValueError, match="positive mean document length"):
        row_document_length(0, s)


def _prepared(tmp_path: Path, *, sft: bool) -> tuple[Path, float]:
    """A tiny prepared dataset and its mean document length in tokens (EOS included), counted here."""
    tokenizers = pytest.importorskip("tokenizers")
    from shardwise.data.prepare import PrepareOptions, prepare
    from shardwise.data.toy_tokenizer import train_bpe

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    texts = [" ".join(words[(i * 5 + k) % len(words)] for k in range(3 + i % 9)) for i in range(40)]
    (tmp_path / "corpus.txt").write_text("\n".join(texts))
    tok = train_bpe([tmp_path / "corpus.txt"], 300, tmp_path / "tokenizer.json")
    encode = tokenizers.Tokenizer.from_file(str(tok)).encode
    if sft:
        src = tmp_path / "sft.jsonl"
        src.write_text("".join(json.dumps({"prompt": t, "response": t[::-1]}) + "\n" for t in texts))
        lengths = [len(encode(t, add_special_tokens=False).ids) + len(encode(t[::-1], add_special_tokens=False).ids)
                   + 1 for t in texts]
    else:
        src = tmp_path / "docs.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        lengths = [len(encode(t, add_special_tokens=False).ids) + 1 for t in texts]
    out = tmp_path / ("sft" if sft else "text")
    prepare(PrepareOptions(inputs=(str(src),), tokenizer=str(tok), out=str(out), workers=1, sft=sft))
    return out, sum(lengths) / len(lengths)


def test_runtime_prices_the_documents_the_run_masks(tmp_path: Path):
    from shardwise.runtime.config import load_config
    from shardwise.runtime.prediction import gpt_spec

    sft, sft_mean = _prepared(tmp_path, sft=True)
    text, text_mean = _prepared(tmp_path, sft=False)

    def spec(path: Path | str, mode: str) -> ModelSpec:
        return gpt_spec(load_config(overrides={"data.path": str(path), "data.document_mask": mode,
                                               "model.block_size": 64}))

    s = 64
    sft_d = sft_mean - sft_mean ** 2 / (3 * s) if sft_mean <= s else s - s * s / (3 * sft_mean)
    assert spec(sft, "auto").meta["documents"] == pytest.approx(sft_d)
    assert spec(sft, "true").meta["documents"] == pytest.approx(sft_d)
    assert "documents" not in spec(sft, "false").meta
    assert "documents" not in spec(text, "auto").meta  # auto: off for pretraining text
    want = text_mean - text_mean ** 2 / (3 * s)
    assert spec(text, "true").meta["documents"] == pytest.approx(want)
    assert "documents" not in spec("", "true").meta  # the generated corpus: no documents known
    cores = [g for g in spec(sft, "auto").layers[1].gemms if not g.weight]
    assert cores[0].n == pytest.approx(sft_d) and math.isclose(cores[1].k, sft_d)
