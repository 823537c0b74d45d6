"""Train a byte-level BPE tokenizer on local files with the `tokenizers` package (seconds; nothing downloaded).

    python examples/data/train_tokenizer.py --vocab-size 4096 --out tokenizer/ FILE...

Writes OUT/tokenizer.json with `<|endoftext|>` as its end-of-text token, the token `shardwise prepare` puts
after every document. Any Hugging Face `tokenizer.json` works the same way with `shardwise prepare`.
"""

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("files", nargs="+", help="text files to learn the merges from")
parser.add_argument("--vocab-size", type=int, default=4096)
parser.add_argument("--out", required=True, help="directory to write tokenizer.json into")
args = parser.parse_args()

tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tokenizer.train(args.files, trainer)
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
tokenizer.save(str(out / "tokenizer.json"))
print(f"wrote {out / 'tokenizer.json'}: {tokenizer.get_vocab_size()} tokens")
