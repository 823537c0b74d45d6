"""Bad-input catalogue, command line: each case is ONE error line (exit code 2) that names the offending value and
the fix, with no Python traceback and nothing written to disk.

Every case calls ``shardwise.cli.main`` in this process (no interpreter start, no rank is ever launched: the
launchers are replaced by a failing stub), so the whole file runs in seconds. The API cases are in
``tests/unit/test_bad_inputs_api.py``; docs/failures.md "Errors: cause and fix" lists both.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Callable

import pytest

from shardwise import cli
from tests.e2e.generate_dirs import gen_dir_setup as _gen_dir
from tests.e2e.generate_dirs import gen_run_setup as _gen_run

Setup = Callable[[Path], None]


def _file(name: str, data: bytes | str) -> Setup:
    def setup(root: Path) -> None:
        (root / name).write_bytes(data.encode() if isinstance(data, str) else data)
    return setup


def _u16(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}H", *ids)


def _prepare_files(**files: str) -> Setup:
    """``tok.json`` (a word-level tokenizer with ``<|endoftext|>``, built here: no download) and text ``files``
    (``name=text``; ``__`` in a name stands for ``.``) for ``shardwise prepare`` cases."""
    def setup(root: Path) -> None:
        import tokenizers

        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "hi": 2},
                                                               unk_token="[UNK]"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        tok.save(str(root / "tok.json"))
        for name, text in files.items():
            path = root / name.replace("__", ".")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return setup


def _fake_run(name: str = "done", *, steps: int = 5, ckpt_step: int = 5, **parallel: int) -> Setup:
    """A run directory as ``shardwise train`` leaves it (``config.json``, ``checkpoints/latest`` naming a
    ``step_NNNNNN`` directory with an ``index.json``), without training: the refusals never open a tensor."""
    def setup(root: Path) -> None:
        import dataclasses

        from shardwise.runtime.config import Config, ParallelConfig, TrainConfig

        run = root / "runs" / name
        ckpt = run / "checkpoints" / f"step_{ckpt_step:06d}"
        ckpt.mkdir(parents=True)
        cfg = Config(train=dataclasses.replace(TrainConfig(), name=name, steps=steps), parallel=ParallelConfig(**parallel))
        (run / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")
        (ckpt / "index.json").write_text(json.dumps({
            "format": "shardwise-sharded-v1", "step": ckpt_step, "mesh": {"dp": 1, "tp": 1}, "world_size": 1,
            "state": {}, "tensors": {}}))
    return setup


# (id, argv, setup or None, substrings the one line must contain: the offending value first, then the fix)
CASES: list[tuple[str, list[str], Setup | None, tuple[str, ...]]] = [
    # --- config files (TOML) ---
    ("toml-missing", ["train", "--config", "nope.toml"], None,
     ("'nope.toml' does not exist", "pass the path of a TOML file")),
    ("toml-invalid", ["train", "--config", "bad.toml"], _file("bad.toml", "x = [1,\n"),
     ("'bad.toml' is not valid TOML", "fix the syntax")),
    ("toml-unknown-section", ["train", "--config", "c.toml"], _file("c.toml", "[modle]\nn_layer = 2\n"),
     ("'modle'", "did you mean 'model'?")),
    ("toml-unknown-key", ["train", "--config", "c.toml"], _file("c.toml", "[model]\nn_layr = 2\n"),
     ("'n_layr'", "did you mean 'n_layer'?")),
    ("toml-wrong-type", ["train", "--config", "c.toml"], _file("c.toml", "[model]\nn_layer = \"two\"\n"),
     ("model.n_layer must be a int, got 'two'", "e.g. --model.n_layer 2")),
    ("toml-bad-enum", ["train", "--config", "c.toml"], _file("c.toml", "[optimizer]\nname = \"adam\"\n"),
     ("optimizer.name = 'adam'", "choose one of ['adamw', 'sgd']")),
    ("toml-section-not-table", ["train", "--config", "c.toml"], _file("c.toml", "model = 3\n"),
     ("[model] must be a table of fields, got 3", "followed by lines like field = value")),
    ("toml-unknown-preset", ["train", "--config", "c.toml"], _file("c.toml", "preset = \"gpt-smal\"\n"),
     ("unknown preset 'gpt-smal'", "did you mean 'gpt-small'?")),
    # --- shardwise calibrate, and the calibration train reads ---
    ("calibrate-out-no-dir", ["calibrate", "--out", "nodir/hw.json"], None,
     ("--out 'nodir/hw.json'", "'nodir' does not exist; create it first")),
    ("calibrate-nproc-0", ["calibrate", "--nproc", "0"], None, ("-n/--nproc must be >= 1, got 0", "e.g. -n 2")),
    ("train-calibration-missing", ["train", "--parallel.calibration", "hw.json"], None,
     ("parallel.calibration: hardware calibration 'hw.json' does not exist", "shardwise calibrate --out hw.json")),
    ("train-calibration-bad-field", ["train", "--parallel.calibration", "hw.json"],
     _file("hw.json", '{"format": "shardwise-hardware/1"}'),
     ("field 'name' must be present", "regenerate it with `shardwise calibrate --out FILE`")),
    # --- flags ---
    ("flag-typo-section", ["train", "--paralel.tp", "2"], None,
     ("unknown option --paralel.tp", "did you mean --parallel.tp?")),
    ("flag-typo-field", ["train", "--parallel.tpp=2"], None,
     ("unknown option --parallel.tpp", "did you mean --parallel.tp?")),
    ("flag-other-tools-spelling", ["train", "--steps", "3"], None,
     ("unknown option --steps", "did you mean --train.steps?")),
    ("flag-lr", ["train", "--lr", "0.1"], None, ("unknown option --lr", "did you mean --optimizer.lr?")),
    ("flag-batch-size", ["train", "--batch_size", "8"], None,
     ("unknown option --batch_size", "did you mean --data.global_batch?")),
    ("flag-abbreviated", ["train", "--parallel.zero", "3"], None,
     ("unknown option --parallel.zero (options are not abbreviated)", "did you mean --parallel.zero_stage?")),
    ("flag-wrong-type", ["train", "--train.steps", "x"], None,
     ("train.steps must be a int, got 'x'", "e.g. --train.steps 2")),
    ("flag-bad-bool", ["train", "--model.bias", "maybe"], None,
     ("model.bias must be a bool, got 'maybe'", "e.g. --model.bias true")),
    ("flag-bad-enum", ["train", "--parallel.algorithm", "butterfly"], None,
     ("'butterfly'", "choose one of ['native', 'ring', 'tree', 'shm', 'auto']")),
    ("flag-bad-format", ["train", "--data.format", "csv"], None,
     ("data.format = 'csv'", "choose one of ['auto', 'text', 'bin', 'prepared']")),
    ("flag-bad-precision", ["train", "--train.precision", "fp16"], None,
     ("train.precision = 'fp16'", "choose one of ['fp32', 'bf16', 'bf16-mixed']")),
    ("preset-typo", ["train", "--preset", "gpt-smal"], None,
     ("invalid choice 'gpt-smal'", "did you mean gpt-small?")),
    ("stray-argument", ["train", "extra"], None,
     ("unexpected argument 'extra'", "see 'shardwise train --help'")),
    # --- layout and batch arithmetic ---
    ("world-size", ["train", "--parallel.nproc", "2", "--parallel.dp", "3"], None,
     ("3 × 1 × 1 = 3 must equal the number of processes parallel.nproc = 2", "set --parallel.nproc 3")),
    ("tp-heads", ["train", "--parallel.nproc", "3", "--parallel.tp", "3"], None,
     ("parallel.tp = 3 must divide model.n_head = 2", "use a tp from [1, 2]")),
    ("global-batch-under-dp", ["train", "--parallel.nproc", "4", "--data.global_batch", "2"], None,
     ("data.global_batch = 2 must be a multiple of dp = 4", "use --data.global_batch 4")),
    ("global-batch-pipeline-uncuttable", ["train", "--parallel.nproc", "2", "--parallel.pp", "2",
                                          "--parallel.pp_schedule", "interleaved", "--parallel.pp_chunks", "2",
                                          "--model.n_layer", "4", "--data.global_batch", "3"], None,
     ("parallel.micro_batch (unset) has no size up to 16", "use --data.global_batch 4")),
    ("verify-steps-disagree", ["verify", "--steps", "4", "--train.steps", "3"], None,
     ("--steps 4 and --train.steps 3 disagree", "give one of them")),
    ("zero-stage-5", ["train", "--parallel.zero_stage", "5"], None,
     ("parallel.zero_stage = 5", "e.g. --parallel.zero_stage 1")),
    ("pp-with-ring", ["train", "--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.algorithm", "ring"], None,
     ("parallel.algorithm = 'ring' with parallel.pp = 2", "use --parallel.algorithm native")),
    ("sp-without-tp", ["train", "--parallel.sequence_parallel", "true"], None,
     ("parallel.sequence_parallel = true", "parallel.tp = 1", "use --parallel.tp 2")),
    ("sp-with-replicate", ["train", "--parallel.nproc", "2", "--parallel.tp", "2", "--parallel.sequence_parallel",
                           "true", "--parallel.replicate", "wte"], None,
     ("parallel.sequence_parallel = true with parallel.replicate = ['wte']", "drop one of them")),
    ("sp-pp-uneven", ["train", "--parallel.nproc", "4", "--parallel.tp", "2", "--parallel.pp", "2",
                      "--parallel.sequence_parallel", "true", "--model.block_size", "31"], None,
     ("model.block_size = 31 divisible by parallel.tp = 2", "use --model.block_size 30")),
    ("offload-without-zero", ["train", "--parallel.offload", "optimizer"], None,
     ("parallel.offload = optimizer", "parallel.zero_stage = 0", "--parallel.zero_stage 1, 2 or 3")),
    ("offload-params-without-zero3", ["train", "--parallel.zero_stage", "2", "--parallel.offload", "params"], None,
     ("parallel.offload = params", "parallel.zero_stage = 2", "--parallel.zero_stage 3", "--parallel.offload optimizer")),
    ("offload-in-pipeline", ["train", "--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.zero_stage", "1",
                             "--parallel.offload", "optimizer"], None,
     ("parallel.offload = optimizer with parallel.pp = 2", "--parallel.offload none")),
    ("selective-with-zero-bubble", ["train", "--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.pp_schedule",
                                    "zb-h1", "--parallel.activation_checkpointing", "selective"], None,
     ("activation_checkpointing = selective", "'zb-h1'", "--parallel.activation_checkpointing full")),
    ("checkpointing-mode-unknown", ["train", "--parallel.activation_checkpointing", "some"], None,
     ("parallel.activation_checkpointing = 'some'", "['none', 'full', 'selective']")),
    ("async-tp-without-tp", ["train", "--parallel.async_tp", "true"], None,
     ("parallel.async_tp = true", "parallel.tp = 1", "use --parallel.tp 2", "--parallel.async_tp false")),
    ("cp-block-size", ["train", "--parallel.nproc", "2", "--parallel.cp", "2", "--model.block_size", "30"], None,
     ("parallel.cp = 2 splits each sequence into 2·cp = 4 chunks", "model.block_size = 30 is not divisible by 4",
      "use --model.block_size 28")),
    ("cp-dropout", ["train", "--parallel.nproc", "2", "--parallel.cp", "2", "--model.dropout", "0.1"], None,
     ("model.dropout = 0.1", "ring attention, which has no dropout", "use --model.dropout 0, or --parallel.cp 1")),
    ("compile-cp", ["train", "--parallel.nproc", "2", "--parallel.cp", "2", "--train.compile", "true"], None,
     ("train.compile = true with parallel.cp = 2 is not supported", "TorchFunctionMode",
      "use --parallel.cp 1, or --train.compile false")),
    ("compile-backend", ["train", "--train.compile", "true", "--train.compile_backend", "inductr"], None,
     ("train.compile_backend = 'inductr' is not a torch.compile backend", "e.g. --train.compile_backend inductor")),
    ("pp-schedule-typo", ["train", "--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.pp_schedule", "1fb1"],
     None, ("'1fb1'", "did you mean '1f1b'?")),
    ("pp-field-without-pp", ["train", "--parallel.pp_chunks", "2"], None,
     ("parallel.pp_chunks = 2 only applies to pipeline parallelism", "set --parallel.pp 2")),
    ("pp-microbatches", ["train", "--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.pp_microbatches", "3",
                         "--parallel.micro_batch", "16"], None,
     ("parallel.pp_microbatches = 3", "use --parallel.pp_microbatches from [1, 2, 4, 8, 16]")),
    ("pp-split-unknown", ["train", "--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.pp_split", "nope"], None,
     ("'nope' names no module", "one of ['blocks.0', 'blocks.1', 'ln_f']")),
    ("global-batch", ["train", "--parallel.nproc", "2", "--data.global_batch", "30", "--parallel.micro_batch", "16"],
     None,
     ("global_batch=30 is not a multiple of micro_batch × dp = 16 × 2 = 32", "use global_batch=32")),
    ("grad-accum-mismatch", ["train", "--parallel.nproc", "2", "--parallel.grad_accum", "2", "--data.global_batch",
                             "32", "--parallel.micro_batch", "16"], None,
     ("data.global_batch = 32 must equal parallel.micro_batch × parallel.grad_accum × dp = 16 × 2 × 2 = 64",
      "set --data.global_batch 64, or --parallel.grad_accum 1, or leave parallel.grad_accum at 0")),
    ("model-shape", ["train", "--model.n_embd", "65"], None,
     ("model.n_embd (65) must be divisible by n_head (2)", "e.g. n_embd=64")),
    # --- ranges ---
    ("memory-over-device", ["train", "--model.n_layer", "64", "--model.n_embd", "8192"], None,
     ("mb=16 fp32 is predicted to need", "--train.memory_check false launches it anyway")),
    ("negative-grad-accum", ["train", "--parallel.grad_accum", "-1"], None,
     ("parallel.grad_accum = -1 must be >= 0", "e.g. --parallel.grad_accum 0")),
    ("negative-micro-batch", ["train", "--parallel.micro_batch", "-2"], None,
     ("parallel.micro_batch = -2 must be >= 0", "0 means: infer it")),
    ("steps-zero", ["train", "--train.steps", "0"], None, ("train.steps = 0 must be >= 1", "e.g. --train.steps 1")),
    ("timeout-zero", ["train", "--train.timeout_s", "0"], None,
     ("train.timeout_s = 0.0", "e.g. --train.timeout_s 60")),
    ("bucket-cap-zero", ["train", "--parallel.bucket_cap_mb", "0"], None,
     ("parallel.bucket_cap_mb = 0.0 must be > 0", "e.g. --parallel.bucket_cap_mb 25")),
    ("lr-negative", ["train", "--optimizer.lr", "-1"], None, ("optimizer.lr = -1.0 must be >= 0", "e.g. --optimizer.lr")),
    ("min-lr-above-lr", ["train", "--optimizer.lr", "0.001", "--optimizer.min_lr", "0.01"], None,
     ("optimizer.min_lr = 0.01 must be in [0, optimizer.lr = 0.001]", "e.g. --optimizer.min_lr 0.0001")),
    # --- data files ---
    ("data-missing", ["train", "--data", "missing.txt"], None,
     ("missing.txt' does not exist", "pass a text file or a uint16 .bin file")),
    ("data-empty", ["train", "--data", "empty.txt"], _file("empty.txt", b""),
     ("empty.txt' is empty (0 bytes)", "drop --data to train on the generated corpus")),
    ("data-too-small", ["train", "--data", "small.txt"], _file("small.txt", "tiny corpus " * 40),
     ("small.txt' holds 480 tokens", "use more data or a smaller global batch / block size")),
    ("data-token-over-vocab", ["train", "--data", "ids.bin"], _file("ids.bin", _u16(list(range(300)) * 10)),
     ("contains token id 299 but model.vocab_size = 256", "set --model.vocab_size 300 or larger")),
    ("data-odd-bin", ["train", "--data", "odd.bin"], _file("odd.bin", b"abc"),
     ("odd.bin' has 3 bytes, not a whole number of uint16 tokens", "ids.astype('<u2').tofile(path)")),
    ("eval-without-validation-data", ["train", "--train.eval_every", "10"], None,
     ("train.eval_every = 10 needs validation data", "pass --data.val_path PATH")),
    ("eval-every-negative", ["train", "--train.eval_every", "-1"], None,
     ("train.eval_every = -1 must be >= 0", "e.g. --train.eval_every 0")),
    ("eval-batches-zero", ["train", "--train.eval_batches", "0"], None,
     ("train.eval_batches = 0 must be >= 1", "e.g. --train.eval_batches 1")),
    ("val-data-too-small", ["train", "--train.eval_every", "10", "--data.val_path", "v.txt"],
     _file("v.txt", "tiny corpus " * 40),
     ("data.val_path = ", "fewer than one validation batch's data.global_batch=32")),
    ("val-data-over-vocab", ["train", "--train.eval_every", "10", "--data.val_path", "v.bin"],
     _file("v.bin", _u16(list(range(300)) * 40)),
     ("data.val_path = ", "contains token id 299 but model.vocab_size = 256")),
    ("clip-negative", ["train", "--optimizer.clip_grad_norm", "-1"], None,
     ("optimizer.clip_grad_norm = -1.0 must be a finite number >= 0", "e.g. --optimizer.clip_grad_norm 1.0")),
    # --- run directories and --resume ---
    ("resume-nothing", ["train", "--resume", "runs/none"], None,
     ("no such run directory: 'runs/none' (no runs in 'runs')", "start a fresh run without --resume")),
    ("resume-misspelt", ["train", "--resume", "runs/dnoe"], _fake_run("done"),
     ("no such run directory: 'runs/dnoe' (runs in 'runs': done)", "pass one of them")),
    ("resume-no-checkpoint", ["train", "--resume", "runs/empty"], lambda root: (root / "runs" / "empty").mkdir(parents=True),
     ("no intact checkpoint in 'runs/empty'", "start a fresh run without --resume")),
    ("resume-kept-tp-too-wide", ["train", "--resume", "runs/done", "--parallel.pp", "2", "--parallel.nproc", "2",
                                 "--train.steps", "9"],
     _fake_run("done", nproc=2, dp=1, tp=2),
     ("the saved layout is dp 1 × tp 2 × pp 1 × cp 1, ZeRO-0 on 2 processes", "(kept from the saved run: tp 2)",
      "pass --parallel.tp 1 (dp 1 × tp 1 × pp 2 × cp 1, ZeRO-0 on 2 processes) or --parallel.nproc 4")),
    ("checkpoints-without-overwrite", ["train", "--train.name", "done"], _fake_run("done"),
     ("'runs/done' already holds checkpoints", "continue it with --resume, start over with --overwrite")),
    ("resume-finished", ["train", "--resume", "runs/done"], _fake_run("done", steps=5, ckpt_step=5),
     ("is at step 5 and train.steps = 5", "pass --train.steps N with N > 5")),
    # --- shardwise prepare (workers 1: the cases that read inputs encode in this process) ---
    ("prepare-tokenizer-missing", ["prepare", "a.txt", "--tokenizer", "nope.json", "--out", "ds"],
     _prepare_files(a__txt="hi"), ("--tokenizer 'nope.json' does not exist", "pass a tokenizer.json file")),
    ("prepare-tokenizer-dir-without-json", ["prepare", "a.txt", "--tokenizer", "m", "--out", "ds"],
     _prepare_files(a__txt="hi", **{"m/README": "no tokenizer here"}),
     ("--tokenizer 'm' is a directory without tokenizer.json", "pass a directory that has one")),
    ("prepare-input-missing", ["prepare", "missing.txt", "--tokenizer", "tok.json", "--out", "ds"], _prepare_files(),
     ("input 'missing.txt' does not exist", "pass text files, .jsonl files")),
    ("prepare-empty-input", ["prepare", "empty.txt", "--tokenizer", "tok.json", "--out", "ds", "--workers", "1"],
     _prepare_files(empty__txt=""), ("'empty.txt' hold no documents with any tokens (1 empty)", "pass files with text")),
    ("prepare-bad-json", ["prepare", "x.jsonl", "--tokenizer", "tok.json", "--out", "ds", "--workers", "1"],
     _prepare_files(x__jsonl='{"text": "hi"}\n{"text": hi}\n'),
     ("x.jsonl:2: not valid JSON (Expecting value: line 1 column 10", "fix the line or remove it")),
    ("prepare-missing-field", ["prepare", "x.jsonl", "--tokenizer", "tok.json", "--out", "ds", "--workers", "1"],
     _prepare_files(x__jsonl='{"content": "hi", "id": 3}\n'),
     ("x.jsonl:1: no field 'text' (fields: ['content', 'id'])", "pass --field NAME")),
    ("prepare-sft-empty-response", ["prepare", "x.jsonl", "--sft", "--tokenizer", "tok.json", "--out", "ds",
                                    "--workers", "1"], _prepare_files(x__jsonl='{"prompt": "hi", "response": ""}\n'),
     ("x.jsonl:1: the response (field 'response') has no tokens", "fix the record or remove it")),
    ("prepare-out-exists", ["prepare", "a.txt", "--tokenizer", "tok.json", "--out", "ds"],
     _prepare_files(a__txt="hi", **{"ds/dataset.json": "{}"}),
     ("--out 'ds' already exists", "pass --force to replace it")),
    ("prepare-val-fraction", ["prepare", "a.txt", "--tokenizer", "tok.json", "--out", "ds", "--val-fraction", "1.5"],
     _prepare_files(a__txt="hi"), ("--val-fraction must be in [0, 1), got 1.5", "e.g. --val-fraction 0.01")),
    # --- other commands ---
    ("unknown-command", ["trian"], None, ("invalid choice 'trian'", "did you mean train?")),
    ("unknown-bench-kind", ["bench", "nope"], None, ("invalid choice 'nope'", "choose from comm, dp, sbp")),
    ("bench-without-kind", ["bench"], None, ("give a KIND: comm, dp", "see 'shardwise bench --help'")),
    ("bench-bad-option", ["bench", "comm", "--itres", "3"], None, ("unknown option --itres", "did you mean --iters?")),
    ("run-n-zero", ["run", "-n", "0", "x.py"], _file("x.py", "print('hi')\n"),
     ("-n/--nproc = 0 must be >= 1", "e.g. shardwise run -n 2 x.py")),
    ("run-missing-script", ["run", "missing.py"], None,
     ("script 'missing.py' does not exist", "pass the path of a Python file")),
    ("run-bad-int", ["run", "-n", "two", "x.py"], None, ("invalid int value: 'two'", "see 'shardwise run --help'")),
    ("schedule-bad-name", ["schedule", "-s", "1fb1"], None,
     ("unknown pipeline schedule '1fb1'", "did you mean '1f1b'?")),
    ("schedule-bad-cost", ["schedule", "--costs", "F=x"], None, ("got 'x'", "e.g. --costs F=1")),
    ("schedule-missing-file", ["schedule", "--file", "missing.txt"], None,
     ("cannot read --file 'missing.txt'", "pass a text file with one line of actions per rank")),
    ("schedule-zero-ranks", ["schedule", "-p", "0"], None, ("p (pipeline ranks)", "got 0")),
    ("verify-bad-layout", ["verify", "--parallel.nproc", "3", "--parallel.tp", "3"], None,
     ("parallel.tp = 3 must divide model.n_head = 2", "use a tp from [1, 2]")),
    ("verify-steps-zero", ["verify", "--steps", "0"], None, ("--steps = 0 must be >= 1", "--steps")),
    ("export-no-checkpoint", ["export", "nowhere"], None, ("'nowhere'", "train first or pass the right path")),
    ("export-missing-path", ["export"], None,
     ("the following arguments are required: path", "see 'shardwise export --help'")),
    ("export-hf-no-out", ["export", "nowhere", "--format", "hf"], None, ("--format hf needs --out DIR",)),
    ("export-peft-no-out", ["export", "nowhere", "--format", "peft"], None, ("--format peft needs --out DIR",)),
    ("export-merge-lora-not-hf", ["export", "nowhere", "--merge-lora", "--out", "x.safetensors"], None,
     ("--merge-lora writes a merged Hugging Face directory", "pass it with --format hf")),
    ("export-hf-out-not-model-dir", ["export", "nowhere", "--format", "hf", "--out", "."], _file("notes.txt", "mine"),
     ("--out '.' is a non-empty directory without config.json", "pass a new or empty directory")),
    ("export-bad-format", ["export", "nowhere", "--format", "onnx"], None,
     ("--format: invalid choice 'onnx'", "choose from safetensors, hf")),
    ("plot-no-run", ["plot", "nowhere"], None, ("'nowhere/metrics.jsonl' does not exist", "pass the directory")),
    # --- shardwise generate ---
    ("generate-missing-path", ["generate", "nope", "--prompt", "hi"], None,
     ("RUN_OR_DIR 'nope' does not exist", "pass a run directory")),
    ("generate-not-a-model-dir", ["generate", ".", "--prompt", "hi"], _file("notes.txt", "mine"),
     ("'.' is not a run, a checkpoint or a Hugging Face model directory", "pass a run directory")),
    ("generate-run-without-checkpoint", ["generate", "runs/r", "--prompt", "hi"], _gen_run(checkpoint=False),
     ("run 'runs/r' holds no checkpoint", "train it until it saves one")),
    ("generate-empty-prompt", ["generate", "m", "--prompt", ""], None,
     ("--prompt is empty", "e.g. --prompt 'Once upon a time'")),
    ("generate-max-new-zero", ["generate", "m", "--prompt", "w1", "--max-new-tokens", "0"], None,
     ("--max-new-tokens = 0 must be >= 1", "e.g. --max-new-tokens 100")),
    ("generate-negative-temperature", ["generate", "m", "--prompt", "w1", "--temperature", "-1"], None,
     ("--temperature = -1.0 must be >= 0", "e.g. --temperature 0.8")),
    ("generate-negative-top-k", ["generate", "m", "--prompt", "w1", "--top-k", "-3"], None,
     ("--top-k = -3 must be >= 0", "e.g. --top-k 50")),
    ("generate-prompt-fills-context", ["generate", "m", "--prompt", " ".join(["w1"] * 8)], _gen_dir(),
     ("the prompt (8 tokens) leaves no room in the model's context of 8 positions", "at most 7 tokens")),
    ("generate-prompt-plus-new-too-long", ["generate", "m", "--prompt", "w1 w2 w3", "--max-new-tokens", "10"],
     _gen_dir(), ("prompt (3 tokens) + max_new_tokens (10) = 13 exceeds the model's context of 8",
                  "ask for at most 5 new tokens")),
    ("generate-token-over-vocab", ["generate", "m", "--prompt", "w1 w10"], _gen_dir(),
     ("prompt token id 10 is outside the model's vocabulary [0, 8)", "the model's own tokenizer")),
    ("generate-hf-without-tokenizer", ["generate", "m", "--prompt", "w1"], _gen_dir(tokenizer=False),
     ("holds no tokenizer.json", "copy the model's tokenizer.json into it")),
    ("generate-bin-without-tokenizer", ["generate", "runs/r", "--prompt", "hi"], _gen_run("/data/ids.bin"),
     ("data.path '/data/ids.bin'", "copy the tokenizer's tokenizer.json into the run directory")),
    ("predict-unknown-hardware", ["predict", "--parallel.nproc", "2", "--hardware", "a100"], None,
     ("unknown hardware 'a100'", "choose one of ['a100-80g-sxm', 'h100-80g-sxm', 'h200-141g-sxm']")),
    ("predict-missing-calibration", ["predict", "--parallel.nproc", "2", "--hardware", "hw.json"], None,
     ("hardware file 'hw.json' does not exist", "shardwise calibrate --out hw.json")),
    ("predict-tp-heads", ["predict", "--parallel.nproc", "3", "--parallel.tp", "3", "--hardware", "a100-80g-sxm"], None,
     ("parallel.tp = 3 must divide model.n_head = 2", "use a tp from [1, 2]")),
    ("predict-global-batch", ["predict", "--parallel.nproc", "8", "--data.global_batch", "32",
                              "--parallel.micro_batch", "16", "--hardware", "a100-80g-sxm"], None,
     ("global_batch=32 is not a multiple of micro_batch × dp = 16 × 8 = 128", "use global_batch=128")),
    ("predict-hardware-part-of-a-name", ["predict", "--parallel.nproc", "8", "--hardware", "h100"], None,
     ("unknown hardware 'h100' (did you mean 'h100-80g-sxm'?)", "choose one of")),
    ("predict-no-device-count", ["predict", "--hardware", "a100-80g-sxm"], None,
     ("parallel.nproc = 0 (infer it) needs local devices", "e.g. --parallel.nproc 8")),
]


def _snapshot(root: Path) -> dict[str, tuple[int, str] | None]:
    """Every path under ``root``: (size, sha1) of a file, None of a directory."""
    out: dict[str, tuple[int, str] | None] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = (p.stat().st_size, hashlib.sha1(p.read_bytes()).hexdigest()) if p.is_file() else None
    return out


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No case may get as far as starting ranks: every launcher function bound in a shardwise module fails."""
    import inspect
    import sys

    from shardwise.cli import run, train, verify  # noqa: F401  (bind their launchers first)

    def refuse(*args: object, **kwargs: object) -> int:
        pytest.fail("a bad input got as far as launching ranks")

    for name, module in list(sys.modules.items()):
        if name.startswith("shardwise.") and module is not None:
            for attr in ("run_local", "launch", "launch_ranks", "run_job"):
                if inspect.isfunction(getattr(module, attr, None)):
                    monkeypatch.setattr(module, attr, refuse)


XFAIL: dict[str, str] = {}


@pytest.mark.parametrize("argv,setup,expected", [
    pytest.param(*c[1:], id=c[0], marks=[pytest.mark.xfail(reason=XFAIL[c[0]], strict=False)] if c[0] in XFAIL else [])
    for c in CASES])
def test_bad_input_is_one_line_naming_value_and_fix(argv, setup, expected, tmp_path, monkeypatch, capsys, no_launch):
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        setup(tmp_path)
    before = _snapshot(tmp_path)
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors leave through SystemExit
        rc = exc.code
    out, err = capsys.readouterr()
    line = err.strip()
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and "Traceback" not in out, err
    assert line and "\n" not in line, f"not one line:\n{err}"
    assert line.startswith("shardwise") and ": error: " in line, line
    for part in expected:
        assert part in line, f"{part!r} not in {line!r}"
    assert _snapshot(tmp_path) == before, "a refused command wrote to disk"


def test_catalogue_ids_are_distinct() -> None:
    ids = [c[0] for c in CASES]
    assert len(set(ids)) == len(ids) and len(ids) >= 40
