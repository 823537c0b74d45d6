"""Load an exported run with `transformers` alone and decode greedily (the last step of walkthrough.sh).

    python examples/data/check_export.py export/stdlib --prompt "def " --max-new-tokens 40

Prints the prompt and its continuation, as `shardwise generate RUN --temperature 0` does for the same weights.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("directory")
parser.add_argument("--prompt", required=True)
parser.add_argument("--max-new-tokens", type=int, default=40)
args = parser.parse_args()

tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{args.directory}/tokenizer.json")
model = AutoModelForCausalLM.from_pretrained(args.directory)
ids = torch.tensor([tokenizer.encode(args.prompt)])
out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                     eos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), pad_token_id=0)
print(tokenizer.decode(out[0], clean_up_tokenization_spaces=False))
