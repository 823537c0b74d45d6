"""``shardwise generate RUN_OR_DIR --prompt TEXT``: continue a prompt with a trained run's model, a checkpoint's,
or a Hugging Face directory's, on one device with a key/value cache (``sw.generate``).

``RUN_OR_DIR`` is a ``shardwise train`` run directory (its newest intact checkpoint, any layout), a checkpoint
directory, or a Hugging Face model directory (GPT-2, Llama, Mistral, Qwen2); ``generate_load.py`` loads it and
``generate_text.py`` finds its tokenizer. Sampling: ``--temperature`` (0 = greedy; default 1.0), ``--top-k``
(0 = the whole vocabulary; default), ``--seed`` (the draws are reproducible with it; without it a random seed is
drawn and printed), ``--max-new-tokens`` (default 100, or what the model's context leaves after the prompt);
generation stops at the tokenizer's EOS. The prompt and its continuation go to stdout (``--json``: one object
with ``prompt``, ``completion``, ``tokens``, ``tokens_per_s``); the speed to stderr. Every bad input is one line
(``shardwise generate: error: ...``, exit 2), found before the weights are loaded. docs/generate.md is the guide.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time

import torch

from ..models.generate import check_request, context_length, generate
from .generate_load import UsageError, find_source, load_weights, meta_model_of
from .generate_text import find_codec

__all__ = ["add_arguments", "main", "DEFAULT_MAX_NEW_TOKENS"]

DEFAULT_MAX_NEW_TOKENS = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="RUN_OR_DIR",
                        help="a run directory (its newest intact checkpoint), a checkpoint directory, or a Hugging "
                             "Face model directory (config.json + safetensors + tokenizer.json)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                        help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS}, or fewer if the model's "
                             f"context ends first); generation also stops at the tokenizer's EOS")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T",
                        help="divide the logits by T before sampling; 0 = greedy (always the likeliest token); "
                             "default 1.0 (the model's own distribution)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample among the K likeliest tokens only; 0 = all (default)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed of the sampling generator: the same seed gives the same text (default: a random "
                             "seed, printed on stderr)")
    parser.add_argument("--device", default=None,
                        help="where to run: cuda, cuda:N or cpu (default cuda if available, else cpu)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object {prompt, completion, tokens, tokens_per_s} instead of the text")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the whole sequence every step instead of using the key/value cache (slow; "
                             "the same tokens)")


def _error(text: object) -> int:
    print("shardwise generate: error: " + " ".join(str(text).split()), file=sys.stderr)
    return 2


def _check_args(args: argparse.Namespace) -> torch.device:
    """The flags' own ranges (before the path is looked at); returns the device."""
    if not args.prompt:
        raise UsageError("--prompt is empty; give the text to continue, e.g. --prompt 'Once upon a time'")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens = {args.max_new_tokens} must be >= 1, e.g. --max-new-tokens 100")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature = {args.temperature} must be >= 0 (0: greedy, 1: the model's distribution), "
                         f"e.g. --temperature 0.8")
    if args.top_k < 0:
        raise UsageError(f"--top-k = {args.top_k} must be >= 0 (0: no filtering), e.g. --top-k 50")
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name!r}: CUDA is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name!r} is not supported; use cpu, cuda or cuda:N")
    return device


def _max_new(args: argparse.Namespace, prompt_len: int, context: int | None) -> int:
    """``--max-new-tokens``, or the default cut to what the context leaves (at least 1: an overlong prompt is
    then refused by ``check_request``)."""
    if args.max_new_tokens is not None:
        return int(args.max_new_tokens)
    if context is None:
        return DEFAULT_MAX_NEW_TOKENS
    return max(1, min(DEFAULT_MAX_NEW_TOKENS, context - prompt_len))


def _completion(decode, prompt_ids: list[int], new: list[int]) -> str:  # type: ignore[no-untyped-def]
    """The generated text: the decoded whole minus the decoded prompt (a tokenizer may join a word across the
    boundary, or drop a leading space when decoding the new tokens alone)."""
    whole, head = decode(prompt_ids + new), decode(prompt_ids)
    return whole[len(head):] if whole.startswith(head) else decode(new)


def main(args: argparse.Namespace) -> int:
    try:
        device = _check_args(args)
        src = find_source(args.path)
        model = meta_model_of(src)  # shapes only: the prompt is checked before the weights are loaded
        codec = find_codec(src)
        ids = codec.encode(args.prompt)
        if not ids:
            raise UsageError(f"--prompt {args.prompt!r} encodes to no tokens with {codec.name}; give more text")
        prompt = torch.tensor(ids, dtype=torch.int64)
        max_new = _max_new(args, len(ids), context_length(model))
        check_request(model, prompt[None], max_new, args.temperature, args.top_k)
        for line in src.warnings:
            print(f"shardwise generate: warning: {line}", file=sys.stderr)
        load_weights(model, src, device)
    except (UsageError, ValueError) as exc:
        return _error(exc)
    seed = args.seed if args.seed is not None else secrets.randbits(62)
    generator = torch.Generator(device=device).manual_seed(seed)
    start = time.perf_counter()
    out = generate(model, prompt.to(device), max_new, args.temperature, args.top_k, generator,
                   eos_token_id=codec.eos or None, use_cache=not args.no_cache)
    new = out[len(ids):].tolist()  # .tolist() waits for the device
    seconds = time.perf_counter() - start
    completion = _completion(codec.decode, ids, new)
    speed = len(new) / seconds if seconds > 0 else float("inf")
    if args.json:
        print(json.dumps({"prompt": args.prompt, "completion": completion, "tokens": new, "prompt_tokens": ids,
                          "tokens_per_s": round(speed, 2), "seed": seed}))
    else:
        print(args.prompt + completion)
    stop = "EOS" if codec.eos and new and new[-1] in codec.eos else f"{max_new} tokens"
    print(f"shardwise generate: {len(new)} tokens in {seconds:.2f} s ({speed:.1f} tokens/s; {device}, "
          f"{'no cache' if args.no_cache else 'kv cache'}, seed {seed}, stopped at {stop})", file=sys.stderr)
    return 0
